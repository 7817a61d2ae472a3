"""The one sandbox suite every backend passes (`backend` runs each test on local and e2b).

It states the contract of `recorder.rollout.sandbox.base`: exit codes are
results, output streams in order and is complete before the result, a timeout
kills the command and everything it started but not the sandbox, files are
bytes, and `kill` is idempotent and leaves nothing behind.
"""

from __future__ import annotations

import asyncio

import pytest
from sandbox_backends import Backend

from recorder.rollout.sandbox import (
    CommandTimeout,
    Sandbox,
    SandboxBootError,
    SandboxGone,
    open_sandbox,
)


def alive(pid: int | str) -> str:
    """A command that succeeds while `pid` runs (a zombie awaiting its reaper counts as dead)."""
    return f"test -d /proc/{pid} && ! grep -q '^State:[[:space:]]*Z' /proc/{pid}/status"


class Lines:
    """An output callback that can be awaited until some text has arrived."""

    def __init__(self) -> None:
        self.chunks: list[str] = []
        self._changed = asyncio.Event()

    def __call__(self, chunk: str) -> None:
        self.chunks.append(chunk)
        self._changed.set()

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    async def until(self, needle: str) -> str:
        while needle not in self.text:
            self._changed.clear()
            await self._changed.wait()
        return self.text


# -- create and run ---------------------------------------------------------------------------


async def test_env_of_the_spec_reaches_commands(sandbox: Sandbox) -> None:
    result = await sandbox.exec("echo $TR_SUITE")
    assert (result.exit_code, result.stdout) == (0, "yes\n")


async def test_command_env_adds_to_and_overrides_the_spec_env(sandbox: Sandbox) -> None:
    result = await sandbox.exec('echo "$ONE-$TR_SUITE"', env={"ONE": "1"})
    assert result.stdout == "1-yes\n"
    result = await sandbox.exec("echo $TR_SUITE", env={"TR_SUITE": "overridden"})
    assert result.stdout == "overridden\n"


async def test_exit_codes_are_results_and_streams_stay_apart(sandbox: Sandbox) -> None:
    result = await sandbox.exec("echo out; echo err >&2; exit 7")
    assert (result.exit_code, result.stdout, result.stderr) == (7, "out\n", "err\n")
    assert (await sandbox.exec("true")).exit_code == 0
    assert (await sandbox.exec("false")).exit_code == 1
    assert (await sandbox.exec("no-such-command-here")).exit_code == 127
    assert result.duration_s >= 0


async def test_output_streams_in_order_and_is_complete_before_the_result(
    sandbox: Sandbox,
) -> None:
    out, err = Lines(), Lines()
    script = "for i in $(seq 1 200); do echo line-$i; echo warn-$i >&2; done"
    result = await sandbox.exec(script, on_stdout=out, on_stderr=err)
    expected = "".join(f"line-{i}\n" for i in range(1, 201))
    assert out.text == result.stdout == expected
    assert err.text == result.stderr == expected.replace("line", "warn")


async def test_commands_run_in_the_workdir_or_the_given_cwd(sandbox: Sandbox) -> None:
    assert (await sandbox.exec("pwd")).stdout.strip() == sandbox.workdir
    await sandbox.exec("mkdir -p sub/dir")
    assert (await sandbox.exec("pwd", cwd="sub/dir")).stdout.strip() == f"{sandbox.workdir}/sub/dir"
    absolute = f"{sandbox.workdir}/sub"
    assert (await sandbox.exec("pwd", cwd=absolute)).stdout.strip() == absolute


# -- timeouts ---------------------------------------------------------------------------------


async def test_a_timeout_raises_and_the_sandbox_survives(sandbox: Sandbox) -> None:
    with pytest.raises(CommandTimeout) as caught:
        await sandbox.exec("sleep 60", timeout_s=0.3)
    assert caught.value.timeout_s == 0.3
    assert (await sandbox.exec("echo ok")).stdout == "ok\n"


async def test_a_timeout_kills_what_the_command_started(sandbox: Sandbox) -> None:
    out = Lines()
    handle = await sandbox.start("sleep 300 & echo child=$!; wait", on_stdout=out)
    child = (await out.until("\n")).strip().removeprefix("child=")
    with pytest.raises(CommandTimeout):
        await handle.wait(timeout_s=0.1)
    assert (await sandbox.exec(alive(child))).exit_code != 0


# -- background commands ----------------------------------------------------------------------


async def test_a_background_command_is_waited_for(sandbox: Sandbox) -> None:
    out = Lines()
    handle = await sandbox.start("echo hi; exit 4", on_stdout=out)
    assert handle.pid > 0
    result = await handle.wait()
    assert (result.exit_code, result.stdout, out.text) == (4, "hi\n", "hi\n")
    assert await handle.wait() == result  # waiting again gives the same result


