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
after every process it still runs is killed and what it left in the shared
temporary directories is removed: nothing passes from one sandbox to the next.

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
# Where a sandbox user's strays are looked for when the user is handed back.
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")
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
        """Kill what the user still runs, remove its strays, and hand it back. Idempotent."""
        if self._lock_fd < 0:
            return
        try:
            kill_user_processes(self.uid)
            remove_strays(self.uid)
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
            emptied = kill_user_processes(entry.pw_uid)  # a crashed driver's leftovers
            if emptied:
                remove_strays(entry.pw_uid)
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


def kill_user_processes(uid: int) -> bool:
    """SIGKILL every process of `uid` until none is left (they may fork meanwhile).
    False if some are still there: the user must not be handed out."""
    for _ in range(50):
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


def remove_strays(uid: int) -> None:
    """Remove what `uid` left at the top of the shared temporary directories (a next
    sandbox of the same user must not find it)."""
    for base in SHARED_TMP:
        with contextlib.suppress(OSError):
            for entry in os.scandir(base):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid != uid:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)
