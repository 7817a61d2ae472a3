"""Recorder samples -> the fields of verl's `AgentLoopOutput` (pure; verl not imported).

`recorder.integrations.verl.RecorderAgentLoop` builds `AgentLoopOutput(**fields)`
from these; keeping the conversion here lets it be tested without verl's
1.7 GB install. Per sample:

    prompt_ids        tokens[:prompt_len], left-clipped to rollout.prompt_length
    response_ids      tokens[prompt_len:], right-clipped to rollout.response_length
    response_mask     loss_mask (clipped alike); all 0 when the prompt was clipped
    response_logprobs rollout_logprobs (clipped alike)
    routed_experts    (len(prompt_ids) + len(response_ids), layers, top_k) int32, the
                      rows of the kept tokens; None when routing replay is off (with it
                      on, samples without routing are an infrastructure failure)
    reward_score      the segment's reward (legacy: the task's reward, see below)
    num_turns         2 per engine turn of the segment (the user/tool message + the answer)
    metrics           agent time as generate_sequences, eval time as compute_score
    extra_fields      recorder_session_id, recorder_rollout_id, segment_kind,
                      segment_index, segment_count, recorder_status, recorder_outcome,
                      recorder_truncated, recorder_clipped, recorder_failed,
                      reward_extra_info ({}: verl v1 copies it from the final output),
                      min_global_steps / max_global_steps: the weight versions the
                      segment was sampled with when they are step numbers, else the
                      trajectory's global step (verl's v1 trainer turns both into int
                      arrays for its staleness metrics, so None crashes its step)

Clipping: verl's legacy postprocess pads to exactly prompt_length and
response_length and crashes on anything longer; verl's own prompt cap keeps
the prompt's tail, so we do too, and keep the response's head. A clipped
sample says so (`recorder_truncated`, `recorder_clipped`). verl caps a prompt
*before* it samples; ours was sampled on the whole prompt, so a response
whose prompt lost its head (the system prompt, the task) would be trained on
a context it was never sampled on: it keeps its place in the batch, fully
masked, and a warning says to raise `rollout.prompt_length`.

Trainer modes:
- v1 (`trainer.use_v1`, verl 0.9's default): one output per segment,
  chronological, the final segment LAST: verl copies the last output's reward
  to every output of the trajectory, so that one carries the task's reward
  (whatever the rules' reward_mode split). verl's GRPO also reads the whole
  trajectory's advantage off the last output's first trainable token: a fully
  masked final segment (TITO-masked, or clipped) would give every segment
  advantage 0, so then the last segment that trains anything goes last. An
  infrastructure failure is `[]` (verl drops the trajectory and keeps the
  group).
- legacy: exactly one output, the final segment (pick `collapse-final` rules
  on the recorder so the other segments are not built at all), with the
  task's reward; `recorder_dropped_segments` counts what was left out. An
  infrastructure failure is one fully masked output with reward 0 and
  `recorder_failed = True`.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import msgspec
import numpy as np

from recorder.integrations.common import (
    RolloutOutcome,
    Routing,
    describe_failure,
    is_infra_failure,
    routing_problem,
)
from replay.samples import Sample

log = logging.getLogger("recorder.integrations.verl")

Mode = Literal["v1", "legacy"]


class OutputFields(msgspec.Struct, kw_only=True):
    """Keyword arguments of verl's `AgentLoopOutput`."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    routed_experts: Any = None  # np.ndarray (length, layers, top_k) int32
    reward_score: float
    num_turns: int
    metrics: dict[str, float]
    extra_fields: dict[str, Any]


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    prompt_length: int
    response_length: int


def _metrics(result: RolloutOutcome) -> dict[str, float]:
    t = result.timings
    return {
        "generate_sequences": float(t.get("agent_s", 0.0)),
        "tool_calls": 0.0,
        "compute_score": float(t.get("eval_s", 0.0)),
        "num_preempted": -1,
    }