async def test_a_background_command_is_killed(sandbox: Sandbox) -> None:
    out = Lines()
    handle = await sandbox.start("echo started; sleep 300", on_stdout=out)
    await out.until("started")
    await handle.kill()
    result = await handle.wait(timeout_s=30)
    assert result.exit_code != 0
    assert result.stdout == "started\n"
    await handle.kill()  # idempotent
    assert (await sandbox.exec(alive(handle.pid))).exit_code != 0


async def test_waiting_too_long_on_a_background_command_kills_it(sandbox: Sandbox) -> None:
    handle = await sandbox.start("sleep 300")
    with pytest.raises(CommandTimeout):
        await handle.wait(timeout_s=0.2)
    assert (await handle.wait()).exit_code != 0


async def test_ending_the_processes_keeps_the_sandbox(sandbox: Sandbox) -> None:
    """What the driver does once the agent is done, before it reads the agent's work."""
    out = Lines()
    handle = await sandbox.start("sleep 300 & echo child=$!; wait", on_stdout=out)
    child = (await out.until("\n")).strip().removeprefix("child=")
    await sandbox.write_file("kept.txt", "kept")
    await sandbox.end_processes()
    assert (await handle.wait(timeout_s=30)).exit_code != 0
    assert (await sandbox.exec(alive(handle.pid))).exit_code != 0
    assert (await sandbox.exec(alive(child))).exit_code != 0
    assert await sandbox.read_file("kept.txt") == b"kept"


async def test_commands_run_side_by_side(sandbox: Sandbox) -> None:
    slow = await sandbox.start("sleep 300")
    assert (await sandbox.exec("echo meanwhile")).stdout == "meanwhile\n"
    await slow.kill()


# -- files ------------------------------------------------------------------------------------


async def test_files_round_trip_as_bytes_with_parents_created(sandbox: Sandbox) -> None:
    blob = bytes(range(256)) * 64
    await sandbox.write_file("nested/deep/dir/blob.bin", blob)
    assert await sandbox.read_file("nested/deep/dir/blob.bin") == blob
    assert (await sandbox.exec("wc -c < nested/deep/dir/blob.bin")).stdout.strip() == "16384"
    assert await sandbox.read_file(f"{sandbox.workdir}/nested/deep/dir/blob.bin") == blob


async def test_text_is_written_as_utf8(sandbox: Sandbox) -> None:
    await sandbox.write_file("note.txt", "héllo\n")
    assert await sandbox.read_file("note.txt") == "héllo\n".encode()
    await sandbox.write_file("note.txt", "shorter")  # overwrites
    assert (await sandbox.exec("cat note.txt")).stdout == "shorter"


async def test_commands_and_files_see_the_same_tree(sandbox: Sandbox) -> None:
    await sandbox.exec("mkdir -p out && printf 'made\\n' > out/by-command.txt")
    assert await sandbox.read_file("out/by-command.txt") == b"made\n"


async def test_a_missing_file_is_file_not_found(sandbox: Sandbox) -> None:
    with pytest.raises(FileNotFoundError):
        await sandbox.read_file("no/such/file.txt")


# -- lifetime ---------------------------------------------------------------------------------


async def test_kill_is_idempotent_and_leaves_nothing_behind(backend: Backend) -> None:
    sb = await open_sandbox(backend.spec())
    await sb.start("sleep 300")
    await sb.exec("setsid sleep 300 > /dev/null 2>&1 < /dev/null &")  # escapes its group
    await sb.write_file("data/file.txt", "x")
    await sb.kill()
    await sb.kill()
    assert await backend.leftovers(sb) == []
    with pytest.raises(SandboxGone):
        await sb.exec("true")
    with pytest.raises(SandboxGone):
        await sb.read_file("data/file.txt")


async def test_a_sandbox_past_its_lifetime_is_gone(backend: Backend) -> None:
    sb = await open_sandbox(backend.spec(timeout_s=1.0))
    while True:  # the backend removes it once its lifetime runs out
        try:
            await sb.exec("true")
        except SandboxGone:
            break
        await asyncio.sleep(0.1)
    await sb.kill()  # no error for a sandbox that is already gone
    assert await backend.leftovers(sb) == []


async def test_a_boot_that_fails_is_a_boot_error(backend: Backend) -> None:
    with pytest.raises(SandboxBootError):
        await open_sandbox(backend.failing_spec())


async def test_sandboxes_are_isolated_from_each_other(backend: Backend) -> None:
    async with await open_sandbox(backend.spec()) as a, await open_sandbox(backend.spec()) as b:
        assert a.id != b.id and a.workdir != b.workdir
        await a.write_file("mine.txt", "a")
        with pytest.raises(FileNotFoundError):
            await b.read_file("mine.txt")
