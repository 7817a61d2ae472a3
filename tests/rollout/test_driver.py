"""The rollout driver without a model: agent commands that are shell scripts, so the
diff, the fresh eval sandbox, the taxonomy and cancellation are checked in seconds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from rollout_harness import leftovers, policy_recorder, sandbox_ids, shipped_tasks

from recorder.log import events as ev
from recorder.rollout import driver as driver_module
from recorder.rollout.agent import AgentSpec, compaction_env
from recorder.rollout.driver import RolloutRequest, run_group, run_rollout
from recorder.rollout.sandbox import SandboxSpec
from recorder.rollout.tasks import Task
from tests.server.conftest import FIXTURE_TOKENIZER, Harness, load_tokenizer


@pytest.fixture
async def recorder(sqlite_url: str) -> AsyncIterator[Harness]:
    tokenizer = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template="chatml-tools")
    h = await policy_recorder(tokenizer, sqlite_url)
    try:
        yield h
    finally:
        await h.close()


def request(h: Harness, root: Path, task: Task, **kw: Any) -> RolloutRequest:
    return RolloutRequest(
        task=task,
        recorder_url=h.url,
        admin_token=h.config.admin_token,
        sandbox=SandboxSpec(options={"root": str(root)}),
        **kw,
    )


SCRIPTED_FIX = """
rm README.md
printf '\\000\\001binary\\377' > blob.bin
mkdir -p docs && echo new > docs/NOTES.txt
sed -i '0,/return a - b/s//return a + b/' calc.py
"""


async def test_diff_carries_new_deleted_and_binary_files_into_a_fresh_sandbox(
    recorder: Harness, tmp_path: Path
) -> None:
    base = shipped_tasks()["calc-add"]
    check = (
        'set -e\ntest ! -e README.md\ntest "$(cat docs/NOTES.txt)" = new\n'
        "printf '\\000\\001binary\\377' | cmp - blob.bin\n"
        "python -m pytest -q -p no:cacheprovider tests\n"
    )
    task = msgspec.structs.replace(base, tests=None, eval_script=check)
    (tmp_path / "fix.sh").write_text(SCRIPTED_FIX)
    agent = AgentSpec(command=f"sh {tmp_path / 'fix.sh'}")
    root = tmp_path / "sbx"
    root.mkdir()
    result = await run_rollout(request(recorder, root, task, agent=agent))
    assert result.outcome == "passed" and result.reward == 1.0, result.evidence
    kinds = [e.kind for e in await recorder.payloads(result.session_id, ev.SandboxEvent)]
    assert kinds == [
        "sandbox_created",
        "command_run",  # the checkout
        "agent_started",
        "agent_finished",
        "diff_taken",
        "sandbox_killed",
        "sandbox_created",
        "command_run",
        "patch_applied",
        "eval_result",
        "sandbox_killed",
    ]
    (diff,) = [
        e
        for e in await recorder.payloads(result.session_id, ev.SandboxEvent)
        if e.kind == "diff_taken"
    ]
    assert diff.detail["files"] == 4
    assert diff.detail["patch"] == result.diff and not diff.detail["patch_truncated"]
    created = [
        e.detail
        for e in await recorder.payloads(result.session_id, ev.SandboxEvent)
        if e.kind == "sandbox_created"
    ]
    assert [c["role"] for c in created] == ["agent", "eval"]
    assert created[0]["sandbox_id"] != created[1]["sandbox_id"]  # never grades itself
    (reward,) = await recorder.payloads(result.session_id, ev.RewardAssigned)
    assert reward.reward == 1.0 and reward.detail["passed"] is True
    assert leftovers(root, await sandbox_ids(recorder, result.session_id)) == []


async def test_empty_diff_is_reward_zero_not_an_error(recorder: Harness, tmp_path: Path) -> None:
    task = shipped_tasks()["greet-punctuation"]
    result = await run_rollout(request(recorder, tmp_path, task, agent=AgentSpec(command="true")))
    assert (result.outcome, result.reward, result.infra_cause) == ("failed", 0.0, None)
    events = await recorder.payloads(result.session_id, ev.SandboxEvent)
    assert [e.kind for e in events][-2:] == ["sandbox_killed", "eval_result"]
    assert events[-1].detail["empty_diff"] is True
    (closed,) = await recorder.payloads(result.session_id, ev.SessionClosed)
    assert closed.status == "completed"


async def test_the_log_keeps_the_diff_up_to_its_cap(
    recorder: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`replay view` shows the patch from the log: kept whole when small, cut and flagged when not."""
    monkeypatch.setattr(driver_module, "PATCH_IN_LOG", 64)
    task = shipped_tasks()["wordcount-trailing-newline"]
    fix = AgentSpec(command="sed -i 's/len(text.split(\"\\\\n\"))/len(text.splitlines())/' wc.py")
    result = await run_rollout(request(recorder, tmp_path, task, agent=fix))
    assert result.outcome == "passed", result.evidence
    (diff,) = [
        e
        for e in await recorder.payloads(result.session_id, ev.SandboxEvent)
        if e.kind == "diff_taken"
    ]
    assert len(result.diff) > 64
    assert diff.detail["patch"] == result.diff[:64] and diff.detail["patch_truncated"] is True


