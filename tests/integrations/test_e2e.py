"""The slime hook end to end: a group of hooks at once against one recorder in another process."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from recorder.integrations import slime as hook
from recorder.rollout.tasks import Task
from tests.integrations import slime_double as slime
from tests.integrations.conftest import Stack

pytestmark = pytest.mark.slow


def as_row(task: Task) -> dict[str, Any]:
    return msgspec.to_builtins(task)


def flat(task: Task) -> dict[str, Any]:
    """The scaleswe layout: task fields at the top of the row's metadata."""
    row = as_row(task)
    tests = row.pop("tests", None)
    if tests:
        row["FAIL_TO_PASS"], row["PASS_TO_PASS"] = tests["FAIL_TO_PASS"], tests["PASS_TO_PASS"]
    return row


def remote(task: Task) -> dict[str, Any]:
    """The SWE-bench layout: the fields under remote_env_info, the statement in the prompt."""
    row = flat(task)
    row.pop("problem_statement")
    return {"remote_env_info": row}


async def test_groups_of_hooks_run_concurrently_against_one_remote_recorder(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in stack.env().items():
        monkeypatch.setenv(k, v)
    args = slime.make_args()
    calc, greet = stack.tasks["calc-add"], stack.tasks["greet-punctuation"]
    wc = stack.tasks["wordcount-trailing-newline"]
    broken = {**flat(calc), "repo": "/nonexistent/repo"}

    def sample(index: int, group: int, metadata: dict[str, Any], prompt: str = "") -> slime.Sample:
        return slime.Sample(index=index, group_index=group, prompt=prompt, metadata=metadata)

    group_a = [sample(i, 0, flat(calc)) for i in range(3)] + [sample(3, 0, broken)]
    group_b = [
        sample(4, 1, remote(greet), prompt=greet.problem_statement),
        sample(5, 1, {"task": as_row(wc)}),
    ]
    params = {  # what slime's rollout passes (--rollout-stop-token-ids adds stop_token_ids)
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 256,
        "stop_token_ids": [2],
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    done = await asyncio.gather(
        slime.generate_and_rm_group(args, group_a, params, hook.generate),
        slime.generate_and_rm_group(args, group_b, params, hook.generate),
    )
    flat_samples = slime.flatten(list(done))
    slime.convert_to_train_data(args, flat_samples)

    by_index = {s.index: s for s in flat_samples}
    assert sorted(by_index) == [0, 1, 2, 3, 4, 5], "one sample per rollout (one segment each)"
    for i in (0, 1, 2, 4, 5):
        s = by_index[i]
        rec = s.metadata["recorder"]
        assert rec["outcome"] == "passed" and s.reward == 1.0, rec
        assert s.status is slime.Sample.Status.COMPLETED and not s.remove_sample
        assert sum(s.loss_mask) > 0 and s.rollout_id == i
        assert (
            len(s.tokens) == len(s.tokens[: len(s.tokens) - s.response_length]) + s.response_length
        )
    sessions = {by_index[i].metadata["recorder"]["session_id"] for i in (0, 1, 2, 4, 5)}
    assert len(sessions) == 5, "one recorder session per sample"
    assert {by_index[i].group_index for i in (0, 1, 2, 3)} == {0}
    failed = by_index[3]
    assert failed.status is slime.Sample.Status.ABORTED and failed.remove_sample
    assert failed.reward == 0.0 and failed.loss_mask == [0]
    assert failed.metadata["recorder"]["reason"]


async def test_a_retried_sample_gets_a_new_session(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in stack.env().items():
        monkeypatch.setenv(k, v)
    like = slime.Sample(index=9, group_index=2, metadata=flat(stack.tasks["calc-add"]))
    first = await hook.generate(slime.make_args(), like, {"max_new_tokens": 256})
    again = await hook.generate(slime.make_args(), like, {"max_new_tokens": 256})
    ids = {s.metadata["recorder"]["session_id"] for s in [*first, *again]}
    assert len(ids) == 2 and all(s.reward == 1.0 for s in [*first, *again])
