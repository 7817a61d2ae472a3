"""What only the local backend has to get right: processes that leave their group, many
sandboxes at once leaving nothing behind, a user of its own per sandbox when the driver
is root, and no host environment beyond the basics (the shared contract is in
test_sandbox_suite.py)."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from recorder.rollout.sandbox import (
    SandboxBootError,
    SandboxSpec,
    disk,
    leftovers,
    local,
    open_sandbox,
    procview,
    users,
)
from recorder.rollout.sandbox.local import marked_pids


async def test_exec_ends_with_its_command_though_an_escaped_child_holds_its_output(
    tmp_path: Path,
) -> None:
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path)})) as sb:
        result = await sb.exec("setsid sleep 300 & sleep 0.1; echo done", timeout_s=60)
        assert (result.exit_code, result.stdout) == (0, "done\n")
        assert marked_pids(sb.id) == []  # the escaped child went with its command


async def test_many_sandboxes_leave_no_process_and_no_directory(tmp_path: Path) -> None:
    spec = SandboxSpec(options={"root": str(tmp_path)})
    sandboxes = await asyncio.gather(*(open_sandbox(spec) for _ in range(6)))
    for sb in sandboxes:
        await sb.start("sleep 300 & sleep 300")
        await sb.exec("setsid sleep 300 > /dev/null 2>&1 < /dev/null &")
        await sb.write_file("a/b/c.txt", "x")
    assert all(marked_pids(sb.id) for sb in sandboxes)
    await asyncio.gather(*(sb.kill() for sb in sandboxes))
    assert [pid for sb in sandboxes for pid in marked_pids(sb.id)] == []
    assert list(tmp_path.iterdir()) == []


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="sandboxes get users of their own only when the driver is root"
)


@needs_root
async def test_as_root_each_sandbox_runs_as_a_user_of_its_own(tmp_path: Path) -> None:
    secret = tmp_path / "admin-token"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    spec = SandboxSpec(options={"root": str(tmp_path)})
    async with await open_sandbox(spec) as a, await open_sandbox(spec) as b:
        ids = [await sb.exec("id -u") for sb in (a, b)]
        uids = {int(r.stdout) for r in ids}
        assert 0 not in uids and len(uids) == 2  # unprivileged, and not shared
        st = os.stat(a.workdir)
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o700, int(ids[0].stdout))
        home = await a.exec('echo "$HOME"; test -w "$HOME" && echo writable')
        assert home.stdout == f"{a.workdir}/home\nwritable\n"
        await b.write_file("notes.txt", "b's own")
        # Another sandbox's directory, a root-only file, the driver's environment: closed.
        for path in (f"{b.workdir}/notes.txt", str(secret)):
            denied = await a.exec(f"cat {path}")
            assert denied.exit_code != 0 and "Permission denied" in denied.stderr, path
        hidden = await a.exec(f"cat /proc/{os.getpid()}/environ")  # not even listed
        assert hidden.exit_code != 0 and "No such file" in hidden.stderr
        # A symlink the command plants reaches no more through the driver's own reads.
        await a.exec(f"ln -s {secret} leak.txt")
        with pytest.raises(PermissionError):
            await a.read_file("leak.txt")
        assert await b.read_file("notes.txt") == b"b's own"


@needs_root
async def test_a_sandbox_sees_only_its_own_processes(tmp_path: Path) -> None:
    """Another rollout's running command line (a grader's marker, say) is out of sight,
    and so are the driver's processes; the command's own pid, status and kill are as
    before."""
    assert procview.private_view() is not None, "a private /proc works on this machine"
    spec = SandboxSpec(options={"root": str(tmp_path)})
    async with await open_sandbox(spec) as a, await open_sandbox(spec) as b:
        running = await a.start("sleep 300; echo graded-7d1f")
        await asyncio.sleep(0.3)
        assert any(
            b"graded-7d1f" in Path(f"/proc/{p}/cmdline").read_bytes() for p in marked_pids(a.id)
        )  # fmt: skip  (the host sees it)
        looked = await b.exec(
            "grep -l 'graded-7d[1]f' /proc/[0-9]*/cmdline; "  # the pattern is not the marker
            "test -e /proc/1 && echo pid-1-seen; ps -e -o user= | sort -u; exit 7"
        )
        assert looked.exit_code == 7, looked.stderr
        user = looked.stdout.split()
        assert len(user) == 1 and user[0].startswith("tr-sbx-"), looked.stdout
        own = await a.exec("ps -e -o args=")
        assert "sleep 300; echo graded-7d1f" in own.stdout  # its own user's processes stay
        assert running.pid in marked_pids(a.id)
        await running.kill()
        assert (await running.wait()).exit_code == -9


@needs_root
async def test_the_root_part_of_a_start_ignores_the_loader_variables(tmp_path: Path) -> None:
    """The chain that mounts the private /proc runs as root before it drops to the
    sandbox user: a preload named in the sandbox's environment must reach the command
    only (two loader complaints: the user's shell that enters the directory, then the
    command's), not the four root programs before them."""
    env = {"LD_PRELOAD": f"{tmp_path}/nowhere.so", "BASH_ENV": "/x/y", "KEEP": "1"}
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path)}, env=env)) as sb:
        seen = await sb.exec('echo "$LD_PRELOAD|$BASH_ENV|$KEEP"')
    assert seen.stdout == f"{tmp_path}/nowhere.so|/x/y|1\n"
    assert seen.stderr.count("nowhere.so") == 2, seen.stderr


