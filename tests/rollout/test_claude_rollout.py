"""End to end with the real Claude Code CLI in the local sandbox, driven by a scripted
engine that answers with the tool calls of a correct (or a wrong) fix."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from rollout_harness import chat_tokenizer, leftovers, policy_recorder, sandbox_ids, shipped_tasks

from recorder.log import events as ev
from recorder.rollout.agent import AgentSpec, compaction_env
from recorder.rollout.driver import RolloutRequest, RolloutResult, run_group, run_rollout
from recorder.rollout.sandbox import SandboxSpec
from recorder.rollout.tasks import Task
from replay.samples import Sample
from tests.conftest import claude_code_binary
from tests.server.conftest import Harness, make_harness
from tools.claude_traffic import Rule, responder
from tools.claude_traffic import tool_call as traffic_call
from tools.tasks.policy import FIXES, MARKER, task_policy

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


# -- compaction before the recorder's context limit (README: "Claude Code settings") ----------

SUMMARY_ASKED = "Your task is to create a detailed summary"
PARTS = 10


def _growing_policy(tokenizer: Any) -> Any:
    """Print PARTS chunks of ~3.4k tokens with Bash, then apply calc-add's fix."""
    phrase, fix, _ = FIXES["calc-add"]
    rules = [
        Rule(SUMMARY_ASKED, "<summary>Printed parts of the output. Next: apply the fix.</summary>"),
        Rule(MARKER, "I fixed the bug; the tests should pass now."),
        Rule("Next: apply the fix", traffic_call("Bash", {"command": f"{fix} && echo {MARKER}"})),
        Rule(f"part-{PARTS}-end", traffic_call("Bash", {"command": f"{fix} && echo {MARKER}"})),
    ]
    for i in range(PARTS, 0, -1):
        cmd = f"seq -f 'p{i}-%g' 1 700; echo part-{i}-end"
        rules.append(
            Rule(f"part-{i - 1}-end" if i > 1 else phrase, traffic_call("Bash", {"command": cmd}))
        )
    return responder(tokenizer, rules)


async def _growing_rollout(
    sqlite_url: str, tmp_path: Path, compact_at: float | None
) -> tuple[Harness, RolloutResult]:
    h = await make_harness(
        chat_tokenizer(),
        sqlite_url,
        engine_kwargs={
            "context_length": 200_000,
            "default_reply": _growing_policy(chat_tokenizer()),
        },
        context_length=40_000,
    )
    agent = AgentSpec(binary=claude_code_binary("2.1.330"), max_retries=0, compact_at=compact_at)
    tmp_path.mkdir()
    req = request(h, tmp_path, shipped_tasks()["calc-add"])
    return h, await run_rollout(msgspec.structs.replace(req, agent=agent))


async def test_the_driver_makes_claude_code_compact_before_the_context_limit(
    sqlite_url: str, tmp_path: Path
) -> None:
    """At --context-length 40000, 2.1.330 left alone reaches the limit (a 400 `prompt is too
    long`, then a reactive compaction); with the driver's settings, derived from the
    recorder's context length, it compacts first and never gets a 400."""
    h, result = await _growing_rollout(sqlite_url, tmp_path / "on", 0.8)
    try:
        sid = result.session_id
        assert result.outcome == "passed", result.evidence
        (started,) = [
            e for e in await h.payloads(sid, ev.SandboxEvent) if e.kind == "agent_started"
        ]
        assert (
            started.detail["compaction"]
            == compaction_env(40_000, 0.8)
            == {
                "CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000",
                "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "40",
            }
        )
        assert await h.payloads(sid, ev.RequestRejected) == []
        prompts = [
            h.tokenizer.decode(await h.array(r.input_ids))
            for r in await h.payloads(sid, ev.RenderedInput)
        ]
        assert any(SUMMARY_ASKED in p for p in prompts)  # it compacted, before any 400
        assert max(r.input_ids.length for r in await h.payloads(sid, ev.RenderedInput)) < 40_000
        # Proactive compaction re-sends the whole context: every engine token is trained.
        assert trained_tokens(result.samples) == await engine_tokens(h, sid)
        assert [s.metadata["segment_kind"] for s in result.samples][-1] == "final"
    finally:
        await h.close()
    h, left_alone = await _growing_rollout(
        f"sqlite+aiosqlite:///{tmp_path / 'off.db'}", tmp_path / "off", None
    )
    try:
        rejected = await h.payloads(left_alone.session_id, ev.RequestRejected)
        assert rejected and rejected[0].message.startswith("prompt is too long")
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
