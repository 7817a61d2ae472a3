"""The sandbox interface every backend implements (local processes, E2B).

A sandbox is an isolated place to run commands and keep files for one
rollout: the agent's workspace, or the fresh one its patch is graded in.
Backends: `recorder.rollout.sandbox.local` (a temporary directory and a process
group per sandbox; the default) and `recorder.rollout.sandbox.e2b` (the real
`e2b` SDK). `tests/rollout/test_sandbox_suite.py` is the one suite every
backend must pass.

Errors (everything a sandbox raises on purpose derives from `SandboxError`):

    SandboxError
     ├── SandboxBootError   could not create one (after the backend's retries)
     ├── SandboxGone        it no longer exists (killed, expired): start another
     └── CommandTimeout     a command ran past its timeout; it was killed, the
                            sandbox itself is still usable

A non-zero exit code is a result (`ExecResult.exit_code`), never an exception.
A missing file is `FileNotFoundError`, never an empty result.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import msgspec

# Called with each chunk of a command's output as it arrives.
OutputCallback = Callable[[str], None]


class SandboxError(Exception):
    """Base class of every error a sandbox raises on purpose."""


class SandboxBootError(SandboxError):
    """The sandbox could not be created, after the backend's own retries."""


class SandboxGone(SandboxError):
    """The sandbox no longer exists (killed, expired); start a new one, do not retry."""


class CommandTimeout(SandboxError):
    """A command ran past its timeout and was killed; the sandbox is still usable."""

    def __init__(self, cmd: str, timeout_s: float) -> None:
        super().__init__(f"command timed out after {timeout_s:g} s and was killed: {cmd[:200]}")
        self.cmd = cmd
        self.timeout_s = timeout_s


class SandboxSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What to create: plain data, so a spec crosses process boundaries (Ray workers)."""

    backend: str = "local"  # "local" | "e2b"
    env: dict[str, str] = {}
    timeout_s: float = 3600.0  # the sandbox's lifetime; past it the backend removes it
    metadata: dict[str, str] = {}
    template: str | None = None  # e2b: the template to boot
    options: dict[str, Any] = {}  # backend-specific (e2b: api_url, sandbox_url, api_key, ...)


class ExecResult(msgspec.Struct, frozen=True):
    exit_code: int  # non-zero is a result, never an exception
    stdout: str
    stderr: str
    duration_s: float = 0.0


class CommandHandle(abc.ABC):
    """A command started in the background.

    A backend sets `_cmd` and `_finished` (a future of the command's result,
    done when it exits); waiting, its timeout and the kill it implies are
    shared here, so every backend times out the same way.
    """

    _cmd: str
    _finished: asyncio.Future[ExecResult]

    @property
    @abc.abstractmethod
    def pid(self) -> int:
        """The process id inside the sandbox."""

    @property
    def running(self) -> bool:
        """Whether the command has not ended yet."""
        return not self._finished.done()

    async def wait(self, timeout_s: float | None = None) -> ExecResult:
        """Wait for the command to end. Past `timeout_s` kill it and raise `CommandTimeout`."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._finished), timeout_s)
        except TimeoutError:
            await self.kill()
            raise CommandTimeout(self._cmd, timeout_s or 0.0) from None

    @abc.abstractmethod
    async def kill(self) -> None:
        """Kill the command and everything it started. Idempotent."""


class Sandbox(abc.ABC):
    """One isolated workspace. Use as `async with await open_sandbox(spec) as sb:`."""

    id: str
    workdir: str  # where commands run when no `cwd` is given
    # Whether the sandbox's files sit on a disk nothing else writes (an E2B VM's, a local
    # sandbox's own file system): a full disk there is the sandbox's own doing.
    disk_is_own: bool = False

    async def exec(
        self,
        cmd: str,
        *,
        timeout_s: float = 120.0,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult:
        """Run `cmd` (a shell command line) to completion, streaming output to the callbacks.

        Past `timeout_s` the command and its children are killed and
        `CommandTimeout` is raised; the sandbox stays usable. Every backend runs
        it as `start` + `wait`, so a foreground and a background command share
        one kill and timeout path.
        """
        handle = await self.start(cmd, cwd=cwd, env=env, on_stdout=on_stdout, on_stderr=on_stderr)
        return await handle.wait(timeout_s)

    @abc.abstractmethod
    async def start(
        self,
        cmd: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> CommandHandle:
        """Start `cmd` in the background and return its handle at once."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write a file (parents created). A relative path is relative to `workdir`."""

    @abc.abstractmethod
    async def read_file(self, path: str) -> bytes:
        """The file's bytes; `FileNotFoundError` if it does not exist."""

    @abc.abstractmethod
    async def end_processes(self) -> None:
        """Kill everything the sandbox's commands left running; its files stay. The
        driver calls it when the agent is done, before it reads the agent's work: a
        process left behind must not swap the files it reads, nor the driver's helpers."""

    @abc.abstractmethod
    async def kill(self) -> None:
        """Remove the sandbox and everything running in it. Idempotent; never raises
        for a sandbox that is already gone."""

    async def filled_its_own_disk(self) -> bool:
        """After a write failed for want of space: was it the sandbox's own disk that it
        filled? Then its rollout earns 0 (`diff.take_diff`); a disk it shares with others
        is infrastructure."""
        return self.disk_is_own

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.kill()
