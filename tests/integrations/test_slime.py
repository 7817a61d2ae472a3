"""The slime hook against a faithful double of slime's Sample and group step."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import numpy as np
import pytest

from recorder.integrations import slime as hook
from recorder.integrations.common import HookFailure
from recorder.rollout.driver import RolloutResult
from replay.rules import Rules
from replay.samples import check_invariants
from tests.integrations import slime_double as slime
from tests.integrations.results import fan_out_log, infra_failure, result_of


def slime_sample(index: int = 5, group_index: int = 2, **kw: Any) -> slime.Sample:
    return slime.Sample(
        index=index,
        group_index=group_index,
        prompt=[{"role": "user", "content": "fix the bug"}],
        label="inst-1",
        metadata={
            "instance_id": "inst-1",
            "repo": "/srv/repos/demo",
            "base_commit": "abc123",
            "eval_cmd": "pytest -q",
        },
        session_id="slime-router-key",
        **kw,
    )


def test_one_sample_per_segment_final_last_on_copies() -> None:
    like = slime_sample()
    before = copy.deepcopy(like)
    result = result_of(fan_out_log(), reward=1.0)
    out = hook.from_result(result, like, routing=None)

    assert like == before, "the sample slime passed in must not be mutated"
    assert [o.metadata["recorder"]["segment_kind"] for o in out] == ["subagent", "wipe", "final"]
    for o, s in zip(out, result.samples, strict=True):
        assert isinstance(o, slime.Sample) and o is not like
        assert (o.index, o.group_index, o.prompt, o.label) == (5, 2, like.prompt, "inst-1")
        assert o.session_id == "slime-router-key"
        assert o.tokens == s.tokens and o.response_length == s.response_len
        assert o.loss_mask == s.loss_mask and o.rollout_log_probs == s.rollout_logprobs
        assert len(o.tokens) == len(s.tokens) and len(o.loss_mask) == o.response_length
        assert o.status is slime.Sample.Status.COMPLETED and not o.remove_sample
        assert o.reward == pytest.approx(1.0 / 3)  # default rules: uniform reward / K
        assert o.rollout_id == 5  # slime's convention: the sample's index
        assert o.metadata["instance_id"] == "inst-1"
        assert o.metadata["recorder"]["session_id"] == "s1"
        assert o.weight_versions == ["1"]
    assert len({id(o.metadata) for o in out}) == 3, "siblings share no mutable state"


def test_explicit_rollout_id_wins_and_rewards_follow_the_rules() -> None:
    like = slime_sample(rollout_id=41)
    result = result_of(fan_out_log(), reward=1.0, rules=Rules(reward_mode="final_only"))
    out = hook.from_result(result, like, routing=None)
    assert {o.rollout_id for o in out} == {41}
    assert [o.reward for o in out] == [0.0, 0.0, 1.0]


def test_infrastructure_failure_is_one_masked_removed_sample() -> None:
    like = slime_sample()
    (out,) = hook.from_result(infra_failure("sandbox_boot"), like, routing=None)
    assert out.status is slime.Sample.Status.ABORTED and out.remove_sample
    assert out.reward == 0.0 and out.loss_mask == [0] and out.rollout_log_probs == [0.0]
    assert out.response_length == 1 and len(out.tokens) == 2
    assert out.metadata["recorder"] == {
        "failed": True,
        "reason": "sandbox_boot",
        "session_id": "broken",
    }
    assert out.metadata["instance_id"] == "inst-1" and out.index == 5
    assert like.status is slime.Sample.Status.PENDING


def test_routing_replay_rows_and_placeholders_pass_slimes_checks() -> None:
    args = slime.make_args(use_rollout_routing_replay=True, num_layers=3, moe_router_topk=2)
    routing = hook.routing_of(args)
    result = result_of(fan_out_log(routed=(3, 2)), rules=Rules(routed_experts=(3, 2)))
    out = hook.from_result(result, slime_sample(), routing=routing)
    for o, s in zip(out, result.samples, strict=True):
        assert o.rollout_routed_experts.shape == (len(o.tokens) - 1, 3, 2)
        assert (o.rollout_routed_experts == s.routed_experts.to_array()[:-1]).all()
    failed = hook.from_result(infra_failure(), slime_sample(index=6), routing=routing)
    slime.convert_to_train_data(args, [*out, *failed])  # raises on any slime check


def test_routing_replay_without_recorder_routing_aborts_with_the_fix() -> None:
    routing = (3, 2)
    (out,) = hook.from_result(result_of(fan_out_log()), slime_sample(), routing=routing)
    assert out.status is slime.Sample.Status.ABORTED
    assert "routed_experts = [3, 2]" in out.metadata["recorder"]["reason"]
    assert out.rollout_routed_experts.shape == (1, 3, 2)


def test_evaluation_returns_the_final_segment_with_the_task_reward() -> None:
    (out,) = hook.from_result(result_of(fan_out_log(), reward=1.0), slime_sample(), routing=None,
                              evaluation=True)  # fmt: skip
    assert out.metadata["recorder"]["segment_kind"] == "final" and out.reward == 1.0


def test_truncated_and_policy_failure_samples_keep_their_status() -> None:
    result = result_of(fan_out_log(), reward=0.0, outcome="failed", rules=Rules(context_length=6))
    out = hook.from_result(result, slime_sample(), routing=None)
    assert out, "a policy failure is trained"
    assert {o.status for o in out} <= {slime.Sample.Status.COMPLETED, slime.Sample.Status.TRUNCATED}
    assert any(o.status is slime.Sample.Status.TRUNCATED for o in out)
    assert all(o.reward == 0.0 and not o.remove_sample for o in out)
    for s in result.samples:
        check_invariants(s)


async def test_a_failing_rollout_does_not_sink_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """slime's plain gather over four hooks: one driver crash, one infra failure, two good."""
    outcomes: dict[int, Any] = {
        0: result_of(fan_out_log("g0")),
        1: infra_failure("recorder_unreachable"),
        2: RuntimeError("a bug in the driver"),
        3: result_of(fan_out_log("g3"), reward=0.0, outcome="failed"),
    }

    async def run_rollout(request: Any) -> RolloutResult:
        await asyncio.sleep(0.01 * (3 - request.sample_index))  # finish out of order
        got = outcomes[request.sample_index]
        if isinstance(got, Exception):
            raise got
        return got

    monkeypatch.setattr("recorder.rollout.driver.run_rollout", run_rollout, raising=False)
    args = slime.make_args(recorder_url="http://recorder.invalid:8080")
    group = [slime_sample(index=i, group_index=7) for i in range(4)]
    done = await slime.generate_and_rm_group(args, group, {"temperature": 1.0}, hook.generate)

    assert all(isinstance(g, list) for g in done), "always a list, never a bare Sample"
    flat = slime.flatten([done])
    train = slime.convert_to_train_data(args, flat)
    by_index: dict[int, list[slime.Sample]] = {}
    for s in flat:
        by_index.setdefault(s.index, []).append(s)
    assert [len(by_index[i]) for i in range(4)] == [3, 1, 1, 3]
    assert by_index[1][0].remove_sample and by_index[2][0].remove_sample
    assert "RuntimeError: a bug in the driver" in by_index[2][0].metadata["recorder"]["reason"]
    assert sum(map(sum, train["loss_masks"])) > 0, "the healthy rollouts are trained"
    assert all(s.group_index == 7 for s in flat)


