"""Failure placeholders: a failed session still yields a list of samples.

Seeds 000 and 001: one bad trajectory must not take down a batch. A failed
session therefore returns the same list shape as a healthy one (one sample
per segment, or one), each ABORTED, reward 0, fully masked, and with MoE
routing replay on, `routed_experts` zeros of shape (length, layers, top_k) so
the trainer's per-sample stack never mixes None with tensors. If building
those fails too, `minimal_sample` needs nothing but a pad id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from replay.samples import Sample, Tensor


def zero_routed_experts(length: int, routed_experts: tuple[int, int] | None) -> Tensor | None:
    if routed_experts is None:
        return None
    layers, top_k = routed_experts
    return Tensor(shape=(length, layers, top_k), data=bytes(4 * length * layers * top_k))


def masked_copy(sample: Sample, *, reason: str, routed_experts: tuple[int, int] | None) -> Sample:
    """The same tokens, fully masked: status aborted, reward 0."""
    n = sample.response_len
    return Sample(
        tokens=list(sample.tokens),
        prompt_len=sample.prompt_len,
        response_len=n,
        loss_mask=[0] * n,
        rollout_logprobs=[0.0] * n,
        weight_versions=list(sample.weight_versions),
        status="aborted",
        reward=0.0,
        rollout_id=sample.rollout_id,
        session_id=sample.session_id,
        metadata={**sample.metadata, "placeholder": reason, "fully_masked": True},
        routed_experts=zero_routed_experts(len(sample.tokens), routed_experts),
    )


def minimal_sample(
    pad_token_id: int,
    *,
    session_id: str = "",
    rollout_id: str = "",
    reason: str = "",
    routed_experts: tuple[int, int] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Sample:
    """Last resort: one pad prompt token, one masked pad response token."""
    try:
        experts = zero_routed_experts(2, routed_experts)
    except Exception:
        experts = None
    return Sample(
        tokens=[pad_token_id, pad_token_id],
        prompt_len=1,
        response_len=1,
        loss_mask=[0],
        rollout_logprobs=[0.0],
        weight_versions=[""],
        status="aborted",
        reward=0.0,
        rollout_id=rollout_id,
        session_id=session_id,
        metadata={**(metadata or {}), "placeholder": reason or "failed", "fully_masked": True},
        routed_experts=experts,
    )


def placeholders_for(
    built: Sequence[Sample],
    *,
    pad_token_id: int,
    session_id: str,
    rollout_id: str,
    reason: str,
    routed_experts: tuple[int, int] | None,
    metadata: dict[str, Any] | None = None,
) -> list[Sample]:
    """Placeholders shaped like `built` (or one minimal sample if there are none).

    Never raises: each layer falls back to the next.
    """
    try:
        if built:
            return [masked_copy(s, reason=reason, routed_experts=routed_experts) for s in built]
    except Exception:
        pass
    try:
        return [
            minimal_sample(
                pad_token_id,
                session_id=session_id,
                rollout_id=rollout_id,
                reason=reason,
                routed_experts=routed_experts,
                metadata=metadata,
            )
        ]
    except Exception:
        # Keep the routing shape: a trainer stacking MoE routing must never see None.
        return [
            minimal_sample(
                0,
                session_id=str(session_id),
                rollout_id=str(rollout_id),
                reason="placeholder build failed",
                routed_experts=routed_experts,
            )
        ]
