"""The E2B sandbox backend: the real `e2b` SDK (`AsyncSandbox`, 2.x), one microVM per sandbox.

Install with `pip install 'trajectory-recorder[e2b]'` and set `E2B_API_KEY` (or
`options["api_key"]`). `SandboxSpec` maps onto `AsyncSandbox.create`: `template`
(default: E2B's `base`), `metadata`, `env` (the sandbox's environment), and
`timeout_s` (its lifetime, rounded up to whole seconds). `options` takes the SDK's
connection settings (`api_key`, `api_url`, `sandbox_url`, `domain`,
`request_timeout`, `http_version`, `proxy`) and this backend's own:

    workdir               where commands run and relative paths point
                          (default: the sandbox user's home, asked at boot)
    user                  the sandbox user commands run as (default: E2B's)
    boot_attempts         creations tried before `SandboxBootError` (default 5)
    boot_backoff_s        first retry delay; doubles, with jitter (default 1.0)
    max_concurrent_boots  boots in flight per process (default 8; the first
                          sandbox's value sets it)

Booting: at most `max_concurrent_boots` creations run at once in a process
(E2B rate-limits creation per team), and a creation that fails for a transient
reason (429, 5xx, a transport error, envd not answering) is retried with
exponential backoff; the retries of one creation share an idempotency key, so a
creation whose answer was lost is not left running, orphaned, beside its retry. A boot is complete once envd has run
a first command (it tells the workdir), so a VM whose daemon never came up
counts as a failed boot, not as a broken rollout.

Errors: the SDK's exceptions are converted at one seam (`_sdk_errors`), by class,
never by name: a sandbox that is gone (killed, past its lifetime) is
`SandboxGone`, a missing file `FileNotFoundError`, anything else of the SDK or
the transport `SandboxError`. The SDK's own retry of API calls is off for creation
(`retries=0`): this module's loop is the one retry policy there.

Timeouts: a command's deadline is enforced here (the SDK's stream deadline is
off); past it the command is killed with SIGKILL through envd and
`CommandTimeout` is raised, and the sandbox stays usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import posixpath
import random
import shlex
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import httpx

from recorder.rollout.sandbox.base import (
    CommandHandle,
    ExecResult,
    OutputCallback,
    Sandbox,
    SandboxBootError,
    SandboxError,
    SandboxGone,
    SandboxSpec,
)

try:
    from e2b import AsyncSandbox, CommandExitException
    from e2b import exceptions as e2bx
except ImportError as exc:  # pragma: no cover - the e2b extra is installed in dev and CI
    raise ImportError(
        "the e2b sandbox backend needs the E2B SDK: pip install 'trajectory-recorder[e2b]'"
    ) from exc

# SandboxSpec.options keys handed to the SDK as connection settings.
SDK_OPTIONS = (
    "api_key",
    "api_url",
    "sandbox_url",
    "domain",
    "request_timeout",
    "http_version",
    "proxy",
    "headers",
)
DEFAULT_BOOT_ATTEMPTS = 5
DEFAULT_BOOT_BACKOFF_S = 1.0
MAX_BOOT_BACKOFF_S = 30.0
DEFAULT_MAX_CONCURRENT_BOOTS = 8
KILL_RETRIES = 3  # the SDK's own retries (429/5xx) for the DELETE that removes a sandbox
PROBE_TIMEOUT_S = 60.0  # the first command of a boot; a VM whose envd hangs is a failed boot

# Sandbox gone: the control plane does not know it, or the proxy before envd says so.
_GONE = (e2bx.SandboxNotFoundException, e2bx.SandboxNotRunningException)
# Everything the SDK raises on purpose, plus the transport under it.
_SDK_FAILURES = (
    e2bx.SandboxException,
    e2bx.AuthenticationException,
    e2bx.ServiceBusyException,
    httpx.TransportError,
    OSError,
)

_boot_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


def _boot_slot(limit: int) -> asyncio.Semaphore:
    """The process's boot semaphore (one per event loop: asyncio primitives are loop-bound)."""
    loop = asyncio.get_running_loop()
    slot = _boot_slots.get(loop)
    if slot is None:
        slot = _boot_slots[loop] = asyncio.Semaphore(limit)
    return slot