async def test_infrastructure_failures_abort_only_their_own_rollout(
    recorder: Harness, tmp_path: Path
) -> None:
    task = shipped_tasks()["wordcount-trailing-newline"]
    root = tmp_path / "sbx"
    root.mkdir()
    fix = AgentSpec(command="sed -i 's/len(text.split(\"\\\\n\"))/len(text.splitlines())/' wc.py")
    reqs = [
        request(recorder, root, task, sample_index=0, group_index=4, agent=fix),
        msgspec.structs.replace(
            request(recorder, root, task, sample_index=1, group_index=4, agent=fix),
            sandbox=SandboxSpec(options={"root": str(tmp_path / "no" / "such" / "dir")}),
        ),
        request(
            recorder, root, task, sample_index=2, group_index=4,
            agent=AgentSpec(command="sleep 600"), wall_budget_s=1.0,
        ),
        msgspec.structs.replace(
            request(recorder, root, task, sample_index=3, group_index=4, agent=fix),
            task=msgspec.structs.replace(task, setup=["exit 3"]),
        ),
    ]  # fmt: skip
    results = await run_group(reqs, concurrency=4)
    assert [(r.outcome, r.infra_cause) for r in results] == [
        ("passed", None),
        ("infra_error", "sandbox_boot"),
        ("infra_error", "budget_before_answer"),
        ("infra_error", "setup_failed"),
    ]
    for r in results[1:]:
        (closed,) = await recorder.payloads(r.session_id, ev.SessionClosed)
        assert closed.status == "aborted" and closed.reason.startswith(r.infra_cause or "")
        assert r.samples and all(s.status == "aborted" and not any(s.loss_mask) for s in r.samples)
        failed = [e for e in await recorder.payloads(r.session_id, ev.SandboxEvent)]
        assert failed[-1].kind == "failed" and failed[-1].detail["cause"] == r.infra_cause
    # The agent's sandbox, killed on the budget path, is logged as the agent's.
    killed = await recorder.payloads(results[2].session_id, ev.SandboxEvent)
    assert [e.detail["role"] for e in killed if e.kind == "sandbox_killed"] == ["agent"]
    opened = [(await recorder.payloads(r.session_id, ev.SessionOpened))[0] for r in results]
    assert {o.metadata["group_index"] for o in opened} == {4}
    ids = [i for r in results for i in await sandbox_ids(recorder, r.session_id)]
    assert leftovers(root, ids) == []


async def test_cancel_kills_the_agent_removes_sandboxes_and_aborts_the_session(
    recorder: Harness, tmp_path: Path
) -> None:
    task = shipped_tasks()["calc-add"]
    root = tmp_path / "sbx"
    root.mkdir()
    req = request(recorder, root, task, agent=AgentSpec(command="sleep 600"))
    rollout = asyncio.ensure_future(run_rollout(req))
    while not any((p / "prompt.txt").exists() for p in root.iterdir()):
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # the agent is running
    rollout.cancel()
    with pytest.raises(asyncio.CancelledError):
        await rollout
    sids = [s for s in recorder.ctx.registry._sessions]
    (sid,) = sids
    (closed,) = await recorder.payloads(sid, ev.SessionClosed)
    assert closed.status == "aborted" and closed.reason.startswith("cancelled")
    kinds = [e.kind for e in await recorder.payloads(sid, ev.SandboxEvent)]
    assert kinds[-2:] == ["sandbox_killed", "failed"]
    killed = [
        e for e in await recorder.payloads(sid, ev.SandboxEvent) if e.kind == "sandbox_killed"
    ]
    assert [e.detail["role"] for e in killed] == ["agent"]
    assert leftovers(root, await sandbox_ids(recorder, sid)) == []


