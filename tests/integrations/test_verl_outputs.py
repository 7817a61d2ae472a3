"""Recorder samples -> verl AgentLoopOutput fields (pure; verl's real code: test_verl.py)."""

from __future__ import annotations

import pytest

from recorder.integrations import verl_outputs
from recorder.integrations.verl_outputs import Limits, outputs_for, to_fields
from replay.rules import Rules
from tests.integrations.results import fan_out_log, infra_failure, result_of

WIDE = Limits(prompt_length=64, response_length=64)


def test_v1_gets_one_output_per_segment_final_last() -> None:
    result = result_of(fan_out_log(), reward=1.0, rules=Rules(reward_mode="copy"))
    outs = outputs_for(result, mode="v1", limits=WIDE, pad_token_id=0)
    assert [o.extra_fields["segment_kind"] for o in outs] == ["subagent", "wipe", "final"]
    for o, s in zip(outs, result.samples, strict=True):
        assert o.prompt_ids + o.response_ids == s.tokens
        assert len(o.prompt_ids) == s.prompt_len
        assert o.response_mask == s.loss_mask and o.response_logprobs == s.rollout_logprobs
        assert o.reward_score == 1.0 and o.routed_experts is None
        assert o.extra_fields["reward_extra_info"] == {}
        assert o.extra_fields["recorder_session_id"] == "s1"
        assert o.extra_fields["recorder_failed"] is False
        assert not o.extra_fields["recorder_truncated"]
        assert o.num_turns == 2 * len(s.metadata["turns"])
        assert o.metrics["generate_sequences"] == 3.0 and o.metrics["compute_score"] == 1.0


def test_legacy_gets_exactly_the_final_segment_with_the_task_reward() -> None:
    result = result_of(fan_out_log(), reward=1.0)  # uniform: 1/3 per segment
    (o,) = outputs_for(result, mode="legacy", limits=WIDE, pad_token_id=0)
    final = result.samples[-1]
    assert o.prompt_ids + o.response_ids == final.tokens
    assert o.reward_score == 1.0 and final.reward == pytest.approx(1 / 3)
    assert o.extra_fields["segment_kind"] == "final"
    assert o.extra_fields["recorder_dropped_segments"] == 2


def test_clipping_keeps_the_prompt_tail_and_the_response_head_and_says_so(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A response whose prompt lost its head was sampled on a context the trainer never
    sees: it keeps its place (verl's shapes), untrained; a response cut at its tail is
    a causal prefix of what was sampled, and trains."""
    result = result_of(fan_out_log(routed=(2, 2)), rules=Rules(routed_experts=(2, 2)))
    s = result.samples[-1]  # final: prompt [1, 2, 77], response [24, 7, 25, 2]
    assert any(s.loss_mask[:3])
    monkeypatch.setattr(verl_outputs, "_prompt_clips", 0)  # the first clip of the process warns
    limits = Limits(prompt_length=2, response_length=3)
    o = to_fields(s, result, limits, routing=(2, 2))
    assert o.prompt_ids == s.tokens[1:3] and o.response_ids == s.tokens[3:6]
    assert o.response_mask == [0, 0, 0] and o.response_logprobs == s.rollout_logprobs[:3]
    assert "raise rollout.prompt_length" in caplog.text
    assert (o.routed_experts == s.routed_experts.to_array()[1:6]).all()
    assert o.routed_experts.shape == (5, 2, 2)
    assert o.extra_fields["recorder_truncated"] is True
    assert o.extra_fields["recorder_clipped"] == {"prompt": 1, "response": 1}
    tail_only = to_fields(s, result, Limits(prompt_length=3, response_length=3))
    assert tail_only.response_mask == s.loss_mask[:3]
    assert tail_only.extra_fields["recorder_clipped"] == {"prompt": 0, "response": 1}


@pytest.mark.parametrize("mode", ["v1", "legacy"])
def test_infrastructure_failure(mode: str) -> None:
    outs = outputs_for(infra_failure(), mode=mode, limits=WIDE, pad_token_id=9, routing=(2, 2))  # type: ignore[arg-type]
    if mode == "v1":
        assert outs == []
        return
    (o,) = outs
    assert o.prompt_ids == [9] and o.response_ids == [9] and o.response_mask == [0]
    assert o.reward_score == 0.0 and o.extra_fields["recorder_failed"] is True
    assert o.extra_fields["recorder_reason"] == "sandbox_boot"
    assert o.routed_experts.shape == (2, 2, 2)


def test_routing_replay_without_recorder_routing_is_a_failure_not_zeros() -> None:
    result = result_of(fan_out_log())  # the recorder was not asked for routing
    assert outputs_for(result, mode="v1", limits=WIDE, pad_token_id=0, routing=(2, 2)) == []
    (o,) = outputs_for(result, mode="legacy", limits=WIDE, pad_token_id=0, routing=(2, 2))
    assert o.extra_fields["recorder_failed"] is True
    assert "routed_experts = [2, 2]" in o.extra_fields["recorder_reason"]