@needs_root
async def test_a_zombie_is_not_a_process_left_to_kill(tmp_path: Path) -> None:
    """A dead child nobody reaped yet stays in /proc; killing it is impossible and not
    needed, so releasing the user neither waits for it nor warns about it."""
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path)})) as sb:
        assert sb.user is not None
        parent = await sb.start("sleep 0 & exec sleep 300")  # the child is never reaped
        await asyncio.sleep(0.5)
        live = users.user_pids(sb.user.uid)
        assert live == [parent.pid], live
        children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
        (child,) = children
        assert Path(f"/proc/{child}/stat").read_text().rpartition(")")[2].split()[0] == "Z"


# A process that ends its main thread alone (SYS_exit, not exit_group) while a thread
# of it runs on: /proc/<pid>/stat says Z, its environ is unreadable, the thread lives.
HEADLESS = (
    "import ctypes, os, threading, time\n"
    "threading.Thread(target=time.sleep, args=(300,)).start()\n"
    "ctypes.CDLL(None).syscall({'x86_64': 60, 'aarch64': 93}[os.uname().machine], 0)\n"
)


@needs_root
async def test_a_process_whose_main_thread_ended_is_still_killed(tmp_path: Path) -> None:
    """Its live thread keeps it a process: found, killed, and its user not handed out
    while it runs (the next sandbox of that user could be the rollout's own eval)."""
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path)})) as sb:
        assert sb.user is not None
        uid = sb.user.uid
        await sb.write_file("headless.py", HEADLESS)
        await sb.exec("setsid python3 headless.py </dev/null >/dev/null 2>&1 & sleep 0.5")
        (pid,) = users.user_pids(uid)
        assert Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
        assert marked_pids(sb.id) == []  # its mark cannot be read: only the uid finds it
    assert users.user_pids(uid) == []
    assert not Path(f"/proc/{pid}/task").exists() or all(
        (t / "stat").read_text().rpartition(")")[2].split()[0] == "Z"
        for t in Path(f"/proc/{pid}/task").iterdir()
    )


@needs_root
def test_a_user_that_cannot_be_emptied_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[int] = []

    def kill(uid: int, *_: object) -> bool:
        tried.append(uid)
        return len(tried) > 1  # the first user keeps a process alive

    monkeypatch.setattr(users, "kill_user_processes", kill)
    claimed = users.claim_user()
    monkeypatch.undo()
    assert claimed is not None
    try:
        assert claimed.uid == tried[1] != tried[0]
    finally:
        claimed.release()