def to_fields(
    s: Sample,
    result: RolloutOutcome,
    limits: Limits,
    *,
    reward: float | None = None,
    routing: Routing | None = None,
    global_steps: int | None = None,
) -> OutputFields:
    """One recorder sample as AgentLoopOutput fields, clipped to verl's lengths."""
    p0 = max(0, s.prompt_len - limits.prompt_length)
    keep = min(s.response_len, limits.response_length)
    prompt = s.tokens[p0 : s.prompt_len]
    response = s.tokens[s.prompt_len : s.prompt_len + keep]
    clipped = {"prompt": p0, "response": s.response_len - keep}
    if p0:
        _warn_prompt_clipped(s.prompt_len, limits.prompt_length)
    experts = None
    if routing is not None:
        if s.routed_experts is not None:
            experts = s.routed_experts.to_array()[p0 : s.prompt_len + keep].astype(np.int32)
        else:
            experts = np.zeros((len(prompt) + len(response), *routing), dtype=np.int32)
    meta = s.metadata
    return OutputFields(
        prompt_ids=list(prompt),
        response_ids=list(response),
        response_mask=[0] * keep if p0 else list(s.loss_mask[:keep]),
        response_logprobs=list(s.rollout_logprobs[:keep]),
        routed_experts=experts,
        reward_score=float(s.reward if reward is None else reward),
        num_turns=2 * len(meta.get("turns") or [None]),
        metrics=_metrics(result),
        extra_fields={
            "recorder_session_id": s.session_id,
            "recorder_rollout_id": s.rollout_id,
            "segment_kind": meta.get("segment_kind"),
            "segment_index": meta.get("segment_index"),
            "segment_count": meta.get("segment_count"),
            "recorder_status": s.status,
            "recorder_outcome": result.outcome,
            "recorder_truncated": s.status == "truncated" or any(clipped.values()),
            "recorder_clipped": clipped,
            "recorder_failed": False,
            "reward_extra_info": {},
            **_steps(s.weight_versions, global_steps),
        },
    )


_prompt_clips = 0


def _warn_prompt_clipped(prompt_len: int, prompt_length: int) -> None:
    """Say so at the first clipped prompt and every 100th after (a batch has many)."""
    global _prompt_clips
    _prompt_clips += 1
    if _prompt_clips % 100 == 1:
        log.warning(
            "a %d-token prompt is longer than rollout.prompt_length=%d: its response is left "
            "untrained (masked), since it was sampled on the whole prompt (%d such so far); "
            "raise rollout.prompt_length to the agent's context length",
            prompt_len,
            prompt_length,
            _prompt_clips,
        )


def _steps(versions: list[str], global_steps: int | None) -> dict[str, int | None]:
    """verl's min/max_global_steps: the sampled weight versions if they are step numbers
    (the trainer names each weight update by its step), else the trajectory's step."""
    try:
        steps = [int(v) for v in dict.fromkeys(versions) if v]
    except ValueError:
        steps = []
    if not steps:
        return {"min_global_steps": global_steps, "max_global_steps": global_steps}
    return {"min_global_steps": min(steps), "max_global_steps": max(steps)}


def failed_fields(
    reason: str,
    *,
    pad_token_id: int,
    routing: Routing | None = None,
    session_id: str | None = None,
    global_steps: int | None = None,
) -> OutputFields:
    """Legacy trainer's placeholder: one pad prompt token, one masked pad response token."""
    return OutputFields(
        prompt_ids=[pad_token_id],
        response_ids=[pad_token_id],
        response_mask=[0],
        response_logprobs=[0.0],
        routed_experts=None if routing is None else np.zeros((2, *routing), dtype=np.int32),
        reward_score=0.0,
        num_turns=0,
        metrics={"generate_sequences": 0.0, "tool_calls": 0.0, "compute_score": 0.0},
        extra_fields={
            "recorder_session_id": session_id,
            "recorder_rollout_id": None,
            "segment_kind": None,
            "segment_index": None,
            "segment_count": None,
            "recorder_status": "aborted",
            "recorder_outcome": "infra_error",
            "recorder_truncated": False,
            "recorder_clipped": {"prompt": 0, "response": 0},
            "recorder_failed": True,
            "recorder_reason": reason,
            "reward_extra_info": {},
            **_steps([], global_steps),
        },
    )


def outputs_for(
    result: RolloutOutcome,
    *,
    mode: Mode,
    limits: Limits,
    pad_token_id: int,
    routing: Routing | None = None,
    global_steps: int | None = None,
) -> list[OutputFields]:
    """The outputs verl gets for one rollout: v1 a list (final last), legacy exactly one."""
    problem = routing_problem(result.samples, routing)
    if is_infra_failure(result) or problem is not None:
        if mode == "v1":
            return []
        reason = problem or describe_failure(result)
        return [
            failed_fields(
                reason,
                pad_token_id=pad_token_id,
                routing=routing,
                session_id=result.session_id,
                global_steps=global_steps,
            )
        ]
    if mode == "v1":
        outs = [
            to_fields(s, result, limits, routing=routing, global_steps=global_steps)
            for s in result.samples
        ]
        return _advantage_carrier_last(outs, result.reward)
    final = to_fields(
        result.samples[-1], result, limits, reward=result.reward, routing=routing,
        global_steps=global_steps,
    )  # fmt: skip
    final.extra_fields["recorder_dropped_segments"] = len(result.samples) - 1
    return [final]


def _advantage_carrier_last(outs: list[OutputFields], reward: float) -> list[OutputFields]:
    """v1's list with a trainable output last, carrying the task's reward (module doc)."""
    if not any(outs[-1].response_mask):
        carriers = [o for o in outs if any(o.response_mask)]
        if carriers:
            outs.remove(carriers[-1])
            outs.append(carriers[-1])
    outs[-1].reward_score = float(reward)
    return outs
