"""A faithful test double of the parts of slime the hook meets (slime is not on PyPI).

Read from THUDM/slime at 624b824 (Aug 2026):
- `Sample` and `Sample.Status`: slime/utils/types.py (same field names, types
  and defaults for every field the hook or the checks below touch);
- `generate_and_rm` / `generate_and_rm_group`: slime/rollout/sglang_rollout.py
  (a custom generate is awaited inside a plain `asyncio.gather` with no
  `return_exceptions`; a list containing an ABORTED sample skips the reward
  model; otherwise samples whose reward is None go to it);
- `validate_rollout_id_annotated` and the flatten step:
  slime/observability/rollout_data_utils.py, slime/ray/rollout.py
  (`_get_rollout_data`): a list of siblings needs one non-None rollout_id;
- `convert_to_train_data`: the length checks and the `remove_sample` masking
  of slime/ray/rollout.py `_convert_samples_to_train_data`, the routed-experts
  checks of `validate_rollout_routed_experts_for_replay` and
  `prepare_routed_experts_for_routing_replay` (len(tokens) - 1 rows).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Any

import numpy as np


@dataclass
class Sample:
    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    session_id: str | None = None


def make_args(**overrides: Any) -> SimpleNamespace:
    """The `args` fields slime's rollout path reads, with slime's defaults."""
    base = {
        "group_rm": False,
        "partial_rollout": False,
        "use_rollout_routing_replay": False,
        "num_layers": 4,
        "moe_router_topk": 2,
        "reward_key": None,
    }
    return SimpleNamespace(**{**base, **overrides})


async def reward_model(args: Any, sample: Sample) -> float:
    """slime's rule-based RM stand-in; the hook pre-fills rewards, so reaching it is a bug."""
    raise AssertionError(
        f"reward model called for sample {sample.index}: reward was not pre-filled"
    )


async def generate_and_rm(args: Any, sample: Sample, sampling_params: dict, generate: Any) -> Any:
    sample = await generate(args, sample, sampling_params, evaluation=False)
    if args.group_rm:
        return sample
    if isinstance(sample, list):
        if any(s.status == Sample.Status.ABORTED for s in sample):
            return sample
        for s in sample:
            if s.reward is None:
                s.reward = await reward_model(args, s)
        return sample
    if sample.status == Sample.Status.ABORTED:
        return sample
    if sample.reward is None:
        sample.reward = await reward_model(args, sample)
    return sample


async def generate_and_rm_group(
    args: Any, group: list[Sample], sampling_params: dict, generate: Any
) -> list[Any]:
    """A plain gather: one exception sinks the whole group (and slime's rollout step)."""
    tasks = [
        asyncio.create_task(generate_and_rm(args, s, dict(sampling_params), generate))
        for s in group
    ]
    return list(await asyncio.gather(*tasks))


def validate_rollout_id_annotated(node: Any, depth: int = 0) -> None:
    if isinstance(node, Sample):
        return
    assert isinstance(node, list), f"unexpected rollout output node type: {type(node).__name__}"
    if node and isinstance(node[0], Sample):
        if depth >= 2 and len(node) > 1:
            rids = [s.rollout_id for s in node]
            missing = [i for i, r in enumerate(rids) if r is None]
            assert not missing, f"rollout_id unset on positions {missing}"
            assert len(set(rids)) == 1, f"siblings must share rollout_id; got {rids}"
        return
    for item in node:
        validate_rollout_id_annotated(item, depth + 1)


def flatten(data: list[Any]) -> list[Sample]:
    """`_get_rollout_data`: validate, then flatten while the first element is a list."""
    validate_rollout_id_annotated(data)
    while isinstance(data[0], list):
        data = list(itertools.chain.from_iterable(data))
    return data


def convert_to_train_data(args: Any, samples: list[Sample]) -> dict[str, Any]:
    for s in samples:
        assert isinstance(s, Sample), f"a {type(s).__name__} reached train data (mixed shapes)"
        assert s.reward is not None, "a sample reached training without a reward"
    rollout_ids = [s.rollout_id for s in samples]
    loss_masks = []
    for s in samples:
        if s.loss_mask is None:
            s.loss_mask = [1] * s.response_length
        assert len(s.loss_mask) == s.response_length, (
            f"loss mask length {len(s.loss_mask)} != response length {s.response_length}"
        )
        if s.remove_sample:
            s.loss_mask = [0] * s.response_length
        loss_masks.append(s.loss_mask)
        if s.rollout_log_probs is not None:
            assert len(s.rollout_log_probs) == s.response_length
        assert len(s.tokens) > s.response_length
    data: dict[str, Any] = {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": [s.reward for s in samples],
        "truncated": [1 if s.status == Sample.Status.TRUNCATED else 0 for s in samples],
        "rollout_ids": rollout_ids,
        "loss_masks": loss_masks,
    }
    if samples[0].rollout_routed_experts is not None:
        layers, top_k = int(args.num_layers), int(args.moe_router_topk)
        for i, s in enumerate(samples):
            experts = np.asarray(s.rollout_routed_experts)
            assert experts.ndim == 3 and experts.shape[1:] == (layers, top_k), experts.shape
            assert experts.shape[0] > 0, f"R3 sample {i} has no rows"
            assert experts.shape[0] == len(s.tokens) - 1, (experts.shape, len(s.tokens))
            if top_k > 1:
                zero = [n for n in range(layers) if not np.count_nonzero(experts[:, n, :])]
                assert not zero, f"R3 capture all zero for layers {zero} in sample {i}"
        data["rollout_routed_experts"] = [s.rollout_routed_experts for s in samples]
    return data