async def test_generate_never_raises_on_a_bad_row_or_missing_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TR_RECORDER_URL", raising=False)
    (out,) = await hook.generate(slime.make_args(), slime_sample(), {})
    assert out.status is slime.Sample.Status.ABORTED
    assert "TR_RECORDER_URL" in out.metadata["recorder"]["reason"]

    args = slime.make_args(recorder_url="http://recorder.invalid:8080")
    bad = slime_sample()
    bad.metadata = {"eval_cmd": "pytest"}  # no repo, no base commit
    (out,) = await hook.generate(args, bad, {})
    assert out.status is slime.Sample.Status.ABORTED and out.remove_sample
    assert "TaskError" in out.metadata["recorder"]["reason"]


def test_aborted_survives_a_sample_it_cannot_copy() -> None:
    class Odd(slime.Sample):
        def __deepcopy__(self, memo: Any) -> Any:
            raise RuntimeError("no copies")

    like = Odd(index=1)
    (out,) = hook.aborted(like, "boom", routing=(2, 2))
    assert out is like and out.status is slime.Sample.Status.ABORTED and out.remove_sample
    assert np.asarray(out.rollout_routed_experts).shape == (1, 2, 2)


def test_hook_failure_without_samples_is_an_infra_failure() -> None:
    (out,) = hook.from_result(HookFailure(infra_cause="TaskError: x"), slime_sample(), routing=None)
    assert out.status is slime.Sample.Status.ABORTED


def test_reward_post_process_normalises_over_rollouts_not_segments() -> None:
    def rollout(index: int, reward: float, segments: int) -> list[slime.Sample]:
        log = fan_out_log(f"r{index}")
        out = hook.from_result(
            result_of(log, reward=reward), slime_sample(index=index), routing=None
        )
        return out[-segments:]

    group = [*rollout(0, 1.0, 3), *rollout(1, 0.0, 1), *rollout(2, 1.0, 2)]
    group += hook.from_result(infra_failure(), slime_sample(index=3), routing=None)
    raw, adv = hook.reward_post_process(slime.make_args(grpo_std_normalization=False), group)

    assert raw[:3] == pytest.approx([1 / 3] * 3) and raw[-1] == 0.0
    mean = 2 / 3  # over the three rollouts, whatever their segment counts
    assert adv[:3] == pytest.approx([1 - mean] * 3)  # every segment: its rollout's advantage
    assert adv[3] == pytest.approx(0 - mean)
    assert adv[4:6] == pytest.approx([1 - mean] * 2)
    assert adv[6] == 0.0  # the removed sample is out of the statistics

    _, scaled = hook.reward_post_process(slime.make_args(grpo_std_normalization=True), group)
    assert scaled[0] == pytest.approx((1 - mean) / ((1 / 3) ** 0.5 + 1e-6))