async def test_unreachable_recorder_is_an_infrastructure_failure(tmp_path: Path) -> None:
    task = shipped_tasks()["calc-add"]
    req = RolloutRequest(task=task, recorder_url="http://127.0.0.1:9", sandbox=SandboxSpec())
    result = await run_rollout(req)
    assert (result.outcome, result.infra_cause, result.session_id) == (
        "infra_error",
        "recorder_unreachable",
        None,
    )
    (sample,) = result.samples
    assert sample.status == "aborted" and sample.loss_mask == [0]


async def test_a_grader_that_cannot_run_is_infrastructure(
    recorder: Harness, tmp_path: Path
) -> None:
    task = msgspec.structs.replace(
        shipped_tasks()["greet-punctuation"], eval_cmd="no-such-grader --run"
    )
    fix = AgentSpec(command="echo '# touched' >> greet.py")
    result = await run_rollout(request(recorder, tmp_path, task, agent=fix))
    assert (result.outcome, result.infra_cause) == ("infra_error", "eval_crashed")
    (closed,) = await recorder.payloads(result.session_id, ev.SessionClosed)
    assert closed.status == "aborted"


FIX_CALC = "sed -i '0,/return a - b/s//return a + b/' calc.py"


@pytest.mark.parametrize(
    ("spec", "window", "percent"),
    [
        ({}, "220000", "80"),  # the recorder's 200k context: compact at 160k
        ({"compact_at": 0.5}, "220000", "50"),
        ({"env": {"CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "7"}}, "220000", "7"),  # the spec's own wins
        ({"compact_at": None}, "", ""),  # left to the CLI
    ],
)
async def test_agent_gets_compaction_settings_from_the_recorders_context_length(
    recorder: Harness, tmp_path: Path, spec: dict[str, Any], window: str, percent: str
) -> None:
    """The driver reads the context length from the recorder (GET /health): the agent's
    environment is checked by the agent itself, which fixes the bug only if it is right."""
    check = (
        f'test "$CLAUDE_CODE_AUTO_COMPACT_WINDOW" = "{window}" && '
        f'test "$CLAUDE_AUTOCOMPACT_PCT_OVERRIDE" = "{percent}" && {FIX_CALC}'
    )
    agent = AgentSpec(command=check, **spec)
    result = await run_rollout(
        request(recorder, tmp_path, shipped_tasks()["calc-add"], agent=agent)
    )
    assert result.outcome == "passed", result.evidence


def test_compaction_env_is_a_share_of_the_context_length() -> None:
    """Claude Code compacts at PCT percent of (max(WINDOW, 100k) - 20k) tokens (measured)."""
    assert compaction_env(40_000, 0.8) == {
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000",
        "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "40",  # 40% of 80k = 32k = 0.8 x 40k
    }
    assert compaction_env(131_072, 0.75)["CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"] == "75"
    assert compaction_env(1_000, 0.5)["CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"] == "1"  # never 0 (= off)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="compact_at"):
            compaction_env(40_000, bad)


async def test_failure_causes_carry_what_the_command_said(
    recorder: Harness, tmp_path: Path
) -> None:
    """setup_failed keeps a build tool's stdout; agent_install shows npm's own log when
    `npm --silent` prints nothing (here: a registry that refuses connections)."""
    task = shipped_tasks()["calc-add"]
    root = tmp_path / "sbx"
    root.mkdir()
    setup = msgspec.structs.replace(task, setup=["echo 'make: *** [all] Error 2'; exit 3"])
    offline = SandboxSpec(
        options={"root": str(root)},
        env={"npm_config_registry": "http://127.0.0.1:9/", "npm_config_fetch_retries": "0"},
    )
    install = AgentSpec(binary="/nonexistent/claude", version="2.1.197")
    results = await run_group(
        [
            request(recorder, root, setup),
            msgspec.structs.replace(request(recorder, root, task, agent=install), sandbox=offline),
        ]
    )
    assert [r.infra_cause for r in results] == ["setup_failed", "agent_install"]
    assert "make: *** [all] Error 2" in results[0].evidence["error"]
    said = results[1].evidence["error"]
    assert "ECONNREFUSED" in said or "127.0.0.1:9" in said, said
