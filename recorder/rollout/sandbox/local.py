"""The local sandbox backend (the default): a temporary directory and process groups.

A sandbox is a fresh directory (its `workdir`) that `kill` removes. Every
command runs in its own process group (`start_new_session`), so a timeout or a
kill reaches the command and everything it started. Every process also carries
`TR_SANDBOX_ID` in its environment; `kill` sweeps the process table for that
mark, so even a process that left its group (`setsid`, a daemon) dies with the
sandbox: nothing is left behind.

The contract is the shared suite's (`tests/rollout/test_sandbox_suite.py`). On top
of it, here: `exec` (and a background command) ends when its command ends; what
the command left in its group is killed then, and so is a process that left the
group still holding the command's output (it would keep the pipes open forever).
Use `start` for a server; a daemon with its own output lives until `kill`.

Environment: never the driver's whole one. Commands start from the host's
basics (`environment.host_basics`: PATH, locale, CA settings, proxies), a
`HOME` and `TMPDIR` inside the sandbox, then the spec's `env`, then their own.

Users: when the driver runs as root, each sandbox runs as an unprivileged user
of its own (`users.py`, `tr-sbx-N`), which owns the sandbox directory (0700):
it cannot read the recorder's admin token (file or `/proc/<pid>/environ`),
another sandbox's directory or root's files, and the driver's own file reads
and writes in the sandbox are done as that user too (a symlink the agent
plants reaches nothing more). `options["user"] = "driver"` opts out. Not root:
the commands run as the driver's user and a warning says so once; that is
isolation by directory and process group only, not a security boundary.
A sandbox user's commands see only that user's processes (`procview.py`: a
private `/proc` mounted `hidepid=2`), not other rollouts' command lines, and
run at most `options["max_processes"]` processes and threads at once (a fork
bomb fails inside its own sandbox), and write no file larger than
`options["max_file_size"]`. Its directory is a file system of its own,
`options["max_disk"]` big (`disk.py`): a sandbox fills that, not the host's disk.

Where: a root driver's sandboxes go under `ROOT_SANDBOXES` (not the system's
temp dir), and a sandbox refuses to start where any directory above it is
writable by every user (`/tmp`). Tools read files from every parent of where
they run: pytest takes the nearest `pytest.ini` (and the `conftest.py` beside
it) up to `/`, pyenv a `.python-version`, Node a `node_modules`. One sandbox
writing `/tmp/pytest.ini` and `/tmp/conftest.py` made every other rollout's
tests pass while it was still running (its own files are swept only when
its user is released).
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from recorder.rollout.sandbox import leftovers
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
from recorder.rollout.sandbox.disk import (
    DiskError,
    host_short,
    make_disk,
    own_disks,
    remove_disk,
)
from recorder.rollout.sandbox.environment import host_basics
from recorder.rollout.sandbox.procview import Limits, as_user, launch, private_view
from recorder.rollout.sandbox.users import (
    SandboxUser,
    UserPoolError,
    claim_user,
    kill_user_processes,
)

MARK = "TR_SANDBOX_ID"  # in every command's environment; `kill` sweeps for it
COMMAND_MARK = "TR_SANDBOX_COMMAND"  # one per command: what a finished `exec` left is swept
_CHUNK = 65536
# Processes and threads one sandbox's user may run at once: an agent (Node runs ~a dozen
# threads), its tools and a test suite fit; a fork bomb stops there (`procview.limit_argv`).
DEFAULT_MAX_PROCESSES = 1024
MIN_PROCESSES = 32
# The largest file a sandbox user's command may write (`procview.limit_argv`): a
# repository's pack, a build's artifacts and a test suite's data fit.
DEFAULT_MAX_FILE_SIZE = "8g"
MIN_FILE_SIZE = 1 << 20
# The size of a sandbox's own disk (`disk.py`): its checkout, caches, builds and test
# data fit. The image is sparse: the host's disk holds only what the sandbox writes.
DEFAULT_MAX_DISK = "16g"
MIN_DISK = 64 << 20
# How long a finished command's pipes may take to close once its group is killed,
# before the process table is searched for an escaped holder (a few ms in practice),
# and how long after that search its output is still read.
_PIPE_GRACE_S = 0.2
_PIPE_GIVE_UP_S = 5.0
# Characters of each output stream a command's result keeps: its head and its tail.
KEPT_OUTPUT = 16 * 1024 * 1024
# What the driver reads from a sandbox's files at most, and how long a read or a
# write may take (a planted FIFO or a link to /dev/zero must not hang or fill it).
MAX_READ_BYTES = 512 * 1024 * 1024
_FILE_IO_TIMEOUT_S = 300.0


class _Output:
    """One output pipe read in order: each chunk goes to the callback, then to the text
    kept, its head and its tail (`KEPT_OUTPUT` characters in all): a command printing
    gigabytes (code under test, in the grader's captured output) had every byte kept
    in the driver, which one policy could run out of memory with every rollout in it."""

    def __init__(self, pipe: IO[bytes], callback: OutputCallback | None) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._head: list[str] = []
        self._tail: collections.deque[str] = collections.deque()
        self._sizes = [0, 0]  # characters in head, tail
        self._left_out = 0
        self._callback = callback
        self.inode = os.fstat(pipe.fileno()).st_ino  # to find who else holds the pipe
        self.task = asyncio.ensure_future(self._pump(pipe))

    async def _pump(self, pipe: IO[bytes]) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=_CHUNK)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )
        try:
            while chunk := await reader.read(_CHUNK):
                self._emit(self._decoder.decode(chunk))
            self._emit(self._decoder.decode(b"", final=True))
        finally:
            transport.close()

    def _emit(self, text: str) -> None:
        if not text:
            return
        if self._callback is not None:
            self._callback(text)
        half = KEPT_OUTPUT // 2
        if self._sizes[0] < half:
            head = text[: half - self._sizes[0]]
            self._head.append(head)
            self._sizes[0] += len(head)
            text = text[len(head) :]
        if text:
            self._tail.append(text)
            self._sizes[1] += len(text)
            self._trim_tail(half)

    def _trim_tail(self, half: int) -> None:
        while self._sizes[1] > half:
            excess, first = self._sizes[1] - half, self._tail[0]
            cut = min(excess, len(first))
            if cut == len(first):
                self._tail.popleft()
            else:
                self._tail[0] = first[cut:]
            self._sizes[1] -= cut
            self._left_out += cut

    def text(self) -> str:
        gap = f"\n[... {self._left_out} characters of output left out ...]\n"
        return "".join(self._head) + (gap if self._left_out else "") + "".join(self._tail)


def _exited(proc: subprocess.Popen[bytes]) -> asyncio.Future[int]:
    """A future of the exit code that resolves when the process ends, pipes or not.

    asyncio's own `Process.wait()` also waits for the pipes to close, which a
    grandchild that outlives the command keeps open; a pidfd (Linux >= 5.3)
    tells the exit alone. Elsewhere a dedicated thread waits.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()

    def resolve(code: int) -> None:
        if not future.done():
            future.set_result(code)

    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        threading.Thread(
            target=lambda: loop.call_soon_threadsafe(resolve, proc.wait()), daemon=True
        ).start()
        return future

    def ready() -> None:
        loop.remove_reader(fd)
        os.close(fd)
        resolve(proc.wait())

    loop.add_reader(fd, ready)
    return future


class LocalHandle(CommandHandle):
    """A running command: its process is the leader of its own process group."""

    def __init__(
        self,
        cmd: str,
        mark: str,
        proc: subprocess.Popen[bytes],
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
    ) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self._cmd = cmd
        self._mark = mark
        self._proc = proc
        self._started = time.monotonic()
        self._out = _Output(proc.stdout, on_stdout)
        self._err = _Output(proc.stderr, on_stderr)
        self._finished = asyncio.ensure_future(self._finish(_exited(proc)))

    @property
    def pid(self) -> int:
        return self._proc.pid

    async def _finish(self, exited: asyncio.Future[int]) -> ExecResult:
        code = await exited
        # What the command left running would hold the pipes open forever: kill its
        # group, and if a process escaped the group (setsid), find it by its mark, and
        # then by the pipes it holds (`env -i` drops the mark: an audit's lurker hung
        # the command, its timeout, the sandbox's kill and the whole rollout).
        self._signal_group()
        readers = (self._out.task, self._err.task)
        _, pending = await asyncio.wait(readers, timeout=_PIPE_GRACE_S)
        if pending:
            await asyncio.to_thread(_sweep, COMMAND_MARK, self._mark)
            await asyncio.to_thread(_kill_pipe_holders, {self._out.inode, self._err.inode})
            _, pending = await asyncio.wait(readers, timeout=_PIPE_GIVE_UP_S)
            for reader in pending:  # a holder that could not be killed: stop reading
                reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        return ExecResult(
            exit_code=code,
            stdout=self._out.text(),
            stderr=self._err.text(),
            duration_s=time.monotonic() - self._started,
        )

    def _signal_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)

    async def kill(self) -> None:
        if self._finished.done():
            return
        self._signal_group()
        with contextlib.suppress(Exception):
            await asyncio.shield(self._finished)


