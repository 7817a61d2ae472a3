"""The deterministic reducer: one session's events -> segments -> samples.

Pure: no I/O, no clock, no randomness, no dict-order or hash-seed dependence;
the same events, arrays and rules give byte-identical `SessionResult`s. Token
arrays arrive preloaded, keyed by `ArrayRef.digest` (see `replay.load`).

How a session is read (see DESIGN.md "Chains, segments, samples"):
- Only events from the LAST `SessionOpened` on count: a retried session starts
  clean (seed 003).
- Events are grouped into turns by (turn, request_id). A turn is usable when
  its full input, every attempt's output ids and logprobs are present and
  consistent, it did not end in an abort, and it did not fail. Missing
  logprobs make a turn unusable: text is never re-tokenized (seed 003).
- Chains are found from the tokens alone: a turn extends the chain whose full
  sequence (last input + last output) is the longest prefix of its input.
- A new chain is main line when its system digest matches the main line's.
  A foreign system digest while an Agent/Task dispatch from the main line is
  pending makes it that dispatch's subagent (oldest unassigned dispatch
  first; a later chain with the same system digest continues the same
  dispatch). The dispatch ends when a main-line request carries its
  tool_result.
- Nested subagents (a dispatch from inside a subagent) are fail-safe: while
  such a dispatch is pending, new foreign chains are DROPPED with their turns
  (never folded into another chain's tokens, never a segment of their own);
  the enclosing subagent's sample records how many turns were dropped.
- A foreign chain with no pending dispatch follows `rules.orphan_chains`.
- A background agent's dispatch whose tool_result came back before any
  subagent request ("Async agent launched") is still claimed by the next
  subagent chain. A subagent sharing the main system prompt is linked by the
  live decision (the recorder matched its dispatch's prompt in the body).
- A new chain whose request offers no tools and has its own system prompt is
  a `side` request (title, classification): its own segment kind, left out
  unless `rules.side_requests = "train"`, never `final`. The main line's
  system prompt is that of the first request that offers tools.
- A fork is not a fork when the request re-sends the chain's last input
  with more user text but not its answer (a compaction summary after a tool
  result): a chain beside it. A re-sent first request of a side chain, or of
  a subagent while a dispatch waits, is another conversation, not a retry.
- Main-line chains: the one holding the last main-line turn is `final`, every
  other one was replaced by a non-extending request (compaction): `wipe`.
  Segments are ordered by completion (last event), `final` last. The
  segment cap never drops `final` (it is truncated); `token_accounting`
  says where every engine output token went.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from recorder.log.events import GenerateResult, RecordedEvent, SessionOpened
from replay.chains import ChainBuilder, classify_chains, main_system_digest
from replay.packed import unpacked_sample
from replay.placeholders import placeholders_for
from replay.rules import Rules
from replay.samples import Sample, SampleStatus, SessionResult
from replay.segments import (
    BuiltSegment,
    account_tokens,
    allocate_rewards,
    build_segment,
    cap_count,
    segment_record,
    to_sample,
    trim_to,
)
from replay.turns import (
    IdChecks,
    SessionFacts,
    collect_session,
    prepare_turn,
    session_logprobs,
)


def _pad_id(opened: SessionOpened | None, rules: Rules) -> int:
    if rules.pad_token_id is not None:
        return rules.pad_token_id
    tok = opened.tokenizer if opened is not None else None
    if tok is not None and tok.pad_token_id is not None:
        return int(tok.pad_token_id)
    if tok is not None and tok.eos_token_ids:
        return int(tok.eos_token_ids[0])
    return 0


def _rollout_id(session_id: str, opened: SessionOpened | None) -> str:
    if opened is not None and opened.metadata.get("rollout_id") is not None:
        return str(opened.metadata["rollout_id"])
    return session_id


def _reduce(
    events: Sequence[RecordedEvent],
    arrays: Mapping[bytes, np.ndarray],
    rules: Rules,
    packed: bool = False,
) -> SessionResult:
    s = collect_session(events)
    builder = ChainBuilder(rules, s.diagnostics, main_system_digest(s.turns))
    checks = IdChecks(session_logprobs(s.turns, arrays))
    for t in s.turns:
        prepare_turn(t, arrays, rules, checks)
        if t.unusable is not None:
            s.diagnostics.append(f"turn {t.turn}: unusable: {t.unusable}")
        builder.add(t)
    built, dropped = _build_segments(s, builder, rules)
    built, left_out = _select(built, rules, s.diagnostics)
    dropped += left_out
    samples = _samples(s, built, rules, packed)
    placeholder_reason = _placeholder_reason(s, rules, samples)
    reward = float(s.reward or 0.0)
    status: SampleStatus
    if placeholder_reason is not None:
        s.diagnostics.append(f"placeholders: {placeholder_reason}")
        samples = placeholders_for(
            [unpacked_sample(x) for x in samples],
            pad_token_id=_pad_id(s.opened, rules),
            session_id=s.session_id,
            rollout_id=_rollout_id(s.session_id, s.opened),
            reason=placeholder_reason,
            routed_experts=rules.routed_experts,
            metadata={"rules_version": rules.version, "session": _session_meta(s)},
        )
        status = "failed" if s.closed is not None and s.closed.status == "failed" else "aborted"
        reward = 0.0
    else:
        status = "truncated" if any(x.status == "truncated" for x in samples) else "completed"
    return SessionResult(
        session_id=s.session_id,
        rules_version=rules.version,
        status=status,
        reward=reward,
        token_accounting=account_tokens(s.turns, built, dropped, placeholder_reason),
        segments=[segment_record(b) for b in sorted(built + dropped, key=_completion_order)],
        samples=samples,
        placeholder=placeholder_reason is not None,
        turns_total=len(s.turns),
        turns_used=sum(len(b.chain.turns) - b.chain.trained_elsewhere for b in built),
        tito_failed_turns=sum(1 for t in s.turns if t.tito is not None and not t.tito.ok),
        aborts=sum(t.aborts for t in s.turns),
        diagnostics=s.diagnostics,
    )


def _completion_order(b: BuiltSegment) -> tuple[bool, int, int]:
    return (b.kind == "final", b.chain.last_seq, b.chain.chain_id)


def _session_meta(s: SessionFacts) -> dict[str, Any]:
    return dict(s.opened.metadata) if s.opened is not None else {}


def _build_segments(
    s: SessionFacts, builder: ChainBuilder, rules: Rules
) -> tuple[list[BuiltSegment], list[BuiltSegment]]:
    """Every classified chain as a segment, capped; (kept, dropped)."""
    budget = rules.context_length or (s.opened.context_length if s.opened else None)
    built: list[BuiltSegment] = []
    dropped: list[BuiltSegment] = []
    classified = classify_chains(builder.chains, builder.last_main, s.diagnostics, builder.evidence)
    for kind, chain in classified:
        b = build_segment(kind, chain, rules)
        if b.tokens.size - b.prompt_len == 0:
            b.dropped = "no response tokens"
        elif kind == "side" and rules.side_requests == "drop":
            b.dropped = "side request (rules: side_requests = drop)"
        elif rules.max_segment_tokens is not None and b.tokens.size > rules.max_segment_tokens:
            if rules.over_segment_cap == "drop" and kind != "final":
                b.dropped = f"{b.tokens.size} tokens over max_segment_tokens"
            else:  # the final segment is never dropped: it carries the outcome
                trim_to(b, rules.max_segment_tokens, "max_segment_tokens")
        if b.dropped is None and budget is not None:
            trim_to(b, budget, "context budget")
        (dropped if b.dropped else built).append(b)
    for b in dropped:
        s.diagnostics.append(f"{b.kind} segment (chain {b.chain.chain_id}) dropped: {b.dropped}")
    return built, dropped


def _select(
    built: list[BuiltSegment], rules: Rules, diags: list[str]
) -> tuple[list[BuiltSegment], list[BuiltSegment]]:
    """Collapse to final or fan out, then the segment-count cap (head + final).

    Returns (kept, left out); a left-out segment's `dropped` says why.
    """
    kept = built
    if rules.sample_mode == "collapse_to_final" and built:
        finals = [b for b in built if b.kind == "final"]
        if not finals:
            diags.append("collapse_to_final: no final segment; the last segment is used")
        kept = finals or built[-1:]
        for b in built:
            if b not in kept:
                b.dropped = "collapsed to the final segment"
    capped, n_capped = cap_count(kept, rules.max_segments)
    if n_capped:
        diags.append(f"max_segments={rules.max_segments}: {n_capped} middle segment(s) left out")
        for b in kept:
            if b not in capped:
                b.dropped = f"over max_segments={rules.max_segments}"
    return capped, [b for b in built if b not in capped]


def _samples(
    s: SessionFacts, built: list[BuiltSegment], rules: Rules, packed: bool
) -> list[Sample]:
    if s.reward is None:
        s.diagnostics.append("no RewardAssigned: reward 0")
    kinds = [b.kind for b in built]
    if rules.reward_mode == "final_only" and "final" not in kinds and built:
        s.diagnostics.append("final_only reward: no final segment, no sample gets the reward")
    rewards = allocate_rewards(kinds, float(s.reward or 0.0), rules)
    closed_truncated = s.closed is not None and s.closed.status == "truncated"
    out: list[Sample] = []
    for i, (b, reward) in enumerate(zip(built, rewards, strict=True)):
        truncated = (
            bool(b.truncated) or b.chain.turns[-1].finish_reason == "length" or closed_truncated
        )
        out.append(
            to_sample(
                b,
                index=i,
                count=len(built),
                reward=reward,
                status="truncated" if truncated else "completed",
                session_id=s.session_id,
                rollout_id=_rollout_id(s.session_id, s.opened),
                rules=rules,
                session_meta=_session_meta(s),
                packed=packed,
            )
        )
    return out


def _placeholder_reason(s: SessionFacts, rules: Rules, samples: list[Sample]) -> str | None:
    if s.closed is not None and s.closed.status in ("failed", "aborted"):
        detail = f": {s.closed.reason}" if s.closed.reason else ""
        return f"session closed as {s.closed.status}{detail}"
    if s.closed is None and rules.placeholder_unclosed:
        if s.failures:
            f = s.failures[-1]
            return f"session failed in {f.where}: {f.error_type}: {f.message}"
        return "session was never closed"
    if not samples:
        return (
            "no usable turns"
            if not any(t.unusable is None for t in s.turns)
            else "no segment built a sample"
        )
    return None


def reduce_session(
    events: Sequence[RecordedEvent],
    arrays: Mapping[bytes, np.ndarray],
    rules: Rules,
    *,
    packed: bool = False,
) -> SessionResult:
    """Reduce one session's events into samples. Never raises for bad data:
    whatever goes wrong yields placeholder samples and a diagnostic.

    `packed=True`: the samples' tokens, loss masks and logprobs are numpy
    arrays, not lists (`replay.packed`: a caller that only encodes them saves
    building the lists; `replay.packed.unpacked` turns them into lists)."""
    try:
        return _reduce(events, arrays, rules, packed)
    except Exception as exc:  # the fail-safe: one bad session never stops a batch
        return _failure_result(events, rules, exc)


def _failure_result(events: Sequence[RecordedEvent], rules: Rules, exc: Exception) -> SessionResult:
    session_id = ""
    opened: SessionOpened | None = None
    try:
        session_id = events[0].session_id if events else ""
        for rec in events:
            if isinstance(rec.event, SessionOpened):
                opened = rec.event
    except Exception:
        pass
    try:
        pad = _pad_id(opened, rules)
    except Exception:
        pad = 0
    reason = f"reducer error: {type(exc).__name__}: {exc}"
    try:
        rollout_id = _rollout_id(session_id, opened)
    except Exception:
        rollout_id = session_id
    samples = placeholders_for(
        [],
        pad_token_id=pad,
        session_id=session_id,
        rollout_id=rollout_id,
        reason=reason,
        routed_experts=rules.routed_experts,
        metadata={"rules_version": rules.version},
    )
    return SessionResult(
        session_id=session_id,
        rules_version=rules.version,
        status="aborted",
        reward=0.0,
        segments=[],
        samples=samples,
        placeholder=True,
        turns_total=0,
        turns_used=0,
        tito_failed_turns=0,
        aborts=0,
        diagnostics=[reason],
        token_accounting=_failure_accounting(events),
    )


def _failure_accounting(events: Sequence[RecordedEvent]) -> dict[str, int]:
    """Every engine output token of a session the reducer failed on, booked untrained:
    `replay stats` must not show it as a session that produced nothing."""
    try:
        n = sum(r.event.output_ids.length for r in events if isinstance(r.event, GenerateResult))
    except Exception:
        return {}
    return {"engine output": n, "placeholder session": n, "trained": 0}
