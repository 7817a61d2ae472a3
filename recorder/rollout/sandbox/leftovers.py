"""What a crashed driver left under a sandboxes root, removed by the next one.

A driver killed with signal 9 (OOM, preemption) never removes its local
sandboxes: their directories, with the agent's work and an eval's hidden
tests, and their own disks (`disk.py`), still mounted and holding a loop
device and the host's space, stay until someone cleans up by hand. So each
sandbox directory has an owner file beside it (`<dir>.owner`: the driver's host,
boot, pid and that process's start time, which a reused pid does not share), and the
first sandbox a process makes under a root removes every sandbox there whose
owner is gone. A sandbox whose owner file is missing or unreadable is left
alone: it may be another driver's that is still being made.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path

from recorder.rollout.sandbox.disk import remove_disk

log = logging.getLogger("recorder.rollout")

OWNER_SUFFIX = ".owner"


def claim(workdir: Path) -> None:
    """Mark `workdir` as this process's sandbox."""
    owner_file(workdir).write_text(_me())


def release(workdir: Path) -> None:
    owner_file(workdir).unlink(missing_ok=True)


def owner_file(workdir: Path) -> Path:
    return workdir.with_name(workdir.name + OWNER_SUFFIX)


@functools.cache
def sweep_once(root: str) -> int:
    """`sweep(root)`, once per process and root."""
    return sweep(Path(root))


def sweep(root: Path) -> int:
    """Remove the sandboxes under `root` whose driver is gone; how many were removed."""
    removed = 0
    for owner in root.glob(f"tr-sbx-*{OWNER_SUFFIX}"):
        try:
            alive = _alive(owner.read_text())
        except (OSError, ValueError):
            continue
        if alive:
            continue
        workdir = owner.with_name(owner.name[: -len(OWNER_SUFFIX)])
        try:
            remove_disk(workdir)
            shutil.rmtree(workdir, ignore_errors=True)
            owner.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot remove %s, left by a driver that is gone: %s", workdir, exc)
            continue
        removed += 1
    if removed:
        log.warning("removed %d sandbox(es) under %s left by drivers that are gone", removed, root)
    return removed


def _me() -> str:
    return f"{os.uname().nodename} {_boot_id()} {os.getpid()} {_start_time(os.getpid())}"


def _alive(text: str) -> bool:
    """Is the owner alive? One on another machine (a root on a shared file system) is
    taken to be: only this machine's processes can be checked."""
    host, boot, pid, start = text.split()
    if host != os.uname().nodename:
        return True
    if boot != _boot_id():
        return False  # this machine restarted since
    try:
        return _start_time(int(pid)) == start
    except OSError:
        return False


def _boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat, field 22)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2 :].split()[19].decode()
