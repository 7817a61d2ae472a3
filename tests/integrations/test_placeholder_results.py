"""A rollout that passed its task, but whose samples are the recorder's placeholders.

The recorder answers a normal close with placeholders (aborted, fully masked) when
the reducer finds no usable turn or fails; the driver's outcome is still the
grader's. Found in an audit: the hooks took it as a healthy rollout, so verl's
legacy trainer got a masked output with the task's reward 1.0 (moving its GRPO
group), v1 a fully masked output with reward 0 instead of nothing, and slime's
evaluation an ABORTED sample with reward 1.0. Now each treats it as a failure of
the infrastructure, as it treats a sandbox that never booted.
"""

from __future__ import annotations

import pytest

import replay.reducer as reducer
from recorder.integrations import slime as hook
from recorder.integrations.common import describe_failure, is_infra_failure
from recorder.integrations.verl_outputs import Limits, outputs_for
from recorder.rollout.driver import RolloutResult
from replay.rules import Rules
from tests.integrations import slime_double as slime
from tests.integrations.results import fan_out_log, result_of
from tests.replay.builders import Attempt, Log

WIDE = Limits(prompt_length=64, response_length=64)


@pytest.fixture
def passed_but_placeholders(monkeypatch: pytest.MonkeyPatch) -> RolloutResult:
    log = fan_out_log("reducer-bug")
    log.reward(1.0).close()

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("a reducer bug")

    monkeypatch.setattr(reducer, "_build_segments", boom)
    reduced = reducer.reduce_session(log.events, log.arrays, Rules())
    assert reduced.placeholder and all(s.status == "aborted" for s in reduced.samples)
    return RolloutResult(
        session_id="reducer-bug", outcome="passed", reward=1.0, samples=reduced.samples, turns=6
    )


def test_it_is_an_infrastructure_failure(passed_but_placeholders: RolloutResult) -> None:
    assert is_infra_failure(passed_but_placeholders)
    assert describe_failure(passed_but_placeholders).startswith(
        "placeholder samples: reducer error"
    )


def test_a_healthy_rollout_is_not() -> None:
    assert not is_infra_failure(result_of(fan_out_log("healthy"), reward=1.0))


def test_no_usable_turn_gives_placeholders_too() -> None:
    """Without a monkeypatch: every turn lacks logprobs (an engine asked for none)."""
    log = Log("no-logprobs").open()
    lacking = [Attempt([10, 11], missing_logprobs=True)]
    t = log.turn([1, 2, 3], attempts=lacking, tool_uses=[("tu", "Bash")])
    log.turn(t.then([4]), attempts=[Attempt([12, 2], missing_logprobs=True)], tool_results=["tu"])
    result = result_of(log, reward=1.0)
    assert all("placeholder" in s.metadata for s in result.samples)
    assert is_infra_failure(result)


def test_verl_gets_no_reward_without_trained_tokens(passed_but_placeholders: RolloutResult) -> None:
    assert outputs_for(passed_but_placeholders, mode="v1", limits=WIDE, pad_token_id=0) == []
    (out,) = outputs_for(passed_but_placeholders, mode="legacy", limits=WIDE, pad_token_id=0)
    assert not any(out.response_mask) and out.reward_score == 0.0
    assert out.extra_fields["recorder_failed"] is True


@pytest.mark.parametrize("evaluation", [False, True])
def test_slime_gets_an_aborted_sample_without_reward(
    passed_but_placeholders: RolloutResult, evaluation: bool
) -> None:
    like = slime.Sample(index=1, group_index=0, metadata={})
    outs = hook.from_result(passed_but_placeholders, like, routing=None, evaluation=evaluation)
    assert all(o.status is slime.Sample.Status.ABORTED and o.reward == 0.0 for o in outs)
