"""What one agent must not do to the driver that runs it (an eighth audit, through the
real driver and local sandboxes): hang its rollout with a process that drops the
sandbox's marks, or fill the driver's memory or hang its reads with a file planted
where the driver reads the diff. Each rollout below had hung or run the driver out
of memory; now it ends, graded on the agent's fix."""

# ruff: noqa: F811  (recorder, the fixture, is imported by name)
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from task_repos import base_repo
from test_reward_integrity import FIX, calc_task, local, recorder, rollout  # noqa: F401

from tests.server.conftest import Harness

# Holds the agent command's output open, with no mark of the sandbox in its environment.
LURKER = "(env -i /usr/bin/setsid /bin/sh -c 'exec sleep 300' &) ; sleep 0.3"


@pytest.mark.parametrize(
    "plant",
    ["true", "ln -s /dev/zero ../agent.diff", "mkfifo ../agent.diff"],
    ids=["lurker", "lurker+dev-zero", "lurker+fifo"],
)
async def test_a_lurker_and_a_planted_diff_file_neither_hang_nor_fill_the_driver(
    recorder: Harness, tmp_path: Path, plant: str
) -> None:
    src = tmp_path / "src"
    task = calc_task(str(src), base_repo(src))
    agent = f"{FIX} && {plant} && {LURKER}"
    result = await asyncio.wait_for(rollout(recorder, local(tmp_path), task, agent), 120)
    assert (result.outcome, result.reward, result.infra_cause) == ("passed", 1.0, None), (
        result.evidence
    )