def is_transient(exc: BaseException) -> bool:
    """Whether a failed creation may succeed if tried again (by exception class)."""
    if isinstance(exc, e2bx.RateLimitException | e2bx.ServiceBusyException):
        return True
    if isinstance(
        exc,
        e2bx.AuthenticationException | e2bx.InvalidArgumentException | e2bx.TemplateException,
    ):
        return False
    if isinstance(exc, e2bx.TimeoutException):  # includes an unreachable envd
        return True
    if isinstance(exc, e2bx.SandboxException):
        return exc.status_code is None or exc.status_code >= 500
    return isinstance(exc, httpx.TransportError | OSError)


def backoff_s(attempt: int, base_s: float) -> float:
    """Exponential backoff with jitter in [50%, 100%] of the step, capped."""
    step = min(base_s * 2**attempt, MAX_BOOT_BACKOFF_S)
    return step * (0.5 + random.random() / 2)


@contextlib.contextmanager
def _sdk_errors(sandbox_id: str, what: str) -> Iterator[None]:
    """The one seam where SDK and transport errors become `SandboxError`s."""
    try:
        yield
    except _GONE as exc:
        raise SandboxGone(
            f"E2B sandbox {sandbox_id} is gone (killed or past its timeout) while trying to "
            f"{what}: {exc}; start a new sandbox"
        ) from exc
    except e2bx.FileNotFoundException as exc:
        raise FileNotFoundError(f"{what}: no such file in E2B sandbox {sandbox_id}") from exc
    except _SDK_FAILURES as exc:
        raise SandboxError(f"E2B sandbox {sandbox_id}: could not {what}: {exc}") from exc


class E2BHandle(CommandHandle):
    """A command running in an E2B sandbox, followed over envd's Start stream."""

    def __init__(self, sandbox: E2BSandbox, cmd: str, handle: Any, started: float) -> None:
        self._sandbox = sandbox
        self._cmd = cmd
        self._handle = handle
        # From before envd was asked to start it: a command's duration includes its start.
        self._started = started
        self._finished = asyncio.ensure_future(self._collect())
        # A background command nobody waits for may end in an error (its sandbox was
        # killed): that is no news, so it must not be logged as never retrieved.
        self._finished.add_done_callback(lambda f: f.cancelled() or f.exception())

    @property
    def pid(self) -> int:
        return int(self._handle.pid)

    async def _collect(self) -> ExecResult:
        with _sdk_errors(self._sandbox.id, f"run {self._cmd[:80]!r}"):
            try:
                done = await self._handle.wait()
            except CommandExitException as exit_:
                done = exit_
        return ExecResult(
            exit_code=int(done.exit_code),
            stdout=done.stdout or "",
            stderr=done.stderr or "",
            duration_s=time.monotonic() - self._started,
        )

    async def kill(self) -> None:
        if self._finished.done():
            return
        # A gone sandbox runs nothing: that is killed enough.
        with contextlib.suppress(SandboxGone), _sdk_errors(self._sandbox.id, "kill a command"):
            await self._handle.kill()
        # envd ends the stream with the exit once the process is dead.
        with contextlib.suppress(SandboxError):
            await asyncio.shield(self._finished)


