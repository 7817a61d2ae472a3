"""Segments: a classified chain turned into one sample's arrays, capped and trimmed.

Part of the pure reducer (see `replay.reducer`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from replay.chains import Chain
from replay.rules import Rules
from replay.samples import Sample, SampleStatus, Segment, SegmentKind, Tensor
from replay.turns import Turn


@dataclass(slots=True, eq=False)
class BuiltSegment:
    kind: SegmentKind
    chain: Chain
    tokens: np.ndarray
    prompt_len: int
    mask: np.ndarray
    logprobs: np.ndarray
    versions: list[str]
    routed: np.ndarray | None
    truncated: list[str]
    dropped: str | None = None


def build_segment(kind: SegmentKind, c: Chain, rules: Rules) -> BuiltSegment:
    first, last = c.turns[0], c.turns[-1]
    assert first.input is not None and last.input is not None and last.output is not None
    tokens = np.concatenate([last.input, last.output])
    p = int(first.input.size)
    r = int(tokens.size) - p
    mask = np.zeros(r, dtype=np.int8)
    logprobs = np.zeros(r, dtype=np.float64)
    versions = [""] * r
    for t in c.turns[c.trained_elsewhere :]:  # the shared turns before are context here
        assert t.input is not None and t.output is not None and t.mask is not None
        s = int(t.input.size) - p
        n = int(t.output.size)
        mask[s : s + n] = t.mask
        logprobs[s : s + n] = t.logprobs
        for a, b, v in t.versions:
            versions[s + a : s + b] = [v] * (b - a)
    # Every masked token's logprob is 0, once for the whole segment: a later
    # turn overwrote an earlier one's mask and logprobs alike where they met.
    logprobs[mask != 1] = 0.0
    routed = _routed(c, tokens.size, rules) if rules.routed_experts is not None else None
    return BuiltSegment(kind, c, tokens, p, mask, logprobs, versions, routed, [])


def _routed(c: Chain, length: int, rules: Rules) -> np.ndarray:
    """(length, layers, top_k) routing; positions no attempt covered stay 0.

    An attempt's routing may cover its whole sequence (input + output, or all
    but the last output token, which is never forwarded) or only its output;
    later turns overwrite earlier rows for shared prefix positions.
    """
    assert rules.routed_experts is not None
    layers, top_k = rules.routed_experts
    buf = np.zeros((length, layers, top_k), dtype=np.int32)
    per_row = layers * top_k
    for t in c.turns:
        for start_out, n_out, arr in t.routed:
            flat = np.asarray(arr).reshape(-1)
            if flat.size % per_row:
                continue
            rows = flat.size // per_row
            if rows in (start_out + n_out, start_out + n_out - 1):
                begin = 0
            elif rows == n_out:
                begin = start_out
            else:
                continue
            buf[begin : begin + rows] = flat.reshape(rows, layers, top_k)
    return buf


def trim_to(b: BuiltSegment, budget: int, why: str) -> None:
    """Cut the tail so the segment fits `budget` tokens (tokens, mask, logprobs together)."""
    if b.tokens.size <= budget:
        return
    if b.prompt_len < budget:
        keep = budget - b.prompt_len
        b.mask = b.mask[:keep]
        b.logprobs = b.logprobs[:keep]
        b.versions = b.versions[:keep]
    else:
        # The prompt alone is over budget: keep its head, one masked response token.
        b.prompt_len = budget - 1
        b.mask = np.zeros(1, dtype=np.int8)
        b.logprobs = np.zeros(1, dtype=np.float64)
        b.versions = [""]
        why += " (prompt alone over budget: fully masked)"
    b.tokens = b.tokens[:budget]
    if b.routed is not None:
        b.routed = b.routed[:budget]
    b.truncated.append(why)


def to_sample(
    b: BuiltSegment,
    *,
    index: int,
    count: int,
    reward: float,
    status: SampleStatus,
    session_id: str,
    rollout_id: str,
    rules: Rules,
    session_meta: dict[str, Any],
    packed: bool = False,
) -> Sample:
    """The segment as a sample. `packed`: tokens, loss mask and logprobs stay
    numpy arrays (int, int8, float64) instead of lists, for a caller that only
    encodes them (`replay.packed`)."""
    c = b.chain
    last = c.turns[-1]
    meta: dict[str, Any] = {
        "segment_kind": b.kind,
        "segment_index": index,
        "segment_count": count,
        "chain_id": c.chain_id,
        "dispatch_tool_use_id": c.dispatch_id,
        "finish_reason": last.finish_reason,
        "turns": [t.turn for t in c.turns],
        # Turns this sample holds as context only: trained in the segment of the
        # branch the conversation went on with (`replay.chains`).
        "turns_trained_elsewhere": [t.turn for t in c.turns[: c.trained_elsewhere]],
        "aborts": sum(t.aborts for t in c.turns),
        "tito_masked_turns": [t.turn for t in c.turns if t.tito_masked],
        "stale_weight_masked_tokens": sum(t.stale_masked for t in c.turns),
        "nested_dropped_turns": c.nested_dropped_turns,
        "truncated": list(b.truncated),
        # No token to train (TITO-masked, stale, cut): a trainer may skip it.
        "fully_masked": not bool(b.mask.any()),
        "rules_version": rules.version,
        "rules_name": rules.name,
        "source_seqs": sorted(s for t in c.turns for s in t.seqs),
        "session": session_meta,
    }
    return Sample(
        tokens=b.tokens if packed else b.tokens.tolist(),  # type: ignore[arg-type]
        prompt_len=b.prompt_len,
        response_len=int(b.tokens.size) - b.prompt_len,
        loss_mask=b.mask if packed else b.mask.tolist(),  # type: ignore[arg-type]
        rollout_logprobs=b.logprobs if packed else b.logprobs.tolist(),  # type: ignore[arg-type]
        weight_versions=list(b.versions),
        status=status,
        reward=reward,
        rollout_id=rollout_id,
        session_id=session_id,
        metadata=meta,
        routed_experts=Tensor.from_array(b.routed) if b.routed is not None else None,
    )


def allocate_rewards(rewards_for: list[SegmentKind], reward: float, rules: Rules) -> list[float]:
    k = len(rewards_for)
    if rules.reward_mode == "copy":
        return [reward] * k
    if rules.reward_mode == "final_only":
        return [reward if kind == "final" else 0.0 for kind in rewards_for]
    return [reward / k] * k if k else []


def cap_count(built: list[BuiltSegment], cap: int | None) -> tuple[list[BuiltSegment], int]:
    if cap is None or len(built) <= cap:
        return built, 0
    kept = [*built[: cap - 1], built[-1]]
    return kept, len(built) - len(kept)


def segment_record(b: BuiltSegment) -> Segment:
    c = b.chain
    return Segment(
        kind=b.kind,
        chain_id=c.chain_id,
        turns=[t.turn for t in c.turns],
        first_seq=min(c.turns[0].seqs),
        last_seq=c.last_seq,
        total_tokens=int(b.tokens.size),
        trainable_tokens=int(b.mask.sum()),
        dispatch_tool_use_id=c.dispatch_id,
        dropped=b.dropped,
    )


def account_tokens(
    turns: Sequence[Turn],
    built: list[BuiltSegment],
    dropped: list[BuiltSegment],
    placeholder: str | None,
) -> dict[str, int]:
    """Every engine output token of the session: trained, or untrained for a stated reason.

    Keys: "engine output", "trained", then one per reason; the reasons and
    "trained" add up to "engine output" (the reducer's tests check it).
    """
    out: Counter[str] = Counter({"engine output": 0, "trained": 0})
    segment_of = {
        id(t): b for b in (*built, *dropped) for t in b.chain.turns[b.chain.trained_elsewhere :]
    }
    for t in turns:
        n = sum(r.output_ids.length for r in t.results.values())
        out["engine output"] += n
        if placeholder is not None:
            out["placeholder session"] += n
            continue
        b = segment_of.get(id(t))
        if t.unusable is not None:
            out["unusable turn"] += n
        elif b is None:
            out["in no segment (abandoned branch, nested or orphan chain)"] += n
        elif b.dropped is not None:
            out[f"{b.kind} segment left out: {b.dropped}"] += n
        else:
            _account_kept(out, t, b, n)
    return dict(sorted(out.items()))


def _account_kept(out: Counter[str], t: Turn, b: BuiltSegment, n: int) -> None:
    first = b.chain.turns[0].input
    assert t.input is not None and first is not None
    start = int(t.input.size) - int(first.size)
    kept = b.mask[start : start + n] if b.prompt_len == first.size else b.mask[:0]
    trained = int(kept.sum())
    out["trained"] += trained
    masked = int(kept.size) - trained
    if n > kept.size:
        out["truncated (segment cap or context budget)"] += n - int(kept.size)
    if masked and t.tito_masked:
        out["masked: TITO failed"] += masked
    elif masked and t.constrained:
        out["masked: constrained decoding (a grammar: json_schema, regex, ...)"] += masked
    elif masked:
        out["masked: stale weight version"] += masked
