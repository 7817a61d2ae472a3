"""slime hook: `--custom-generate-function-path recorder.integrations.slime.generate`.

slime's `generate_and_rm` calls `generate(args, sample, sampling_params,
evaluation)` once per sample; we run one recorded rollout (a new session every
call, so a retried sample never reuses a closed one) and hand back
`list[Sample]`, one per segment, chronological, the final segment last:

    tokens, response_length, loss_mask, rollout_log_probs  from the recorder's sample
    reward             the segment's reward as the recorder's rules allocated it
                       (pre-filled, so slime skips its reward model)
    status             type(sample).Status[status.upper()]
    rollout_id         one non-None int shared by every sibling (slime's
                       sample.rollout_id, else sample.index): slime asserts it
    rollout_routed_experts  (len(tokens) - 1, num_layers, top_k) when
                       args.use_rollout_routing_replay (slime's own row count)
    index, group_index, prompt, label  kept: each output is a deep copy of the input
    metadata           the row's metadata + "recorder": session id, segment kind, outcome

slime is not importable here (not on PyPI): samples are copies of the one slime
passed in and the status enum is `type(sample).Status`.

Never raises: slime's group step gathers without `return_exceptions`, so one
exception would sink every rollout of the step. Any infrastructure failure
(and a bad row or setting) returns `[sample]` ABORTED with `remove_sample=True`,
reward 0, a fully masked one-token response and the reason in
`metadata["recorder"]["reason"]`; the list shape is always a list.

Fan-out and GRPO: slime's default reward normalisation reshapes the rewards
by `n_samples_per_prompt`; with a varying number of segments per rollout that
reshape fails and everything collapses into one group. Pass
`--custom-reward-post-process-path recorder.integrations.slime.reward_post_process`:
it normalises per prompt (`group_index`) over rollouts (`rollout_id`), not
over segments, and gives every segment its rollout's advantage.

`evaluation=True` returns only the final segment, with the task's reward, so
eval metrics count each prompt once.

The engine is the recorder's (`recorder serve --engine`): point it at slime's
SGLang router (fixed `--sglang-router-ip/--sglang-router-port`); the hook
records the router's address in the session's metadata.

Settings: `args.recorder_url` / `args.recorder_<name>` (set by a custom
argument or by `--custom-config-path`), else the `TR_*` environment variable
(see `recorder.integrations.common`; pass them to Ray workers in the job's
runtime_env).
"""

from __future__ import annotations

import copy
import hashlib
import logging
from typing import Any

import numpy as np

from recorder.integrations.common import (
    HookSettings,
    RolloutOutcome,
    Routing,
    describe_failure,
    is_infra_failure,
    resolve_settings,
    routing_problem,
    run_one,
    task_row,
)
from replay.samples import Sample

log = logging.getLogger(__name__)


def slime_settings(args: Any) -> HookSettings:
    """`args.recorder_url`, `args.recorder_<name>` for the others, else `TR_<NAME>`."""

    def explicit(name: str) -> Any:
        return getattr(args, name if name.startswith("recorder_") else f"recorder_{name}", None)

    return resolve_settings(explicit, where="args")


def routing_of(args: Any) -> Routing | None:
    """(num_layers, top_k) when slime replays MoE routing (R3), else None."""
    if not getattr(args, "use_rollout_routing_replay", False):
        return None
    return int(args.num_layers), int(args.moe_router_topk)


