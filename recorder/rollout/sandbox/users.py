"""Unprivileged users for local sandboxes: one per live sandbox, from a pool of system users.

Why: a local sandbox's commands run on the driver's machine. Run as the
driver's user (root, in a training container) an agent could read the
recorder's admin token (its 0600 file, `/proc/<recorder pid>/environ`) and
close its own session with reward 1.0, or read another sandbox's files. Run
as a user of its own, the kernel refuses all of that: a 0600 file of another
user, another uid's `/proc/<pid>/environ` and a 0700 directory of another
user are closed to it.

The pool: system users `tr-sbx-0`, `tr-sbx-1`, ... (created with `useradd`
the first time they are needed, no home, no login shell). A sandbox claims the
lowest free one by holding an exclusive `flock` on its lock file for its whole
life, so driver processes on one machine (several Ray workers) never share a
user, and a crashed driver's users free themselves. A user is handed out only
after every process it still runs is killed and what it left is removed (files
in the shared temporary directories, System V IPC objects, keyrings): nothing
passes from one sandbox to the next.

Only root can do this. `claim_user` returns None for any other driver, and
`warn_unisolated` says once, in the log, what that means.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("recorder.rollout")

PREFIX = "tr-sbx-"
POOL_SIZE = 4096  # users at most: far above the sandboxes one machine runs at once
# Where a sandbox user's strays are looked for when the user is handed back: these
# and every directory below them that any user may write.
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_SYSTEM_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
# Run as the user, after its processes are gone: empty its user and user-session
# keyrings (KEYCTL_CLEAR), which the kernel keeps per uid for the next sandbox.
_CLEAR_KEYRINGS = (
    "import ctypes, os\n"
    "keyctl = {'x86_64': 250, 'aarch64': 219}.get(os.uname().machine)\n"
    "libc = ctypes.CDLL(None)\n"
    "for ring in (-4, -5) if keyctl else ():\n"
    "    libc.syscall(keyctl, 7, ctypes.c_long(ring))\n"
)
_created = threading.Lock()
_warned = False


class UserPoolError(Exception):
    """No unprivileged user could be claimed or created; the message says what to do."""


@dataclass
class SandboxUser:
    """A claimed user: its ids, and the lock file descriptor that keeps it ours."""

    name: str
    uid: int
    gid: int
    _lock_fd: int

    def release(self) -> None:
        """Kill what the user still runs, remove what it left, and hand it back. Idempotent."""
        if self._lock_fd < 0:
            return
        try:
            if kill_user_processes(self.uid, self.gid):
                remove_strays(self.uid, self.gid)
        finally:
            os.close(self._lock_fd)
            self._lock_fd = -1


def is_root() -> bool:
    return os.geteuid() == 0


def warn_unisolated() -> None:
    """Say once that local sandboxes run as the driver's own user (not root: no choice)."""
    global _warned
    if _warned:
        return
    _warned = True
    log.warning(
        "local sandboxes run as this driver's user (uid %d), not as unprivileged users of "
        "their own: that takes root. An agent can then read whatever this user can, e.g. "
        "the recorder's admin token file, and close its own session with any reward; run "
        "the driver as root (sandboxes get users tr-sbx-N) or use --sandbox e2b for training",
        os.geteuid(),
    )


def lock_dir() -> Path:
    """Root's private directory of the pool's lock files."""
    for base in ("/run", tempfile.gettempdir()):
        path = Path(base, "trajectory-recorder-sandbox-users")
        with contextlib.suppress(OSError):
            path.mkdir(mode=0o700, exist_ok=True)
            if path.stat().st_uid == os.geteuid():
                return path
    raise UserPoolError("cannot create a private directory for the sandbox users' lock files")


