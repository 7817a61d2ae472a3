"""How a local sandbox's command starts: as its user, seeing only that user's processes.

`/proc` shows every process to every user, command line included, so one
rollout could read what runs in another's sandbox while it runs: a grader's
command line (a marker line such as `print("graded-7d1f")` earned a sibling
1.0 in an audit), a sibling's test selection, the driver's own arguments. So
a command of a sandbox user starts in a mount namespace of its own whose
`/proc` is a fresh procfs mounted `hidepid=2`: the kernel then lists only the
processes of the reader's own user there. The rest of the file system is the
host's.

Its `/dev/shm` is a tmpfs of its own too, capped at `SHM_SIZE`: memory there
belongs to no process, and the host's, shared by every sandbox, is as big as
RAM.

Two more things a command must not carry past its sandbox (a fifth audit):
its System V IPC objects and POSIX message queues outlive their processes and
belong to the uid, which the pool hands to the next sandbox (the rollout's
own eval, where code under test had stashed the hidden tests and the grader's
command in them for a later agent): each command gets an IPC namespace of its
own, whose objects die with it. And a setuid file left in a directory every
user may write (`/run/lock`) let another sandbox's user act as a released
pool user and edit that user's next sandbox: commands run with no new
privileges, so a setuid bit does nothing for them.

The start is a chain of execs in one process: `unshare --mount --ipc` (root),
a `/bin/sh` that mounts the procfs, then `setpriv` drops to the sandbox user
(no supplementary groups, no new privileges) and execs the command's
`/bin/sh -c`. The pid, process group, exit status and signals stay the
command's own, so the sandbox's kill and sweep work as before.

The root part must not be steerable by the command's environment: it runs
with the loader's and shells' start-up variables removed (`ROOT_UNSAFE`), and
they are put back for the command itself by `env`.

This needs root with CAP_SYS_ADMIN and util-linux (`unshare`, `setpriv`,
`mount`). `private_view()` probes that once per process; where it is missing
(an unprivileged container) commands start as the sandbox user directly and
a warning says, once, that sandboxes can see each other's processes.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import resource
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("recorder.rollout")

_SYSTEM_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
# What the dynamic loader, glibc or a shell would act on in a root process.
ROOT_UNSAFE = re.compile(
    r"^(LD_[A-Z_]*|GLIBC_TUNABLES|GCONV_PATH|LOCPATH|NLSPATH|NIS_PATH|MALLOC_[A-Z_]*|BASH_ENV"
    r"|ENV|HOSTALIASES|RES_OPTIONS|LOCALDOMAIN|RESOLV_HOST_CONF|TZDIR|GETCONF_DIR|TMPDIR)$"
)
# Each command's own /dev/shm, a tmpfs of at most this much memory. The host's is a tmpfs
# as big as RAM that every sandbox shared: what one wrote there outlived its processes
# (no OOM kill frees it) until its user was released, 512 MB in an audit.
SHM_SIZE = "1g"
# A sandbox's processes are what the kernel's OOM killer takes first (the most it can
# add to a score). It scores a process by its own memory: a sandbox that fills memory
# with many processes of a few hundred MB each left the driver, or a recorder on the
# same machine, the largest process, and every rollout would have ended with it. The
# sandbox user can set it back to 0, not lower (root's setting is its floor only where
# the driver has CAP_SYS_RESOURCE): a score set back gives up the preference.
OOM_SCORE_ADJ = 1000
# $1 uid, $2 gid, $3 the sandbox's directory (its real path, or ""); the rest is what
# setpriv execs. A failed mount never runs the command with the full process table in
# view: 125 (the command did not run).
# Other sandboxes' disks are unmounted in its view: their paths were in its
# /proc/self/mounts, and a crashed driver's sandbox stays mounted, owned by a pool user
# the next sandbox may get (an audit read a dead sandbox's hidden tests so).
# Then the sandbox's `tmp` is its /tmp and /var/tmp: those are the host's disk, which a
# sandbox filled past its own (`disk.py`), and every sandbox's. Root touches nothing the
# sandbox owns but to bind it, and binds only what turns out to be the sandbox's own:
# its `tmp` is the user's to replace (a link to any path, swapped in between a check and
# the bind), so a missing one is made again as the user (root's `mkdir` then `chown` had
# been raced into giving the user any file of the host), and a bind that is not a
# directory of the user's on the sandbox's own file system is refused.
_WRAPPER = (
    "{mount} -t proc -o hidepid=2,nosuid,nodev,noexec proc /proc || exit 125\n"
    f"echo {OOM_SCORE_ADJ} > /proc/self/oom_score_adj 2>/dev/null\n"
    "{mount} -t tmpfs -o size={shm},mode=1777,nosuid,nodev tmpfs /dev/shm || exit 125\n"
    "uid=$1 gid=$2 own=$3\nshift 3\n"
    'if [ -n "$own" ]; then\n'
    "  others=\n"
    "  while read -r dev at rest; do\n"
    '    case "$dev $at" in "/dev/loop"*"/tr-sbx-"*) [ "$at" = "$own" ] || others="$others $at";;'
    " esac\n"
    "  done < /proc/self/mounts\n"
    '  [ -z "$others" ] || {umount} --lazy $others 2>/dev/null\n'
    '  as_user="{setpriv} --reuid=$uid --regid=$gid --clear-groups --no-new-privs --"\n'
    '  [ -d "$own/tmp" ] || $as_user mkdir -m 700 "$own/tmp" 2>/dev/null\n'
    '  want="$(stat -c %d "$own") $uid directory"\n'
    "  for t in /tmp /var/tmp; do\n"
    '    [ -d "$t" ] || continue\n'
    '    {mount} --bind "$own/tmp" "$t" || exit 125\n'
    '    [ "$(stat -c \'%d %u %F\' "$t")" = "$want" ] || exit 125\n'
    "  done\n"
    "fi\n"
    'exec {setpriv} --reuid="$uid" --regid="$gid" --clear-groups --no-new-privs -- "$@"\n'
)
# The command's own shell enters its directory, as the sandbox user: entered by root
# (Popen's `cwd` is, before any user change), a `repo` the sandbox had replaced with a
# link to a directory its user cannot reach let the next command read it.
_ENTER = (
    f"echo {OOM_SCORE_ADJ} > /proc/self/oom_score_adj 2>/dev/null\n"
    'cd -- "$1" || exit 125\nshift\nexec /bin/sh -c "$@"'
)


@dataclass(frozen=True)
class Launch:
    """What `subprocess.Popen` takes to start one command."""

    argv: list[str]
    env: dict[str, str]
    cwd: str  # where the process starts (the command's own directory is entered in it)
    popen: dict[str, object]  # user / group / umask arguments


@dataclass(frozen=True)
class _Tools:
    unshare: str
    setpriv: str
    mount: str
    umount: str
    env: str

    def argv(self, uid: int, gid: int, tail: list[str], own: str = "") -> list[str]:
        """unshare (mounts, IPC) -> mount a private /proc and /dev/shm -> with the sandbox's
        directory `own`: its `tmp` on /tmp and /var/tmp, other sandboxes' disks unmounted
        -> setpriv to uid/gid, no new privileges -> exec `tail`."""
        wrapper = _WRAPPER.format(
            mount=self.mount, umount=self.umount, setpriv=self.setpriv, shm=SHM_SIZE
        )
        return [self.unshare, "--mount", "--ipc", "--propagation", "private", "--", "/bin/sh",
                "-c", wrapper, "sh", str(uid), str(gid), own, *tail]  # fmt: skip


@dataclass(frozen=True)
class Limits:
    """What a sandbox user's command may use (None: no limit)."""

    processes: int | None = None  # processes and threads of its user at once
    file_size: int | None = None  # bytes of any one file it writes


