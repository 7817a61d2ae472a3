"""The driver over every sandbox backend (local, and E2B through the real SDK against
its doubles): a scripted agent's diff graded in a fresh sandbox, and a boot failure."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from rollout_harness import chat_tokenizer, policy_recorder, sandbox_ids, shipped_tasks
from sandbox_backends import Backend

from recorder.log import events as ev
from recorder.rollout.agent import AgentSpec
from recorder.rollout.driver import RolloutRequest, run_group
from tests.server.conftest import Harness

FIX = "sed -i '0,/return a - b/s//return a + b/' calc.py && rm README.md && printf '\\377' > b.bin"


@pytest.fixture
async def recorder(sqlite_url: str) -> AsyncIterator[Harness]:
    h = await policy_recorder(chat_tokenizer(), sqlite_url)
    try:
        yield h
    finally:
        await h.close()


async def test_rollouts_on_every_backend(
    recorder: Harness, backend: Backend, tmp_path: Path
) -> None:
    task = shipped_tasks()["calc-add"]
    check = "set -e\ntest ! -e README.md\ntest -s b.bin\ngrep -q 'return a + b' calc.py\n"
    graded = msgspec.structs.replace(task, tests=None, eval_script=check)
    good = RolloutRequest(
        task=graded,
        recorder_url=recorder.url,
        admin_token=recorder.config.admin_token,
        sandbox=backend.spec(),
        agent=AgentSpec(command=FIX),
    )
    (ok,) = await run_group([good])
    booting = msgspec.structs.replace(good, sample_index=1, sandbox=backend.failing_spec())
    (boot,) = await run_group([booting])
    assert (ok.outcome, ok.reward) == ("passed", 1.0), ok.evidence
    assert (boot.outcome, boot.infra_cause) == ("infra_error", "sandbox_boot")
    created = [
        e.detail for e in await recorder.payloads(ok.session_id, ev.SandboxEvent)
        if e.kind == "sandbox_created"
    ]  # fmt: skip
    assert [(c["role"], c["backend"]) for c in created] == [
        ("agent", backend.name),
        ("eval", backend.name),
    ]
    assert len(set(await sandbox_ids(recorder, ok.session_id))) == 2
    if backend.doubles is not None:
        assert backend.doubles.live() == []
