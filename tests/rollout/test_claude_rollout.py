"""End to end with the real Claude Code CLI in the local sandbox, driven by a scripted
engine that answers with the tool calls of a correct (or a wrong) fix."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rollout_harness import chat_tokenizer, leftovers, policy_recorder, sandbox_ids, shipped_tasks

from recorder import events as ev
from recorder.rollout.agent import AgentSpec
from recorder.rollout.driver import RolloutRequest, RolloutResult, run_group, run_rollout
from recorder.rollout.sandbox import SandboxSpec
from recorder.rollout.tasks import Task
from replay.samples import Sample
from tests.conftest import claude_code_binary
from tests.server.conftest import Harness
from tools.tasks.policy import MARKER, task_policy

pytestmark = pytest.mark.claude


def request(h: Harness, root: Path, task: Task, **kw: Any) -> RolloutRequest:
    return RolloutRequest(
        task=task,
        recorder_url=h.url,
        admin_token=h.config.admin_token,
        sandbox=SandboxSpec(options={"root": str(root)}),
        agent=AgentSpec(binary=claude_code_binary(), max_retries=0),
        sampling={"temperature": 0.7, "max_new_tokens": 2048},
        wall_budget_s=240,
        **kw,
    )


async def engine_tokens(h: Harness, session_id: str) -> list[int]:
    """Every token the engine emitted in the session, in order."""
    out: list[int] = []
    for r in await h.payloads(session_id, ev.GenerateResult):
        out.extend(int(t) for t in np.asarray(await h.array(r.output_ids)))
    return out


def trained_tokens(samples: list[Sample]) -> list[int]:
    return [
        t for s in samples for t, m in zip(s.tokens[s.prompt_len :], s.loss_mask, strict=True) if m
    ]


async def assert_trained_on_engine_output(h: Harness, result: RolloutResult) -> None:
    assert result.session_id is not None and result.turns == 2, result
    assert result.samples and all(s.status != "aborted" for s in result.samples)
    assert all(s.reward == result.reward for s in result.samples)
    assert trained_tokens(result.samples) == await engine_tokens(h, result.session_id)
    attempts = await h.payloads(result.session_id, ev.GenerateAttempt)
    assert {a.sampling_params["temperature"] for a in attempts} == {0.7}  # forced every turn


async def test_correct_fix_passes_and_failures_stay_in_their_rollout(
    sqlite_url: str, tmp_path: Path
) -> None:
    """One GRPO group: two good rollouts, a sandbox that cannot boot, an agent that hangs
    past its budget, and one whose engine dies mid-rollout (on a recorder of its own)."""
    tokenizer = chat_tokenizer()
    h = await policy_recorder(tokenizer, sqlite_url)
    dying = await policy_recorder(tokenizer, f"sqlite+aiosqlite:///{tmp_path / 'dying.db'}")
    policy = task_policy(tokenizer)

    def die_mid_rollout(req: Any) -> Any:
        reply = policy(req)
        if MARKER in tokenizer.decode(req.input_ids):  # the second turn: the engine dies
            asyncio.get_running_loop().call_later(0.05, asyncio.ensure_future, dying.engine.stop())
            reply.token_delay_s = 0.05
        return reply

    dying.engine.backend.default_reply = die_mid_rollout
    root = tmp_path / "sbx"
    root.mkdir()
    task = shipped_tasks()["calc-add"]
    try:
        reqs = [
            request(h, root, task, sample_index=0, group_index=3),
            request(h, root, task, sample_index=1, group_index=3),
            RolloutRequest(
                task=task, sample_index=2, group_index=3, recorder_url=h.url,
                admin_token=h.config.admin_token,
                sandbox=SandboxSpec(options={"root": str(tmp_path / "missing" / "root")}),
            ),
            RolloutRequest(
                task=task, sample_index=3, group_index=3, recorder_url=h.url,
                admin_token=h.config.admin_token,
                sandbox=SandboxSpec(options={"root": str(root)}),
                agent=AgentSpec(command="sleep 600"), wall_budget_s=2.0,
            ),
            request(dying, root, task, sample_index=4, group_index=3),
        ]  # fmt: skip
        results = await run_group(reqs, concurrency=5)
        assert [(r.outcome, r.infra_cause) for r in results] == [
            ("passed", None),
            ("passed", None),
            ("infra_error", "sandbox_boot"),
            ("infra_error", "budget_before_answer"),
            ("infra_error", "engine_error"),
        ], [r.evidence for r in results]
        for good in results[:2]:
            assert good.reward == 1.0
            assert good.evidence["tests_passed"] == [
                "tests/test_calc.py::test_add",
                "tests/test_calc.py::test_sub",
            ]
            await assert_trained_on_engine_output(h, good)
        for bad, rec in zip(results[2:], (h, h, dying), strict=True):
            (closed,) = await rec.payloads(bad.session_id, ev.SessionClosed)
            assert closed.status == "aborted"
            assert all(s.status == "aborted" and not any(s.loss_mask) for s in bad.samples)
        engine_dead = results[4]
        assert len(await dying.payloads(engine_dead.session_id, ev.ResponseSent)) == 1
        ids = [i for r, rec in zip(results, (h, h, h, h, dying), strict=True)
               for i in await sandbox_ids(rec, r.session_id)]  # fmt: skip
        assert leftovers(root, ids) == []
    finally:
        await h.close()
        await dying.close()


async def test_wrong_fix_is_reward_zero_and_trained(sqlite_url: str, tmp_path: Path) -> None:
    h = await policy_recorder(chat_tokenizer(), sqlite_url, wrong=True)
    try:
        task = shipped_tasks()["calc-add"]
        result = await run_rollout(request(h, tmp_path, task))
        assert (result.outcome, result.reward, result.infra_cause) == ("failed", 0.0, None)
        assert result.evidence["tests_failed"] == ["tests/test_calc.py::test_add"]
        await assert_trained_on_engine_output(h, result)
        (closed,) = await h.payloads(result.session_id, ev.SessionClosed)
        assert closed.status == "completed"
    finally:
        await h.close()


async def test_turn_budget_stops_the_agent_and_the_session_says_so(
    sqlite_url: str, tmp_path: Path
) -> None:
    h = await policy_recorder(chat_tokenizer(), sqlite_url)
    try:
        task = shipped_tasks()["greet-punctuation"]
        result = await run_rollout(request(h, tmp_path, task, turn_budget=1))
        assert result.infra_cause is None and result.turns == 1, result.evidence
        assert result.outcome == "passed"  # the one turn's tool call fixed it: graded as usual
        (finished,) = [
            e for e in await h.payloads(result.session_id, ev.SandboxEvent)
            if e.kind == "agent_finished"
        ]  # fmt: skip
        assert finished.detail["stop"] == "turn_budget"
        assert len(await h.payloads(result.session_id, ev.GenerateResult)) == 1
    finally:
        await h.close()


async def test_the_drivers_environment_changes_nothing_in_a_rollout(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host variables that once sent every agent past the recorder (Bedrock), into one
    shared transcript directory (CLAUDE_CONFIG_DIR) or to the admin API (the token):
    the agent never sees them, it still reaches the recorder and passes."""
    host_config = tmp_path / "host-claude-config"
    host_config.mkdir(mode=0o777)
    host_config.chmod(0o777)  # even if the sandbox user could write there, nothing must
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(host_config))
    monkeypatch.setenv("CLAUDE_CODE_USE_BEDROCK", "1")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-host-key")
    monkeypatch.setenv("TR_ADMIN_TOKEN", "host-admin-token")
    h = await policy_recorder(chat_tokenizer(), sqlite_url)
    try:
        result = await run_rollout(request(h, tmp_path, shipped_tasks()["calc-add"]))
        assert (result.outcome, result.reward) == ("passed", 1.0), result.evidence
        await assert_trained_on_engine_output(h, result)
        assert list(host_config.iterdir()) == []  # no transcript, no config landed there
    finally:
        await h.close()
