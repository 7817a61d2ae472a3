"""What only the local backend has to get right: processes that leave their group, and
many sandboxes at once leaving nothing behind (the shared contract is in test_sandbox_suite.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from recorder.rollout.sandbox import SandboxSpec, open_sandbox
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