@needs_root
async def test_a_command_enters_its_directory_as_the_sandbox_user(tmp_path: Path) -> None:
    """Found in an audit: Popen's `cwd` is entered before the user changes, so a sandbox
    that replaced its `repo` with a link to a directory its user cannot reach made the
    next command (the driver's diff) start in there, as root had entered it."""
    hidden = tmp_path / "root-only" / "inner"
    hidden.mkdir(parents=True)
    (tmp_path / "root-only").chmod(0o700)
    hidden.chmod(0o755)
    (hidden / "canary.txt").write_text("root-only canary\n")
    async with await open_sandbox(SandboxSpec()) as sb:
        assert (await sb.exec(f"cat {hidden}/canary.txt")).exit_code != 0
        await sb.exec(f"ln -s {hidden} repo")
        via = await sb.exec("cat canary.txt", cwd="repo")
        assert "canary" not in via.stdout
        assert via.exit_code == 125 and "can't cd" in via.stderr
        with pytest.raises(FileNotFoundError, match="cannot run in"):
            await sb.exec("true", cwd="missing")


# What a sandbox would plant above itself for the others (and the grader): pytest takes the
# nearest pytest.ini up to / and loads the conftest.py beside it.
PLANT_ABOVE = """for d in $(p="$PWD"; while [ "$p" != / ]; do p=$(dirname "$p"); echo "$p"; done); do
  printf '[pytest]\\n' > "$d/pytest.ini" 2>/dev/null && echo "planted $d"
done; true"""


@needs_root
async def test_by_default_no_directory_above_a_sandbox_is_writable_by_its_user() -> None:
    async with await open_sandbox(SandboxSpec()) as sb:
        assert Path(sb.workdir).parent == Path(local.ROOT_SANDBOXES)
        result = await sb.exec(PLANT_ABOVE)
        assert (result.exit_code, result.stdout) == (0, "")  # nothing planted anywhere
        assert local.writable_parent(Path(sb.workdir)) is None


@needs_root
async def test_a_root_below_a_directory_every_user_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp is
    root = shared / "sandboxes"
    root.mkdir(mode=0o711)
    with pytest.raises(SandboxBootError, match=f"would share {shared}, which every user may write"):
        await open_sandbox(SandboxSpec(options={"root": str(root)}))
    assert list(root.iterdir()) == []  # its directory went again
    # Its own user only (the driver's user, not root): refused nowhere, nothing to share.
    async with await open_sandbox(SandboxSpec(options={"root": str(root), "user": "driver"})):
        pass


async def test_commands_get_the_host_basics_not_the_host_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TR_ADMIN_TOKEN", "host-token")
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", "/host/claude")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    spec = SandboxSpec(options={"root": str(tmp_path)}, env={"GIVEN": "on purpose"})
    async with await open_sandbox(spec) as sb:
        seen = dict(
            line.split("=", 1) for line in (await sb.exec("env")).stdout.splitlines() if "=" in line
        )
    assert "TR_ADMIN_TOKEN" not in seen and "CLAUDE_CONFIG_DIR" not in seen
    assert seen["HTTPS_PROXY"] == "http://proxy.example:3128" and seen["LC_ALL"] == "C.UTF-8"
    assert seen["GIVEN"] == "on purpose" and seen["PATH"] == os.environ["PATH"]
    assert seen["HOME"] == f"{sb.workdir}/home" and seen["TMPDIR"] == f"{sb.workdir}/tmp"


# Forks up to 400 children that wait; prints how many it started and how the last fork
# failed. Bounded on purpose: without the limit it would still stop.
FORKER = """
import os, sys, time
started = 0
try:
    for _ in range(400):
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        started += 1
except OSError as exc:
    print("refused", exc.errno)
print("started", started)
sys.stdout.flush()
"""


@needs_root
async def test_a_fork_bomb_stops_at_the_sandboxs_process_limit(tmp_path: Path) -> None:
    """A sandbox's user is held to `max_processes` processes and threads (the kernel's
    per-user count); before, one rollout could fill the machine's pid space and starve
    every other rollout, the driver and the recorder. Another sandbox still starts
    commands, and the end of the command takes every child."""
    spec = SandboxSpec(options={"root": str(tmp_path), "max_processes": 64})
    async with await open_sandbox(spec) as a, await open_sandbox(spec) as b:
        forked = await a.exec(f"python3 -c '{FORKER}'", timeout_s=120)
        words = forked.stdout.split()
        assert words[:2] == ["refused", "11"], forked.stdout  # EAGAIN
        assert 16 < int(words[-1]) < 64
        assert (await b.exec("echo alive")).stdout == "alive\n"
        assert marked_pids(a.id) == []  # what the command left died with it
        assert (await a.exec("echo again")).stdout == "again\n"  # its user is free again


