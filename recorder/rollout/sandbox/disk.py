"""A local sandbox's own disk: its directory on a file system of its own, `max_disk` big.

Local sandboxes share the host's disk. One that filled it (many files, each
under the file-size limit, or `fallocate --keep-size`) stopped every other
rollout and any recorder log on that disk, and its own diff could no longer be
taken: a full disk was an infrastructure failure, which masked the policy's 0.

So, with root, a sandbox's directory is an ext4 file system of its own: a
sparse image file beside the directory (it takes the host's disk only as the
sandbox writes), mounted on the directory through a loop device. The sandbox
can fill that and nothing else, and a full disk there is the sandbox's own
doing (`Sandbox.disk_is_own`: `diff.take_diff` then closes the rollout as a
policy failure, `disk_full`). Removing the sandbox unmounts it and deletes the
image, which is also faster than deleting its tree file by file.

It needs root and util-linux's `mount` with loop devices, and e2fsprogs'
`mkfs.ext4`. `own_disks()` probes that once per process; where it is missing
sandboxes share the host's disk, and a warning says so once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("recorder.rollout")

DISK_SUFFIX = ".disk"  # the image file, beside the sandbox's directory
# No journal (the sandbox's files are scratch: a crash loses the sandbox anyway) and
# no blocks reserved for root: the sandbox user gets every block of its size.
_MKFS = ("-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "lazy_itable_init=1")
_MOUNT_OPTIONS = "loop,nosuid,nodev,discard"  # discard: deleted files give the host back space


class DiskError(OSError):
    """The sandbox's own disk could not be made or removed."""


def image_of(workdir: Path) -> Path:
    return workdir.with_name(workdir.name + DISK_SUFFIX)


def make_disk(workdir: Path, size: int) -> None:
    """Mount a fresh file system of `size` bytes on `workdir` (an empty directory)."""
    image = image_of(workdir)
    try:
        with open(image, "xb") as f:
            f.truncate(size)
        _run("mkfs.ext4", *_MKFS, str(image))
        _run("mount", "-o", _MOUNT_OPTIONS, str(image), str(workdir))
    except BaseException:
        image.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # mkfs's, of no use to a sandbox
        (workdir / "lost+found").rmdir()


def remove_disk(workdir: Path) -> None:
    """Unmount the sandbox's file system and delete its image. Its processes must be gone;
    one that is not (or a mount namespace of a command still alive) keeps the file system
    until it ends (a lazy unmount), and the image's blocks until then too."""
    if os.path.ismount(workdir):
        try:
            _run("umount", str(workdir))
        except DiskError:
            _run("umount", "--lazy", str(workdir))
    image_of(workdir).unlink(missing_ok=True)


# Below this much free space on the host's disk under the images, a sandbox's full
# disk may be the host's doing: sparse images can promise more than the host has.
HOST_RESERVE = 256 << 20


def host_short(workdir: Path) -> bool:
    """Is the host's disk under this sandbox's image (nearly) full?"""
    st = os.statvfs(workdir.parent)
    return st.f_bavail * st.f_frsize < HOST_RESERVE


@functools.cache
def own_disks() -> bool:
    """Can this process give sandboxes disks of their own? Probed once, with a small disk."""
    missing = [tool for tool in ("mkfs.ext4", "mount", "umount") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        why = f"{', '.join(missing)} not found" if missing else "the driver is not root"
        log.warning("local sandboxes share the host's disk (%s): one can fill it", why)
        return False
    with tempfile.TemporaryDirectory(prefix="tr-disk-probe-") as tmp:
        probe = Path(tmp) / "probe"
        probe.mkdir()
        try:
            make_disk(probe, 16 << 20)
            remove_disk(probe)
        except DiskError as exc:
            log.warning("local sandboxes share the host's disk (no loop mount here: %s)", exc)
            return False
    return True


def _run(*argv: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DiskError(f"{argv[0]}: {exc}") from exc
    if done.returncode != 0:
        raise DiskError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