class E2BSandbox(Sandbox):
    """One E2B sandbox driven through the SDK's `AsyncSandbox`."""

    disk_is_own = True  # a VM's disk of its own

    def __init__(self, sdk: Any, workdir: str, user: str | None) -> None:
        self.id = str(sdk.sandbox_id)
        self.workdir = workdir
        self._sdk = sdk
        self._user = user
        self._gone = False
        self._handles: list[E2BHandle] = []

    @classmethod
    async def create(cls, spec: SandboxSpec) -> E2BSandbox:
        """Boot a sandbox: capped by the process's boot semaphore, retried with backoff."""
        opts = spec.options
        attempts = max(1, int(opts.get("boot_attempts", DEFAULT_BOOT_ATTEMPTS)))
        base_s = float(opts.get("boot_backoff_s", DEFAULT_BOOT_BACKOFF_S))
        slot = _boot_slot(int(opts.get("max_concurrent_boots", DEFAULT_MAX_CONCURRENT_BOOTS)))
        last: BaseException | None = None
        # One key for every attempt at the same VM: when a creation's answer is lost, the
        # retry gets the sandbox the API already made instead of leaving it orphaned.
        key = str(uuid.uuid4())
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(backoff_s(attempt - 1, base_s))
            try:
                async with slot:
                    sdk = await cls._create_vm(spec, key)
                    key = str(uuid.uuid4())  # that VM is ours; another attempt needs another
                    return await cls._ready(sdk, spec)
            except _SDK_FAILURES as exc:
                if not is_transient(exc):
                    raise SandboxBootError(_boot_message(spec, exc, attempt + 1)) from exc
                last = exc
        assert last is not None
        raise SandboxBootError(_boot_message(spec, last, attempts)) from last

    @staticmethod
    async def _create_vm(spec: SandboxSpec, key: str) -> Any:
        return await AsyncSandbox.create(
            template=spec.template,
            timeout=max(1, math.ceil(spec.timeout_s)),
            metadata=dict(spec.metadata),
            envs=dict(spec.env),
            idempotency_key=key,
            retries=0,
            **_sdk_options(spec.options),
        )

    @classmethod
    async def _ready(cls, sdk: Any, spec: SandboxSpec) -> E2BSandbox:
        """A first command through envd (it tells the workdir); a VM that fails it is removed."""
        user = spec.options.get("user")
        workdir = spec.options.get("workdir")
        try:
            if workdir is None:
                done = await sdk.commands.run("pwd", user=user, timeout=PROBE_TIMEOUT_S)
                workdir = done.stdout.strip()
            else:
                mkdir = f"mkdir -p {shlex.quote(workdir)}"
                await sdk.commands.run(mkdir, user=user, timeout=PROBE_TIMEOUT_S)
        except BaseException:
            with contextlib.suppress(Exception):
                await sdk.kill(retries=KILL_RETRIES)
            raise
        return cls(sdk, workdir, user)

    # -- commands ---------------------------------------------------------------------------

    def _check(self) -> None:
        if self._gone:
            raise SandboxGone(f"E2B sandbox {self.id} was killed; start a new sandbox")

    def _abs(self, path: str | None) -> str:
        return posixpath.join(self.workdir, path) if path else self.workdir

    async def start(
        self,
        cmd: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> E2BHandle:
        self._check()
        started = time.monotonic()
        with _sdk_errors(self.id, f"start {cmd[:80]!r}"):
            handle = await self._sdk.commands.run(
                cmd,
                background=True,
                envs=dict(env or {}),
                user=self._user,
                cwd=self._abs(cwd),
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                timeout=0,  # the deadline is ours (E2BHandle.wait), not the stream's
            )
        started_handle = E2BHandle(self, cmd, handle, started)
        self._handles = [h for h in self._handles if h.running]
        self._handles.append(started_handle)
        return started_handle

    # -- files ------------------------------------------------------------------------------

    async def write_file(self, path: str, data: bytes | str) -> None:
        self._check()
        with _sdk_errors(self.id, f"write {path}"):
            await self._sdk.files.write(self._abs(path), data, user=self._user)

    async def read_file(self, path: str) -> bytes:
        self._check()
        with _sdk_errors(self.id, f"read {path}"):
            return bytes(
                await self._sdk.files.read(self._abs(path), format="bytes", user=self._user)
            )

    # -- lifetime ---------------------------------------------------------------------------

    async def end_processes(self) -> None:
        """Kills the background commands this sandbox started. A process that left them
        lives on in the VM until `kill`; it reaches nothing of the driver's but the
        files the driver reads there (the diff, written to a fresh file)."""
        self._check()
        handles, self._handles = self._handles, []
        await asyncio.gather(*(h.kill() for h in handles))

    async def kill(self) -> None:
        if self._gone:
            return
        self._gone = True
        with _sdk_errors(self.id, "kill the sandbox"):
            await self._sdk.kill(retries=KILL_RETRIES)  # False (not raised) when already gone


def _sdk_options(opts: Mapping[str, Any]) -> dict[str, Any]:
    """The SDK's connection settings from the spec (values from a CLI arrive as strings)."""
    picked = {k: opts[k] for k in SDK_OPTIONS if k in opts}
    if "request_timeout" in picked:
        picked["request_timeout"] = float(picked["request_timeout"])
    return picked


def _boot_message(spec: SandboxSpec, exc: BaseException, attempts: int) -> str:
    hint = ""
    if isinstance(exc, e2bx.AuthenticationException):
        hint = "; set E2B_API_KEY or options['api_key']"
    elif isinstance(exc, e2bx.RateLimitException):
        hint = "; lower options['max_concurrent_boots'] or the rollout concurrency"
    return (
        f"could not boot an E2B sandbox (template {spec.template or 'base'!r}) after "
        f"{attempts} attempt(s): {type(exc).__name__}: {exc}{hint}"
    )