@pytest.mark.parametrize("value", [0, 8, "many", -1])
async def test_a_process_limit_that_is_no_number_is_refused(tmp_path: Path, value: object) -> None:
    spec = SandboxSpec(options={"root": str(tmp_path), "max_processes": value})
    with pytest.raises(SandboxBootError, match="max_processes"):
        await open_sandbox(spec)


@pytest.mark.parametrize("user", ["auto", "driver"])
async def test_a_lurker_without_the_marks_does_not_hang_its_command(
    tmp_path: Path, user: str
) -> None:
    """`env -i` drops the sandbox's marks, `setsid` leaves the group: the lurker held the
    command's output open, and the command, its timeout and the sandbox's kill never
    returned. Now it is found by the pipe it holds, and killed."""
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path), "user": user})) as sb:
        lurk = "env -i /usr/bin/setsid /bin/sh -c 'exec sleep 120' & sleep 0.3; echo done"
        handle = await sb.start(lurk)
        result = await asyncio.wait_for(handle.wait(60), 30)
        assert (result.exit_code, result.stdout) == (0, "done\n")
        assert not [p for p in _pids_running("sleep 120")]


def _pids_running(cmdline: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text.strip() == cmdline:
                found.append(int(entry.name))
    return found


async def test_a_commands_output_keeps_its_head_and_tail_only(tmp_path: Path) -> None:
    """A command printing 40 MB had every byte kept in the driver (and a policy could print
    gigabytes): the result keeps the first and last 8 MB and says what it left out."""
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path)})) as sb:
        big = "echo first; head -c 40000000 /dev/zero | tr '\\0' x; echo; echo last"
        out = (await sb.exec(big, timeout_s=120)).stdout
        assert len(out) < local.KEPT_OUTPUT + 100
        assert out.startswith("first\nxxx") and out.endswith("xxx\nlast\n")
        left_out = 6 + 40_000_001 + 5 - local.KEPT_OUTPUT
        assert f"[... {left_out} characters of output left out ...]" in out


@pytest.mark.parametrize("user", ["auto", "driver"])
@pytest.mark.parametrize("plant", ["mkfifo agent.diff", "ln -s /dev/zero agent.diff"])
async def test_a_planted_fifo_or_device_is_not_read(tmp_path: Path, user: str, plant: str) -> None:
    """The driver reads the agent's diff from a file: a FIFO there hung the read (and the
    executor thread with it), a link to /dev/zero filled the driver's memory."""
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path), "user": user})) as sb:
        await sb.exec(plant)
        with pytest.raises(OSError, match="not a regular file"):
            await asyncio.wait_for(sb.read_file("agent.diff"), 30)


@needs_root
async def test_ending_a_sandboxs_processes_takes_those_without_marks(tmp_path: Path) -> None:
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path)})) as sb:
        await sb.exec(
            "env -i /usr/bin/setsid /bin/sh -c 'exec sleep 121' > /dev/null 2>&1 & sleep 0.3"
        )
        assert _pids_running("sleep 121")
        await sb.end_processes()
        assert not _pids_running("sleep 121")
        assert (await sb.exec("echo still")).stdout == "still\n"  # its files and use remain


@needs_root
async def test_a_commands_shared_memory_is_its_own_and_capped(tmp_path: Path) -> None:
    """`/dev/shm` was the host's, as big as RAM and shared by every sandbox: 512 MB one
    command left there outlived it, a memory no OOM kill frees. Now each command has a
    tmpfs of its own (`procview.SHM_SIZE`), gone with it."""
    assert procview.private_view() is not None
    spec = SandboxSpec(options={"root": str(tmp_path)})
    async with await open_sandbox(spec) as a, await open_sandbox(spec) as b:
        wrote = await a.exec("head -c 1048576 /dev/zero > /dev/shm/left && df -k /dev/shm")
        assert wrote.exit_code == 0, wrote.stderr
        assert int(wrote.stdout.splitlines()[-1].split()[1]) == 1024 * 1024  # 1 GiB
        for sb in (a, b):
            assert (await sb.exec("ls /dev/shm")).stdout == ""
        assert not Path("/dev/shm/left").exists()