def rollout_id_for(like: Any, session_id: str | None) -> int:
    """The id every sibling shares: slime's own rollout_id, else its index, else the session's."""
    for value in (getattr(like, "rollout_id", None), getattr(like, "index", None)):
        if value is not None:
            return int(value)
    digest = hashlib.blake2b((session_id or "").encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def filler_experts(rows: int, routing: Routing) -> np.ndarray:
    """Routing rows for masked placeholder tokens: experts 0..top_k-1 on every layer.

    Not zeros: slime refuses an all-zero capture for a layer when top_k > 1.
    """
    layers, top_k = routing
    return np.tile(np.arange(top_k, dtype=np.int32), (rows, layers, 1))


def _experts(s: Sample, routing: Routing) -> np.ndarray:
    """slime wants one row per token fed to the model: len(tokens) - 1 rows."""
    rows = len(s.tokens) - 1
    if s.status in ("aborted", "failed") or s.routed_experts is None:
        return filler_experts(rows, routing)
    return np.array(s.routed_experts.to_array()[:rows], dtype=np.int32)


def _versions(s: Sample) -> list[str]:
    """slime keeps one weight version per generate call: the distinct ones, in order."""
    return list(dict.fromkeys(v for v in s.weight_versions if v))


def to_slime(
    s: Sample,
    like: Any,
    *,
    rollout_id: int,
    routing: Routing | None,
    reward: float | None = None,
    recorder: dict[str, Any] | None = None,
) -> Any:
    """One recorder sample as a copy of slime's `like` (pure: `like` is not touched)."""
    out = copy.deepcopy(like)
    out.tokens = list(s.tokens)
    out.response_length = s.response_len
    out.loss_mask = list(s.loss_mask)
    out.rollout_log_probs = list(s.rollout_logprobs)
    out.reward = s.reward if reward is None else reward
    out.status = type(like).Status[s.status.upper()]
    out.rollout_id = rollout_id
    out.remove_sample = s.status in ("aborted", "failed")
    out.weight_versions = _versions(s)
    if routing is not None:
        out.rollout_routed_experts = _experts(s, routing)
    meta = s.metadata
    out.metadata = {
        **(getattr(like, "metadata", None) or {}),
        "recorder": {
            **(recorder or {}),
            "session_id": s.session_id,
            "segment_kind": meta.get("segment_kind"),
            "segment_index": meta.get("segment_index"),
            "segment_count": meta.get("segment_count"),
            "status": s.status,
            "truncated": bool(meta.get("truncated")),
        },
    }
    return out


def aborted(
    like: Any, reason: str, *, routing: Routing | None = None, session_id: str | None = None
) -> list[Any]:
    """`[sample]` ABORTED, remove_sample, reward 0, one masked pad token. Never raises."""
    try:
        out = copy.deepcopy(like)
    except Exception:
        out = like
    fields: dict[str, Any] = {
        "tokens": [0, 0],
        "response": "",
        "response_length": 1,
        "loss_mask": [0],
        "rollout_log_probs": [0.0],
        "reward": 0.0,
        "remove_sample": True,
    }
    try:
        fields["status"] = type(like).Status.ABORTED
        fields["rollout_id"] = rollout_id_for(like, session_id)
        if routing is not None:
            fields["rollout_routed_experts"] = filler_experts(1, routing)
        fields["metadata"] = {
            **(getattr(like, "metadata", None) or {}),
            "recorder": {"failed": True, "reason": reason, "session_id": session_id},
        }
    except Exception:
        log.exception("recorder: building the aborted sample's extras failed")
    for name, value in fields.items():
        try:
            setattr(out, name, value)
        except Exception:
            log.exception("recorder: could not set %s on the aborted sample", name)
    log.warning("recorder: rollout aborted (%s)", reason)
    return [out]


def from_result(
    result: RolloutOutcome, like: Any, *, routing: Routing | None, evaluation: bool = False
) -> list[Any]:
    """slime samples for one rollout: one per segment, final last (pure)."""
    if is_infra_failure(result):
        return aborted(
            like, describe_failure(result), routing=routing, session_id=result.session_id
        )
    problem = routing_problem(result.samples, routing)
    if problem is not None:
        return aborted(like, problem, routing=routing, session_id=result.session_id)
    rid = rollout_id_for(like, result.session_id)
    recorder = {"outcome": result.outcome, "task_reward": result.reward, "turns": result.turns}
    if evaluation:
        final = result.samples[-1]
        return [to_slime(final, like, rollout_id=rid, routing=routing, reward=result.reward,
                         recorder=recorder)]  # fmt: skip
    return [
        to_slime(s, like, rollout_id=rid, routing=routing, recorder=recorder)
        for s in result.samples
    ]


def _engine_of(args: Any) -> str | None:
    """slime's router: `recorder serve --engine` must point at it (recorded for the log)."""
    ip, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
    return f"http://{ip}:{port}" if ip and port else None


def _index(value: Any) -> int:
    return int(value) if value is not None else 0


async def generate(
    args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Any]:
    """slime's custom generate: one recorded rollout -> `list[Sample]`. Never raises."""
    routing: Routing | None = None
    try:
        routing = routing_of(args)
        settings = slime_settings(args)
        row = task_row(sample.metadata, prompt=sample.prompt, label=sample.label)
        metadata = {
            "trainer": "slime",
            "evaluation": evaluation,
            "slime_index": sample.index,
            "slime_engine": _engine_of(args),
            "rollout_id": str(rollout_id_for(sample, None))
            if sample.rollout_id is not None or sample.index is not None
            else None,
        }
        result = await run_one(
            settings,
            row,
            sample_index=_index(sample.index),
            group_index=_index(sample.group_index),
            sampling=sampling_params,
            session_metadata={k: v for k, v in metadata.items() if v is not None},
        )
        return from_result(result, sample, routing=routing, evaluation=evaluation)
    except Exception as exc:  # a hook must never raise into slime's gather
        return aborted(sample, f"{type(exc).__name__}: {exc}"[:500], routing=routing)


def _trajectory_reward(s: Any) -> float:
    rec = (getattr(s, "metadata", None) or {}).get("recorder") or {}
    value = rec.get("task_reward", s.reward)
    return float(value or 0.0)


def reward_post_process(args: Any, samples: list[Any]) -> tuple[list[float], list[float]]:
    """slime's `--custom-reward-post-process-path` for fan-out: (raw, normalised) per sample.

    Statistics are taken per prompt (`group_index`) over ROLLOUTS (one value per
    `rollout_id`: the task's reward), so a rollout with K segments counts once;
    removed samples (infrastructure failures) are left out of them and get 0.
    Like slime's default: centred, and divided by the std when
    `args.grpo_std_normalization`; raw rewards pass through when
    `args.rewards_normalization` is off.
    """
    raw = [float(s.reward or 0.0) for s in samples]
    if not getattr(args, "rewards_normalization", True):
        return raw, raw
    use_std = bool(getattr(args, "grpo_std_normalization", True))
    rollouts: dict[Any, dict[Any, float]] = {}
    for s in samples:
        if not s.remove_sample:
            rollouts.setdefault(s.group_index, {})[s.rollout_id] = _trajectory_reward(s)
    advantage: dict[tuple[Any, Any], float] = {}
    for group, values in rollouts.items():
        xs = list(values.values())
        mean = sum(xs) / len(xs)
        std = (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
        for rid, x in values.items():
            advantage[(group, rid)] = (x - mean) / (std + 1e-6) if use_std else x - mean
    normalised = [
        0.0 if s.remove_sample else advantage[(s.group_index, s.rollout_id)] for s in samples
    ]
    return raw, normalised