class LocalSandbox(Sandbox):
    """A temporary directory plus the process groups of the commands run in it."""

    def __init__(
        self,
        spec: SandboxSpec,
        workdir: Path,
        user: SandboxUser | None = None,
        *,
        own_disk: bool = False,
    ) -> None:
        self.id = workdir.name
        self.workdir = str(workdir)
        self.user = user  # None: commands run as the driver's own user
        self.disk_is_own = own_disk  # its directory is a file system of its own (disk.py)
        self._real_dir = os.path.realpath(workdir)  # as /proc/self/mounts names its disk
        self._spec = spec
        self._limits = Limits(max_processes(spec), max_file_size(spec))
        self._handles: list[LocalHandle] = []
        self._commands = 0
        self._gone = False
        self._expiry = asyncio.get_running_loop().call_later(spec.timeout_s, self._expire)
        self._teardown: asyncio.Future[None] | None = None

    @classmethod
    async def create(cls, spec: SandboxSpec) -> LocalSandbox:
        """A fresh directory under `options["root"]` (default: `default_root`), owned
        by the sandbox's own user when the driver is root (`options["user"]`: "auto")."""
        mode = str(spec.options.get("user", "auto"))
        if mode not in ("auto", "driver"):
            raise SandboxBootError(f"options['user'] is 'auto' or 'driver', not {mode!r}")
        max_processes(spec)  # refuse a bad limit before anything is made
        max_file_size(spec)
        disk_size = max_disk(spec)
        try:
            user = await asyncio.to_thread(claim_user) if mode == "auto" else None
        except (UserPoolError, OSError) as exc:
            raise SandboxBootError(
                f"cannot give the local sandbox a user of its own: {exc}"
            ) from exc
        try:
            if user is not None:
                await asyncio.to_thread(private_view)  # its one probe, off the event loop
            if user is None or disk_size is None or not await asyncio.to_thread(own_disks):
                disk_size = None  # (a driver's own user could write the host's disk anyway)
            workdir = await asyncio.to_thread(
                _make_workdir, spec.options.get("root"), user, disk_size
            )
        except BaseException:
            if user is not None:
                await asyncio.to_thread(user.release)
            raise
        return cls(spec, workdir, user, own_disk=disk_size is not None)

    # -- commands ---------------------------------------------------------------------------

    def _check(self) -> None:
        if self._gone:
            raise SandboxGone(f"local sandbox {self.id} was killed or expired; open a new one")

    def _env(self, env: Mapping[str, str] | None, mark: str) -> dict[str, str]:
        own = {
            "HOME": str(Path(self.workdir, HOME_DIR)),
            "TMPDIR": str(Path(self.workdir, TMP_DIR)),
        }
        if self.user is not None:
            own |= {"USER": self.user.name, "LOGNAME": self.user.name}
        return {
            **host_basics(os.environ),
            **own,
            **self._spec.env,
            **(env or {}),
            MARK: self.id,
            COMMAND_MARK: mark,
        }

    def _cwd(self, cwd: str | None) -> str:
        return str(Path(self.workdir, cwd)) if cwd else self.workdir

    async def start(
        self,
        cmd: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> LocalHandle:
        self._check()
        self._commands += 1
        mark = f"{self.id}.{self._commands}"
        user, where = self.user, self._cwd(cwd)
        if not os.path.isdir(where):  # what Popen would say; entered as the user below
            raise FileNotFoundError(f"cannot run in {where}: no such directory")
        ids = (user.uid, user.gid) if user else (None, None)
        how = launch(cmd, self._env(env, mark), where, *ids, self._limits, self._real_dir)
        try:
            proc = subprocess.Popen(
                how.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=how.cwd,
                env=how.env,
                start_new_session=True,
                **how.popen,  # type: ignore[arg-type]
            )
        except FileNotFoundError as exc:  # the cwd does not exist
            raise FileNotFoundError(f"cannot run in {self._cwd(cwd)}: {exc}") from exc
        handle = LocalHandle(cmd, mark, proc, on_stdout, on_stderr)
        self._handles = [h for h in self._handles if h.running]
        self._handles.append(handle)
        return handle

    # -- files ------------------------------------------------------------------------------

    def _path(self, path: str) -> Path:
        return Path(self.workdir, path)  # an absolute `path` stays as it is

    async def write_file(self, path: str, data: bytes | str) -> None:
        self._check()
        raw = data.encode() if isinstance(data, str) else data
        if self.user is None:
            await asyncio.to_thread(_write, self._path(path), raw)
        else:
            await asyncio.to_thread(_write_as, self.user, self._path(path), raw)

    async def read_file(self, path: str) -> bytes:
        self._check()
        if self.user is None:
            return await asyncio.to_thread(_read_bounded, self._path(path))
        return await asyncio.to_thread(_read_as, self.user, self._path(path))

    # -- lifetime ---------------------------------------------------------------------------

    def _expire(self) -> None:
        """The spec's lifetime ran out: remove the sandbox as E2B would."""
        self._tear_down()

    def _tear_down(self) -> asyncio.Future[None]:
        """Start removing the sandbox, once; every later call gets the same removal."""
        if self._teardown is None:
            self._gone = True
            self._expiry.cancel()
            self._teardown = asyncio.ensure_future(self._remove())
        return self._teardown

    async def _remove(self) -> None:
        handles, self._handles = self._handles, []
        await asyncio.gather(*(h.kill() for h in handles))
        await asyncio.to_thread(_sweep, MARK, self.id)
        await asyncio.to_thread(_remove_workdir, Path(self.workdir), self.disk_is_own)
        if self.user is not None:
            await asyncio.to_thread(self.user.release)

    async def filled_its_own_disk(self) -> bool:
        """Its own disk, unless the host's disk under the images is short too: images are
        sparse, and together they may promise more than the host has (then a sandbox
        that wrote little gets "no space" as well)."""
        return self.disk_is_own and not await asyncio.to_thread(host_short, Path(self.workdir))

    async def end_processes(self) -> None:
        """Every command's group, every marked process, and with a user of its own every
        process of that user (`env -i` drops the marks): the kernel's whole task list."""
        self._check()
        handles, self._handles = self._handles, []
        await asyncio.gather(*(h.kill() for h in handles))
        await asyncio.to_thread(_sweep, MARK, self.id)
        if self.user is not None:
            user = self.user
            if not await asyncio.to_thread(kill_user_processes, user.uid, user.gid):
                raise SandboxError(f"local sandbox {self.id}: its user's processes survive kill")

    async def kill(self) -> None:
        """Returns once every process and the directory are gone, also when the sandbox's
        lifetime had already started the removal (a cancelled caller does not stop it)."""
        await asyncio.shield(self._tear_down())


HOME_DIR = "home"  # the sandbox's own HOME, inside its directory
TMP_DIR = "tmp"  # and its TMPDIR
# A root driver's sandboxes by default: below directories only root may write.
ROOT_SANDBOXES = "/var/lib/trajectory-recorder/sandboxes"


def max_processes(spec: SandboxSpec) -> int | None:
    """`options["max_processes"]`: how many processes and threads a sandbox's user may
    run at once (`DEFAULT_MAX_PROCESSES`; "none" for no limit). Only a sandbox with a
    user of its own is limited (the kernel counts per user)."""
    value = spec.options.get("max_processes", DEFAULT_MAX_PROCESSES)
    if value is None or str(value).lower() == "none":
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < MIN_PROCESSES:
        raise SandboxBootError(
            f"options['max_processes'] is a number of at least {MIN_PROCESSES}, or 'none'; "
            f"not {value!r}"
        )
    return n


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def max_file_size(spec: SandboxSpec) -> int | None:
    """`options["max_file_size"]`: the most bytes any one file a sandbox user's command
    writes may hold (`DEFAULT_MAX_FILE_SIZE`; a number of bytes, or with a k/m/g/t
    suffix, binary; "none" for no limit)."""
    return _size_option(spec, "max_file_size", DEFAULT_MAX_FILE_SIZE, MIN_FILE_SIZE, "1m")


def max_disk(spec: SandboxSpec) -> int | None:
    """`options["max_disk"]`: the size of a sandbox's own disk (`DEFAULT_MAX_DISK`; as
    `max_file_size`; "none": the sandbox writes the host's disk). Only a sandbox with a
    user of its own gets one, where the driver can mount it (`disk.own_disks`)."""
    return _size_option(spec, "max_disk", DEFAULT_MAX_DISK, MIN_DISK, "64m")


def _size_option(
    spec: SandboxSpec, name: str, default: str, minimum: int, least: str
) -> int | None:
    value = spec.options.get(name, default)
    text = str(value).strip().lower()
    if value is None or text == "none":
        return None
    digits, unit = (text[:-1], text[-1]) if text[-1:] in _SIZE_UNITS else (text, "")
    n = int(digits) * _SIZE_UNITS[unit] if digits.isdigit() else 0
    if n < minimum:
        raise SandboxBootError(
            f"options['{name}'] is a size of at least {least} (bytes, or with a k/m/g/t "
            f"suffix), or 'none'; not {value!r}"
        )
    return n


def default_root() -> str:
    """Where sandboxes go without `options["root"]`: `ROOT_SANDBOXES` for a root driver
    (made 0711: sandbox users may enter, not list), else the system's temp dir."""
    if os.geteuid() != 0:
        return tempfile.gettempdir()
    path = Path(ROOT_SANDBOXES)
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    path.mkdir(mode=0o711, exist_ok=True)
    return str(path)


def _make_workdir(root: str | None, user: SandboxUser | None, disk: int | None = None) -> Path:
    """The sandbox's directory (0700, with `home` and `tmp`), owned by `user` if any; with
    `disk`, a file system of that many bytes of its own (`disk.make_disk`)."""
    try:
        if root is None:
            root = default_root()
        leftovers.sweep_once(root)
        workdir = Path(tempfile.mkdtemp(prefix=f"tr-sbx-{uuid.uuid4().hex[:8]}-", dir=root))
        leftovers.claim(workdir)
    except OSError as exc:
        raise _no_workdir(root, exc) from exc
    if disk is not None:
        try:
            if any(c.isspace() or c == "\\" for c in os.path.realpath(workdir)):
                raise DiskError(f"{root} has a space or a backslash in its path")
            make_disk(workdir, disk)
        except DiskError as exc:
            workdir.rmdir()
            raise SandboxBootError(
                f"cannot give the local sandbox a disk of its own under {root}: {exc}; "
                "free space there, or set options['max_disk'] to 'none'"
            ) from exc
        workdir.chmod(0o700)
    try:
        for sub in (HOME_DIR, TMP_DIR):
            (workdir / sub).mkdir(mode=0o700)
    except OSError as exc:
        _remove_workdir(workdir, disk is not None)
        raise _no_workdir(root, exc) from exc
    if user is None:
        return workdir
    shared = writable_parent(workdir)
    if shared is not None:
        _remove_workdir(workdir, disk is not None)
        raise SandboxBootError(
            f"sandboxes under {root} would share {shared}, which every user may write: tools "
            "read files from every parent directory (pytest.ini and conftest.py, pyproject.toml, "
            ".python-version, node_modules), so one sandbox could plant them there for the "
            "others and for the grader; choose options['root'] (--sandbox-option root=DIR) "
            f"below directories only root may write, or leave it unset ({ROOT_SANDBOXES})"
        )
    blocked = _unreachable_parent(workdir, user.uid)
    if blocked is not None:
        _remove_workdir(workdir, disk is not None)
        raise SandboxBootError(
            f"the sandbox user {user.name} cannot reach {workdir}: {blocked} is closed to other "
            f"users; choose options['root'] (--sandbox-option root=DIR) under directories "
            f"others may traverse, or run `chmod o+x {blocked}`"
        )
    for path in (workdir, workdir / HOME_DIR, workdir / TMP_DIR):
        os.chown(path, user.uid, user.gid)
    return workdir


def _no_workdir(root: str | None, exc: OSError) -> SandboxBootError:
    return SandboxBootError(
        f"cannot create a local sandbox directory under {root or ROOT_SANDBOXES}: "
        f"{exc}; set options['root'] to a writable directory"
    )


def writable_parent(path: Path) -> Path | None:
    """The highest directory above `path` that every user may write (e.g. `/tmp`), or None."""
    for parent in reversed(path.parents):
        if parent.stat().st_mode & stat.S_IWOTH:
            return parent
    return None


def _unreachable_parent(workdir: Path, uid: int) -> Path | None:
    """The first ancestor of `workdir` that a user `uid` (in no other group) cannot enter."""
    for parent in reversed(workdir.parents):
        st = parent.stat()
        if st.st_uid != uid and not st.st_mode & stat.S_IXOTH:
            return parent
    return None


def _as_user(user: SandboxUser | None) -> dict[str, object]:
    """Popen arguments that run the child as `user` with no supplementary groups."""
    return {} if user is None else as_user(user.uid, user.gid)


def _write_as(user: SandboxUser, path: Path, raw: bytes) -> None:
    """Write `path` with the sandbox user's rights (a planted symlink reaches no more)."""
    script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
    done = _run_as(user, ["/bin/sh", "-c", script, "sh", str(path)], path, raw)
    if done.returncode != 0:
        raise _os_error(done.stderr, path)


def _read_as(user: SandboxUser, path: Path) -> bytes:
    """Read `path` with the sandbox user's rights, at most `MAX_READ_BYTES`."""
    script = (
        'if [ -e "$1" ] && [ ! -f "$1" ] && [ ! -d "$1" ]; then '
        'echo "not a regular file: $1" >&2; exit 1; fi; exec head -c "$2" -- "$1"'
    )
    done = _run_as(user, ["/bin/sh", "-c", script, "sh", str(path), str(MAX_READ_BYTES + 1)], path)
    if done.returncode != 0:
        raise _os_error(done.stderr, path)
    if len(done.stdout) > MAX_READ_BYTES:
        raise OSError(f"{path} is larger than {MAX_READ_BYTES} bytes: not read")
    return done.stdout


def _read_bounded(path: Path) -> bytes:
    """A regular file's bytes, at most `MAX_READ_BYTES` (never a FIFO or a device)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file: not read")
        data = f.read(MAX_READ_BYTES + 1)
    if len(data) > MAX_READ_BYTES:
        raise OSError(f"{path} is larger than {MAX_READ_BYTES} bytes: not read")
    return data


def _run_as(
    user: SandboxUser, argv: list[str], path: Path, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(
            argv, input=stdin, capture_output=True, env={"PATH": "/usr/bin:/bin"}, check=False,
            timeout=_FILE_IO_TIMEOUT_S, **_as_user(user),  # type: ignore[arg-type]
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError(f"{path}: no end after {_FILE_IO_TIMEOUT_S:g} s") from exc


def _os_error(stderr: bytes, path: Path) -> OSError:
    """The OSError a direct open would have raised, from a child's message."""
    text = stderr.decode(errors="replace").strip()
    kinds: list[tuple[str, type[OSError]]] = [
        ("No such file", FileNotFoundError),
        ("Permission denied", PermissionError),
        ("Is a directory", IsADirectoryError),
        ("Not a directory", NotADirectoryError),
    ]
    for needle, kind in kinds:
        if needle in text:
            return kind(f"{path}: {text}")
    return OSError(f"{path}: {text}")


def _write(path: Path, raw: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)


def marked_pids(sandbox_id: str, name: str = MARK) -> list[int]:
    """Processes whose environment has `name=sandbox_id` (Linux /proc; [] elsewhere)."""
    needle = f"{name}={sandbox_id}".encode()
    found: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    environ = f.read()
            except OSError:  # gone meanwhile, or not ours
                continue
            if needle in environ.split(b"\0"):
                found.append(int(entry.name))
    return found


def _kill_pipe_holders(inodes: set[int]) -> None:
    """SIGKILL every other process holding one of these pipes open (by `/proc/*/fd`),
    until none is left (a holder may fork meanwhile)."""
    for _ in range(5):
        holders = pipe_holders(inodes)
        if not holders:
            return
        for pid in holders:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def pipe_holders(inodes: set[int]) -> list[int]:
    """The processes, this one aside, with a descriptor on one of these pipes."""
    links = {f"pipe:[{inode}]" for inode in inodes}
    found, me = [], os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            fds = list(os.scandir(f"/proc/{entry.name}/fd"))
            if any(os.readlink(fd.path) in links for fd in fds):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to look at
            continue
    return found


def _sweep(name: str, value: str) -> None:
    """Kill every process that still carries the mark, until none is left (they may fork)."""
    for _ in range(20):
        pids = marked_pids(value, name)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _remove_workdir(workdir: Path, own_disk: bool) -> None:
    """The sandbox's directory and everything in it (with its own disk: unmounted)."""
    if own_disk:
        remove_disk(workdir)
    _remove_tree(workdir)
    leftovers.release(workdir)


def _remove_tree(path: Path) -> None:
    """rmtree that also removes what a command made read-only (e.g. a Go module cache)."""

    def retry(func, p, _exc):  # type: ignore[no-untyped-def]
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            os.chmod(p, stat.S_IRWXU)
        func(p)

    if not path.exists():
        return
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=retry)
    else:
        shutil.rmtree(path, onerror=retry)
