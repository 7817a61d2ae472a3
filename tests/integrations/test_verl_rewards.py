"""What verl's own v1 trainer code does with the outputs for a rollout (marker `verl`).

Three ways the trainer learned something other than what was recorded, found in
an audit and checked against verl 0.9.1's real code:

- v1 tags: verl's v1 trainer turns every trajectory's `min/max_global_steps` tag
  into an int array (`trainer_base._compute_metrics`); the hook set none, so a
  step could not finish.
- v1 rewards: verl copies the LAST output's reward to the whole trajectory, so
  under the default rules (reward split uniformly over K segments) a passing
  rollout with a compaction was worth 1/K.
- v1 advantages: verl's GRPO reads a trajectory's advantage off the last output's
  first trainable token; a fully masked final segment gave every segment of a
  passing rollout advantage 0.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from recorder.integrations.verl_outputs import Limits, outputs_for
from replay.rules import Rules
from tests.integrations.results import fan_out_log, result_of
from tests.integrations.test_verl import (  # noqa: F401 (fixtures)
    ROW,
    rollouts,
    tokenizer,
    trajectory,
    v1_worker,
    verl,
)
from tests.replay.builders import Log

pytestmark = pytest.mark.verl
WIDE = Limits(prompt_length=64, response_length=64)
SUB = "sys-sub"


async def test_v1_tags_carry_the_weight_versions_verls_trainer_reads(
    verl: Any,  # noqa: F811
    tokenizer: Any,  # noqa: F811
    rollouts: dict[int, Any],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w, put = v1_worker(verl, tokenizer, monkeypatch)
    rollouts[3] = result_of(fan_out_log("v1"), reward=1.0)
    await w._run_agent_loop(
        {}, trajectory(0), agent_name="recorder", session_id=0, uid="u-3", global_steps=7, **ROW
    )
    (call,) = put
    # verl/trainer/ppo/v1/trainer_base.py, _compute_metrics:
    lo = np.array([tag["min_global_steps"] for tag in call["tags"]], dtype=int)
    hi = np.array([tag["max_global_steps"] for tag in call["tags"]], dtype=int)
    # The recorded weight version ("1" in these logs) is a step number: it, not the
    # trajectory's step (7), says what the tokens were sampled with.
    assert lo.tolist() == hi.tolist() == [1, 1, 1]


@pytest.mark.parametrize(
    ("versions", "want"), [(["3", "4"], (3, 4)), (["default"], (9, 9)), ([""], (9, 9))]
)
def test_v1_steps_are_the_sampled_weight_versions_else_the_trajectorys(
    versions: list[str], want: tuple[int, int]
) -> None:
    result = result_of(fan_out_log("steps"), reward=1.0)
    samples = [
        msgspec.structs.replace(s, weight_versions=[*versions, *versions[-1:] * s.response_len][: s.response_len])
        for s in result.samples
    ]  # fmt: skip
    result = msgspec.structs.replace(result, samples=samples)
    outs = outputs_for(result, mode="v1", limits=WIDE, pad_token_id=0, global_steps=9)
    for o in outs:
        assert (o.extra_fields["min_global_steps"], o.extra_fields["max_global_steps"]) == want


def test_v1_last_output_carries_the_task_reward_whatever_the_split() -> None:
    three = result_of(fan_out_log("three-segments"), reward=1.0)  # default: uniform, 1/3 each
    log = Log("one-segment").open()
    log.turn([1, 2, 3], [10, 2])
    one = result_of(log, reward=1.0)
    assert three.samples[-1].reward == pytest.approx(1 / 3)
    r3 = outputs_for(three, mode="v1", limits=WIDE, pad_token_id=0)[-1].reward_score
    r1 = outputs_for(one, mode="v1", limits=WIDE, pad_token_id=0)[-1].reward_score
    assert r3 == r1 == 1.0


def _rollout(sid: str, *, final_tito_ok: bool, reward: float) -> Any:
    """A subagent and a main line; the main line's turns fail TITO when asked."""
    log = Log(sid).open()
    m = log.turn([1, 2, 3], [30], tool_uses=[("ag", "Agent")], tito_ok=final_tito_ok)
    s = log.turn([50, 51], [60, 61], system=SUB)
    log.turn(s.then([52]), [62, 2], system=SUB)
    log.turn(m.then([8]), [33, 2], tool_results=["ag"], tito_ok=final_tito_ok)
    return result_of(log, reward=reward, rules=Rules(reward_mode="copy"))


def test_v1_a_fully_masked_final_does_not_zero_the_rollouts_advantage() -> None:
    torch = pytest.importorskip("torch")
    from verl import DataProto
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    width, rows, keys = 8, [], []
    for session, (ok, reward) in enumerate([(False, 1.0), (True, 0.0)]):
        outs = outputs_for(
            _rollout(f"s{session}", final_tito_ok=ok, reward=reward),
            mode="v1", limits=Limits(prompt_length=16, response_length=width), pad_token_id=0,
        )  # fmt: skip
        kinds = [o.extra_fields["segment_kind"] for o in outs]
        # A fully masked final goes first: the trainable subagent is last, with the reward.
        assert kinds == (["subagent", "final"] if ok else ["final", "subagent"])
        assert outs[-1].reward_score == reward and any(outs[-1].response_mask)
        for i, o in enumerate(outs):
            rows.append((o.response_mask, outs[-1].reward_score))  # verl copies the last's
            keys.append(f"uid0_{session}_{i}")
    mask = torch.zeros(len(rows), width)
    scores = torch.zeros(len(rows), width)
    for r, (m, reward) in enumerate(rows):
        mask[r, : len(m)] = torch.tensor(m, dtype=torch.float32)
        scores[r, len(m) - 1] = reward
    data = DataProto.from_dict(
        tensors={"response_mask": mask, "token_level_rewards": scores},
        non_tensors={"uid": np.array(["uid0"] * len(rows), dtype=object)},
    )
    adv = compute_advantage_for_multi_trajectories(
        data, batch_keys=keys, adv_estimator=AdvantageEstimator.GRPO, num_repeat=2
    ).batch["advantages"]
    passed_sub = keys.index("uid0_0_1")  # the passing rollout's subagent
    assert adv[passed_sub][mask[passed_sub].bool()].min() > 0
    failed_trained = [i for i, k in enumerate(keys) if k.startswith("uid0_1_")]
    assert all(adv[i][mask[i].bool()].max() < 0 for i in failed_trained if mask[i].any())