def claim_user() -> SandboxUser | None:
    """A free pool user, locked for the caller; None when the driver is not root."""
    if not is_root():
        warn_unisolated()
        return None
    locks = lock_dir()
    for index in range(POOL_SIZE):
        name = f"{PREFIX}{index}"
        fd = os.open(locks / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            entry = _ensure_user(name)
            emptied = kill_user_processes(entry.pw_uid, entry.pw_gid)  # a crashed driver's
            if emptied:
                remove_strays(entry.pw_uid, entry.pw_gid)
        except BaseException:
            os.close(fd)
            raise
        if not emptied:  # something of it survives: never hand it to a sandbox
            os.close(fd)
            continue
        return SandboxUser(name, entry.pw_uid, entry.pw_gid, fd)
    raise UserPoolError(f"all {POOL_SIZE} sandbox users are in use; run fewer sandboxes at once")


def _ensure_user(name: str) -> pwd.struct_passwd:
    """The system user `name`, created (no home, no login) if it does not exist yet."""
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(name)
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    with _created:  # useradd locks /etc/passwd itself; this spares threads a retry
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
        done = subprocess.run(
            [useradd, "--system", "--user-group", "--no-create-home",
             "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
             "--comment", "trajectory-recorder sandbox", name],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    try:
        return pwd.getpwnam(name)  # another process may have created it meanwhile
    except KeyError:
        raise UserPoolError(
            f"cannot create the sandbox user {name} ({useradd} exited {done.returncode}: "
            f"{done.stderr.strip()[-300:]}); install the passwd package (useradd), or create "
            f"users {PREFIX}0..N yourself"
        ) from None


def user_pids(uid: int) -> list[int]:
    """Live processes whose owner is `uid`. A zombie is left out: it is already dead and
    holds nothing, and its reaper (pid 1, once its parent was killed) may take its time.
    A process whose main thread ended (`SYS_exit`) while other threads run shows as a
    zombie too, but is not one: it is found by its live threads (`_zombie`)."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if entry.stat().st_uid == uid and not _zombie(entry.path):
                        found.append(int(entry.name))
    return found


def _zombie(proc_dir: str) -> bool:
    """Is the process dead: its main thread a zombie, and no other thread left?"""
    if not _zombie_task(proc_dir):
        return False
    with contextlib.suppress(OSError):
        for task in os.scandir(f"{proc_dir}/task"):
            with contextlib.suppress(OSError):
                if not _zombie_task(task.path):
                    return False
    return True


def _zombie_task(task_dir: str) -> bool:
    with open(f"{task_dir}/stat", "rb") as f:
        return f.read().rpartition(b")")[2][:2] == b" Z"


def kill_user_processes(uid: int, gid: int | None = None) -> bool:
    """SIGKILL every process of `uid` until none is left (they may fork meanwhile).
    False if some are still there: the user must not be handed out.

    A scan of /proc cannot see a process that forks and exits in a loop (each one
    lives for microseconds: a fifth audit's chain outlived 33 of 34 scans, and its
    user went to the rollout's own eval). So the user itself first signals every
    process it may (`kill -9 -1`): the kernel walks its whole task list, and a fork
    under way fails. Then the scan checks, and kills what is left one by one."""
    group = _gid_of(uid) if gid is None else gid
    for _ in range(50):
        if group is not None:
            _run_as(uid, group, ["kill", "-9", "-1"])
        pids = user_pids(uid)
        if not pids:
            return True
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    left = user_pids(uid)
    if left:
        log.warning("processes of uid %d kept appearing while being killed: %s", uid, left)
    return not left


def remove_strays(uid: int, gid: int | None = None) -> None:
    """Remove what `uid` left where the next sandbox of the same user (or any other
    user) could find it: files in the shared temporary directories and in any
    directory below them that every user may write; its System V IPC objects; its
    keyrings. A fifth audit's code under test stashed the hidden tests and the
    grader's command in each of these, and a later agent of the same user read them
    back."""
    for base in SHARED_TMP:
        _remove_owned(base, uid)
    remove_ipc_objects(uid)
    group = _gid_of(uid) if gid is None else gid
    if group is not None:
        _run_as(uid, group, [_python() or "python3", "-I", "-S", "-c", _CLEAR_KEYRINGS])


def _remove_owned(directory: str, uid: int, depth: int = 0) -> None:
    """Remove `uid`'s entries of `directory`, and look into its world-writable
    subdirectories (another user's `0777` directory is as open as /tmp)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                is_dir = entry.is_dir(follow_symlinks=False)
                if st.st_uid == uid:
                    if is_dir:
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)
                elif is_dir and st.st_mode & 0o002 and depth < 8:
                    _remove_owned(entry.path, uid, depth + 1)


def remove_ipc_objects(uid: int) -> None:
    """Remove the System V message queues, shared memory and semaphores `uid` owns or
    made (root may). Commands with a private view run in IPC namespaces of their own
    (`procview`), whose objects die with them; this covers the others."""
    ipcrm = shutil.which("ipcrm", path=_SYSTEM_PATH)
    args: list[str] = []
    for kind, flag in (("msg", "-q"), ("shm", "-m"), ("sem", "-s")):
        with contextlib.suppress(OSError):
            lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
            head = lines[0].split() if lines else []
            for line in lines[1:]:
                row = dict(zip(head, line.split(), strict=False))
                if str(uid) in (row.get("uid"), row.get("cuid")):
                    args += [flag, row[head[1]]]
    if args and ipcrm:
        subprocess.run([ipcrm, *args], capture_output=True, check=False, timeout=30)


def _run_as(uid: int, gid: int, argv: list[str]) -> None:
    """Run `argv` as `uid`/`gid` (no groups, no new privileges) from /, and wait."""
    setpriv = shutil.which("setpriv", path=_SYSTEM_PATH)
    if setpriv is None:
        return
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(
            [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--no-new-privs",
             *argv],
            cwd="/", env={"PATH": _SYSTEM_PATH}, capture_output=True, check=False, timeout=30,
        )  # fmt: skip


def _python() -> str | None:
    """The system's python3 (the driver's own may sit where a sandbox user cannot read)."""
    return shutil.which("python3", path=_SYSTEM_PATH)


def _gid_of(uid: int) -> int | None:
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return None