def launch(
    cmd: str,
    env: Mapping[str, str],
    cwd: str,
    uid: int | None,
    gid: int | None,
    limits: Limits = Limits(),
    sandbox_dir: str = "",
) -> Launch:
    """How to start `/bin/sh -c cmd` in `cwd` with `env`: as the driver (uid None), or as
    a sandbox user that sees only its own processes (or, where that is not possible, as
    the user), entering `cwd` with that user's rights, under `limits` (`limit_argv`).
    With `sandbox_dir`, /tmp and /var/tmp are its `tmp` and no other sandbox's disk is
    mounted in the command's view."""
    if uid is None or gid is None:
        return Launch(["/bin/sh", "-c", cmd], dict(env), cwd, {})
    shell = ["/bin/sh", "-c", _ENTER, "sh", cwd, cmd]
    limit = limit_argv(limits)
    tools = private_view()
    if tools is None:
        return Launch([*limit, *shell], dict(env), "/", as_user(uid, gid))
    root_env = {k: v for k, v in env.items() if not ROOT_UNSAFE.match(k)}
    restored = [f"{k}={v}" for k, v in env.items() if ROOT_UNSAFE.match(k)]
    tail = [tools.env, *restored, *shell] if restored else shell
    argv = tools.argv(uid, gid, tail, sandbox_dir)
    return Launch([*limit, *argv], root_env, "/", {"umask": 0o077})