def _memory_cgroup(tmp_name: str, limit: int) -> Path:
    """A fresh memory cgroup of `limit` bytes below this process's own (cgroup v1's memory
    controller, or v2's); removed by the caller."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, where = line.split(":", 2)
        if "memory" in controllers.split(","):
            mount = Path("/sys/fs/cgroup/memory")
            limit_file, procs = "memory.limit_in_bytes", "cgroup.procs"
            break
    else:
        mount = Path("/sys/fs/cgroup")
        if "memory" not in (mount / "cgroup.controllers").read_text().split():
            raise OSError("no memory controller")
        where = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        limit_file, procs = "memory.max", "cgroup.procs"
    group = mount / where.lstrip("/") / tmp_name
    group.mkdir()
    try:
        (group / limit_file).write_text(str(limit))  # v2: only where memory is delegated
    except OSError:
        group.rmdir()
        raise
    assert (group / procs).exists()
    return group


def _join(group: Path, pid: int) -> None:
    (group / "cgroup.procs").write_text(str(pid))


_HOG = "import sys; x = bytearray({n}); sys.stdout.write('held\\n'); sys.stdout.flush(); sys.stdin.read()"


@needs_root
async def test_the_oom_killer_takes_the_sandboxs_process_not_a_larger_one_of_the_host(
    tmp_path: Path,
) -> None:
    """The kernel's OOM killer scores a process by its own memory, so a sandbox filling
    memory with processes smaller than the driver (or a recorder beside it) had the
    driver killed, and every rollout with it. Sandbox commands now carry the highest
    `oom_score_adj`. Here in a memory cgroup of 600 MB: a host process holding 350 MB, a
    sandbox command allocating 300 MB."""
    mib = 1024 * 1024
    try:
        group = _memory_cgroup(f"tr-oom-{os.getpid()}", 600 * mib)
    except OSError as exc:
        pytest.skip(f"no memory cgroup can be made here: {exc}")
    host = None
    try:
        host = await asyncio.create_subprocess_exec(
            "python3", "-c", _HOG.format(n=350 * mib),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _join(group, host.pid)
        assert host.stdout is not None
        assert await asyncio.wait_for(host.stdout.readline(), 60) == b"held\n"
        spec = SandboxSpec(options={"root": str(tmp_path)})
        async with await open_sandbox(spec) as sb:
            go = tmp_path / "go"
            handle = await sb.start(
                f"while [ ! -e {go} ]; do sleep 0.05; done; "
                f"cat /proc/self/oom_score_adj; python3 -c 'x = bytearray({300 * mib})'"
            )
            _join(group, handle.pid)
            go.touch()
            done = await handle.wait(120)
        assert host.returncode is None, "the OOM killer took the host's process"
        assert done.exit_code == 137, done  # the shell's python, killed (SIGKILL)
        assert done.stdout.split() == [str(procview.OOM_SCORE_ADJ)]
    finally:
        if host is not None and host.returncode is None:
            host.kill()
            await host.wait()
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                await asyncio.sleep(0.1)


@needs_root
async def test_a_runaway_write_stops_at_the_sandboxs_file_size_limit(tmp_path: Path) -> None:
    """One file a sandbox user's command writes holds at most `max_file_size` bytes:
    `yes > out` had no bound but the disk, which the driver's files and a recorder's log
    may share. A shell's command dies of SIGXFSZ, Python gets EFBIG; smaller files and
    another sandbox are untouched."""
    spec = SandboxSpec(options={"root": str(tmp_path), "max_file_size": "2m"})
    async with await open_sandbox(spec) as sb:
        shell = await sb.exec("yes > out; echo $?; stat -c %s out")
        assert shell.stdout.split() == [str(128 + 25), str(2 << 20)]  # SIGXFSZ
        py = await sb.exec('python3 -c \'open("big", "wb").write(bytes(3 << 20))\' 2>&1 | tail -1')
        assert "File too large" in py.stdout
        fits = await sb.exec("head -c 1048576 /dev/zero > fits && stat -c %s fits")
        assert fits.stdout.strip() == str(1 << 20)
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path)})) as other:
        big = await other.exec("head -c 3145728 /dev/zero > f && stat -c %s f")
        assert big.stdout.strip() == str(3 << 20)


@pytest.mark.parametrize("value", [0, "1k", "lots", "-5g", "2x"])
async def test_a_file_size_limit_that_is_no_size_is_refused(tmp_path: Path, value: object) -> None:
    spec = SandboxSpec(options={"root": str(tmp_path), "max_file_size": value})
    with pytest.raises(SandboxBootError, match="max_file_size"):
        await open_sandbox(spec)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("8g", 8 << 30), ("512M", 512 << 20), (3 << 20, 3 << 20), ("none", None), (None, None)],
)
def test_file_size_limits_read_as_bytes(value: object, expected: int | None) -> None:
    assert local.max_file_size(SandboxSpec(options={"max_file_size": value})) == expected
    assert local.max_file_size(SandboxSpec()) == 8 << 30


def _mounted(path: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


@needs_root
async def test_a_sandbox_fills_its_own_disk_not_the_hosts(tmp_path: Path) -> None:
    """Many files, each under the file-size limit, filled the disk every sandbox and the
    recorder's log share. Now a sandbox's directory is a file system of its own,
    `max_disk` big: writes past it fail there, another sandbox still writes, and
    removing the sandbox leaves no mount and no image behind."""
    root = tmp_path / "sandboxes"
    root.mkdir()
    free = os.statvfs(root)
    spec = SandboxSpec(options={"root": str(root), "max_disk": "64m", "max_file_size": "16m"})
    async with await open_sandbox(spec) as sb:
        assert sb.disk_is_own and _mounted(sb.workdir)
        fill = await sb.exec(
            "for i in $(seq 1 12); do head -c 10485760 /dev/zero > f$i || exit 9; done"
        )
        assert fill.exit_code == 9 and "No space left on device" in fill.stderr
        used = (free.f_bfree - os.statvfs(root).f_bfree) * free.f_frsize
        assert used < 72 << 20, used  # the host's disk: at most the sandbox's own size
        async with await open_sandbox(SandboxSpec(options={"root": str(root)})) as other:
            more = await other.exec("head -c 20971520 /dev/zero > f && stat -c %s f")
            assert more.stdout.strip() == str(20 << 20)
        workdir = sb.workdir
    assert not _mounted(workdir) and os.listdir(root) == []


@needs_root
async def test_a_sandbox_without_its_own_disk_when_asked(tmp_path: Path) -> None:
    async with await open_sandbox(
        SandboxSpec(options={"root": str(tmp_path), "max_disk": "none"})
    ) as sb:
        assert not sb.disk_is_own and not _mounted(sb.workdir)


@pytest.mark.parametrize("value", [0, "1m", "lots", "-5g"])
async def test_a_disk_size_that_is_no_size_is_refused(tmp_path: Path, value: object) -> None:
    spec = SandboxSpec(options={"root": str(tmp_path), "max_disk": value})
    with pytest.raises(SandboxBootError, match="max_disk"):
        await open_sandbox(spec)


@needs_root
async def test_a_full_disk_is_not_the_sandboxs_doing_when_the_host_is_short(
    tmp_path: Path,
) -> None:
    """Images are sparse: together they may promise more than the host has, and then a
    sandbox that wrote little gets "no space" too (an audit's sibling, 1% of its disk
    used, was graded 0). On a host that is short, a full disk is infrastructure."""
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path)})) as sb:
        assert await sb.filled_its_own_disk()
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=200m,mode=755", "tmpfs", str(small)], check=True
    )
    try:
        spec = SandboxSpec(options={"root": str(small), "max_disk": "64m"})
        async with await open_sandbox(spec) as sb:
            assert sb.disk_is_own and not await sb.filled_its_own_disk()
    finally:
        subprocess.run(["umount", "--lazy", str(small)], check=True)


@needs_root
async def test_tmp_is_the_sandboxs_own_and_no_other_disk_is_in_view(tmp_path: Path) -> None:
    """/tmp and /var/tmp were the host's disk, written past a sandbox's own (an audit
    wrote 60 MB there from a 64 MB sandbox), and shared by every sandbox. And the
    mounts of other sandboxes' disks were in view, a crashed driver's too, which stay
    mounted and owned by a pool user the next sandbox may get: an audit read a dead
    sandbox's hidden tests through one."""
    root = tmp_path / "sandboxes"
    root.mkdir()
    dead = root / "tr-sbx-dead-0"  # a crashed driver's sandbox, still mounted
    dead.mkdir()
    disk.make_disk(dead, 64 << 20)
    try:
        (dead / "secret").write_text("HIDDEN-TEST")
        (dead / "secret").chmod(0o644)
        dead.chmod(0o755)
        async with await open_sandbox(SandboxSpec(options={"root": str(root)})) as sb:
            mounts = await sb.exec("cat /proc/self/mounts")
            assert str(dead) not in mounts.stdout and sb.workdir in mounts.stdout
            read = await sb.exec(f"cat {dead}/secret")
            assert read.exit_code != 0 and "HIDDEN" not in read.stdout
            tmp = await sb.exec("echo a > /tmp/a && echo b > /var/tmp/b && ls $TMPDIR")
            assert tmp.stdout.split() == ["a", "b"]
            assert not Path("/tmp/a").exists() and not Path("/var/tmp/b").exists()
            gone = await sb.exec('rm -rf "$TMPDIR"')
            again = await sb.exec('echo c > /tmp/c && ls $TMPDIR && stat -c %U "$TMPDIR"')
            assert gone.exit_code == 0 and again.stdout.split() == ["c", sb.user.name]
            # A link in its place (a second audit: root bound what it named, the dead
            # sandbox's disk among them, and root's `chown` of a re-made one followed a
            # link swapped in): refused, the command does not run.
            own_tmp = Path(sb.workdir) / "tmp"
            await sb.exec(f'rm -rf "$TMPDIR" && ln -s {dead} "$TMPDIR"')
            assert own_tmp.is_symlink()
            for target in (str(dead), "/etc", "/root"):
                own_tmp.unlink()  # (the test swaps it: the sandbox's commands no longer run)
                own_tmp.symlink_to(target)
                linked = await sb.exec("cat /tmp/secret; ls /tmp")
                assert linked.exit_code == 125 and linked.stdout == "", target
    finally:
        disk.remove_disk(dead)