def limit_argv(limits: Limits) -> list[str]:
    """The argv prefix that holds a command to `limits` ([] for none), util-linux's
    `prlimit` (a limit above the driver's own hard limit is lowered to it):

    - `RLIMIT_NPROC`, which the kernel counts per user, so with a user per sandbox it
      bounds the whole sandbox. A fork bomb in one rollout had no bound but the host's
      pid space: every other rollout, the driver and a recorder on the same machine
      could no longer start a process. Root, before the drop to the user, is exempt.
    - `RLIMIT_FSIZE`, per file: one runaway write (a loop's output sent to a file) had
      no bound but the disk, which the driver's files and a recorder's log may share.
      The writer gets `EFBIG` (a shell's command, `SIGXFSZ`). Many files still add up.
    """
    prlimit = _prlimit()
    if prlimit is None:
        return []
    args = [
        f"--{name}={n}:{n}"
        for name, kind, wanted in (
            ("nproc", resource.RLIMIT_NPROC, limits.processes),
            ("fsize", resource.RLIMIT_FSIZE, limits.file_size),
        )
        if (n := _within_hard(kind, wanted)) is not None
    ]
    return [prlimit, *args, "--"] if args else []


def _within_hard(kind: int, wanted: int | None) -> int | None:
    if wanted is None:
        return None
    hard = resource.getrlimit(kind)[1]
    return wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)


@functools.cache
def _prlimit() -> str | None:
    found = shutil.which("prlimit", path=_SYSTEM_PATH)
    if found is None:
        log.warning(
            "util-linux's prlimit is not installed: a local sandbox's processes are not "
            "limited, and a fork bomb in one rollout can exhaust this machine's processes"
        )
    return found


def as_user(uid: int, gid: int) -> dict[str, object]:
    """Popen arguments that run the child as `uid`/`gid` with no supplementary groups."""
    return {"user": uid, "group": gid, "extra_groups": [], "umask": 0o077}


@functools.cache
def private_view() -> _Tools | None:
    """The tools, once a probe showed a private `/proc` works here; else None (warned)."""
    found = {name: shutil.which(name, path=_SYSTEM_PATH) for name in ("unshare", "setpriv")}
    found |= {name: shutil.which(name, path=_SYSTEM_PATH) for name in ("mount", "umount")}
    found["env"] = "/usr/bin/env"
    why = _probe(found) if os.geteuid() == 0 else "the driver is not root"
    if why is None:
        return _Tools(**found)  # type: ignore[arg-type]
    log.warning(
        "local sandboxes can see each other's processes and command lines (%s), share the "
        "host's POSIX message queues, and may gain privileges from setuid files; a private "
        "/proc, IPC namespace and no-new-privileges per command need root with "
        "CAP_SYS_ADMIN and util-linux's unshare, setpriv and mount. A grader that passes a "
        "secret on its command line is readable by other rollouts: use --sandbox e2b, or "
        "run the driver where mounts are allowed",
        why,
    )
    return None


def _probe(found: Mapping[str, str | None]) -> str | None:
    """Why a private /proc cannot be had here, or None. Runs as nobody (65534): pid 1
    must be out of sight."""
    missing = [name for name, path in found.items() if path is None or not os.access(path, os.X_OK)]
    if missing:
        return f"not found: {', '.join(missing)}"
    tools = _Tools(**found)  # type: ignore[arg-type]
    argv = tools.argv(65534, 65534, ["/bin/sh", "-c", "test ! -e /proc/1"])
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=30, check=False,
            env={"PATH": _SYSTEM_PATH}, cwd="/",
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    if done.returncode != 0:
        return f"the probe exited {done.returncode}: {done.stderr.strip()[-300:]}"
    return None