@needs_root
async def test_a_sandboxes_root_behind_a_link_works(tmp_path: Path) -> None:
    """/proc/self/mounts names a disk by its real path: compared with the root as given
    (a link), the sandbox's own disk was unmounted in its own view and every command
    failed (a second audit)."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path / "link")})) as sb:
        done = await sb.exec("echo a > f && cat f && echo b > /tmp/b && ls $TMPDIR")
        assert sb.disk_is_own and done.stdout.split() == ["a", "b"], done


CRASH = """
import asyncio, os, sys
from recorder.rollout.sandbox import SandboxSpec, open_sandbox

async def main():
    sb = await open_sandbox(SandboxSpec(options={"root": sys.argv[1], "max_disk": "64m"}))
    await sb.exec("echo hidden > secret")
    print(sb.workdir, flush=True)
    os.kill(os.getpid(), 9)

asyncio.run(main())
"""


@needs_root
async def test_a_crashed_drivers_sandboxes_are_removed_by_the_next(tmp_path: Path) -> None:
    """A driver killed with signal 9 left its sandboxes (the agent's work, an eval's
    hidden tests) and their disks mounted, holding a loop device and the host's space,
    until someone cleaned up by hand. The next driver's first sandbox there removes
    every sandbox whose driver is gone; a live driver's stay."""
    root = tmp_path / "sandboxes"
    root.mkdir()
    async with await open_sandbox(SandboxSpec(options={"root": str(root)})) as live:
        crashed = subprocess.run(
            [sys.executable, "-c", CRASH, str(root)], capture_output=True, text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )  # fmt: skip
        assert crashed.returncode == -9, crashed.stderr
        dead = crashed.stdout.strip()
        assert _mounted(dead)
        assert leftovers.sweep(root) == 1
        assert not _mounted(dead) and not Path(dead).exists()
        assert sorted(os.listdir(root)) == sorted(
            [Path(live.workdir).name, f"{Path(live.workdir).name}.disk",
             f"{Path(live.workdir).name}.owner"]
        )  # fmt: skip
        assert (await live.exec("echo ok")).stdout.strip() == "ok"
    assert os.listdir(root) == []
