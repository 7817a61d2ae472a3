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
- Main-line chains: the one holding the last main-line turn is `final`, every
  other one was replaced by a non-extending request (compaction): `wipe`.
  Segments are ordered by completion (last event), `final` last.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from recorder.events import (
    ChainDecision,
    ClientDisconnected,
    EngineError,
    GenerateResult,
    MessagesRequest,
    RecordedEvent,
    RenderedInput,
    ResponseSent,
    RewardAssigned,
    SessionClosed,
    SessionFailed,
    SessionOpened,
    TitoVerdict,
    TurnAborted,
    TurnFailed,
)
from replay.placeholders import minimal_sample, placeholders_for
from replay.rules import Rules
from replay.samples import Sample, SampleStatus, Segment, SegmentKind, SessionResult, Tensor

Line = Literal["main", "subagent", "nested", "orphan"]


# --------------------------------------------------------------------------
# Turns
# --------------------------------------------------------------------------


@dataclass(slots=True)
class _Turn:
    turn: int
    request_id: str
    first_seq: int
    seqs: list[int] = field(default_factory=list)
    request: MessagesRequest | None = None
    decision: ChainDecision | None = None
    rendered: RenderedInput | None = None
    results: dict[int, GenerateResult] = field(default_factory=dict)
    aborts: int = 0
    tito: TitoVerdict | None = None
    response: ResponseSent | None = None
    failed: str | None = None
    interrupted: str | None = None
    # Derived by _prepare_turn when usable:
    unusable: str | None = None
    input: np.ndarray | None = None
    output: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    mask: np.ndarray | None = None
    versions: list[tuple[int, int, str]] = field(default_factory=list)
    routed: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    finish_reason: str = "unknown"
    tito_masked: bool = False
    stale_masked: int = 0

    @property
    def system_digest(self) -> str | None:
        if self.request is None or not self.request.system_digest:
            return None
        return self.request.system_digest


@dataclass(slots=True)
class _Session:
    session_id: str
    opened: SessionOpened | None
    closed: SessionClosed | None
    failures: list[SessionFailed]
    reward: float | None
    turns: list[_Turn]
    diagnostics: list[str]


def _window(events: Sequence[RecordedEvent]) -> tuple[list[RecordedEvent], list[str]]:
    """Events in seq order from the last SessionOpened on.

    Nothing before it may influence the result, not even a diagnostic: a
    stream that starts at the re-open must reduce to the same bytes.
    """
    ordered = sorted(events, key=lambda e: (e.seq, e.position))
    opened_at = [i for i, e in enumerate(ordered) if isinstance(e.event, SessionOpened)]
    if not opened_at:
        return ordered, ["no SessionOpened event: reducing the whole stream"]
    return ordered[opened_at[-1] :], []


def _collect(events: Sequence[RecordedEvent]) -> _Session:
    window, diags = _window(events)
    session_id = window[0].session_id if window else (events[0].session_id if events else "")
    opened: SessionOpened | None = None
    closed: SessionClosed | None = None
    failures: list[SessionFailed] = []
    reward: float | None = None
    turns: dict[tuple[int, str], _Turn] = {}
    for rec in window:
        ev = rec.event
        if isinstance(ev, SessionOpened):
            opened = ev
            continue
        if isinstance(ev, SessionClosed):
            closed = ev
            continue
        if isinstance(ev, SessionFailed):
            failures.append(ev)
            continue
        if isinstance(ev, RewardAssigned):
            reward = float(ev.reward)
            continue
        turn_no = getattr(ev, "turn", None)
        request_id = getattr(ev, "request_id", None)
        if turn_no is None or request_id is None:
            continue
        key = (int(turn_no), str(request_id))
        t = turns.get(key)
        if t is None:
            t = turns[key] = _Turn(turn=key[0], request_id=key[1], first_seq=rec.seq)
        t.seqs.append(rec.seq)
        _absorb(t, ev, diags)
    ordered = sorted(turns.values(), key=lambda t: (t.first_seq, t.turn, t.request_id))
    return _Session(session_id, opened, closed, failures, reward, ordered, diags)


def _absorb(t: _Turn, ev: Any, diags: list[str]) -> None:
    if isinstance(ev, MessagesRequest):
        t.request = t.request or ev
    elif isinstance(ev, ChainDecision):
        t.decision = t.decision or ev
    elif isinstance(ev, RenderedInput):
        if t.rendered is not None:
            diags.append(f"turn {t.turn}: more than one RenderedInput; the first is used")
        t.rendered = t.rendered or ev
    elif isinstance(ev, GenerateResult):
        if ev.attempt in t.results:
            diags.append(f"turn {t.turn}: duplicate result for attempt {ev.attempt}; first kept")
        else:
            t.results[ev.attempt] = ev
    elif isinstance(ev, TurnAborted):
        t.aborts += 1
    elif isinstance(ev, TitoVerdict):
        t.tito = t.tito or ev
    elif isinstance(ev, ResponseSent):
        t.response = t.response or ev
    elif isinstance(ev, TurnFailed):
        t.failed = t.failed or ev.reason or "turn failed"
    elif isinstance(ev, EngineError):
        t.interrupted = t.interrupted or f"engine error ({ev.kind} {ev.status})"
    elif isinstance(ev, ClientDisconnected):
        t.interrupted = t.interrupted or "client disconnected"


def _as_ids(arr: Any) -> np.ndarray:
    a = np.asarray(arr)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"token ids must be a 1-D integer array, got {a.dtype}{list(a.shape)}")
    if a.size and int(a.min()) < 0:
        raise ValueError("negative token id")
    return a.astype(np.int64, copy=False)


def _prepare_turn(t: _Turn, arrays: Mapping[bytes, np.ndarray], rules: Rules) -> None:
    """Resolve a turn's arrays and masks, or set `t.unusable` to why not."""
    t.unusable = _missing_facts(t)
    if t.unusable is not None:
        return
    attempts = [t.results[k] for k in sorted(t.results)]
    try:
        inp, outs, lps = _read_turn(t, attempts, arrays)
    except (KeyError, ValueError, TypeError) as exc:
        t.unusable = str(exc).strip("'\"")
        return
    t.finish_reason = attempts[-1].finish_reason
    if t.finish_reason == "abort":
        t.unusable = "last attempt was aborted and never resumed"
        return
    t.input = inp
    t.output = np.concatenate(outs) if len(outs) > 1 else outs[0]
    t.logprobs = np.concatenate(lps) if len(lps) > 1 else lps[0]
    t.mask = _turn_mask(t, attempts, outs, arrays, rules)


def _missing_facts(t: _Turn) -> str | None:
    if t.failed is not None:
        return f"failed: {t.failed}"
    if t.rendered is None:
        return "no RenderedInput"
    if not t.results:
        return "no GenerateResult"
    if t.interrupted is not None and t.response is None:
        return f"{t.interrupted} before a response was sent"
    return None


def _read_turn(
    t: _Turn, attempts: list[GenerateResult], arrays: Mapping[bytes, np.ndarray]
) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """The turn's input and each attempt's ids and logprobs, checked."""
    assert t.rendered is not None
    inp = _as_ids(_array(arrays, t.rendered.input_ids.digest, "input_ids"))
    if inp.size == 0:
        raise ValueError("empty input")
    outs: list[np.ndarray] = []
    lps: list[np.ndarray] = []
    for r in attempts:
        out = _as_ids(_array(arrays, r.output_ids.digest, "output_ids"))
        if r.logprobs is None:
            raise ValueError(f"attempt {r.attempt}: logprobs missing")
        lp = np.asarray(_array(arrays, r.logprobs.digest, "logprobs"), dtype=np.float64)
        if lp.shape != out.shape:
            raise ValueError(
                f"attempt {r.attempt}: {lp.size} logprobs for {out.size} output tokens"
            )
        if lp.size and (not np.all(np.isfinite(lp)) or float(lp.max()) > 0.0):
            raise ValueError(f"attempt {r.attempt}: logprobs not finite or positive")
        outs.append(out)
        lps.append(lp)
    return inp, outs, lps


def _turn_mask(
    t: _Turn,
    attempts: list[GenerateResult],
    outs: list[np.ndarray],
    arrays: Mapping[bytes, np.ndarray],
    rules: Rules,
) -> np.ndarray:
    """Loss mask of the turn's output; records weight versions and routing per attempt."""
    assert t.input is not None and t.output is not None
    mask = np.ones(t.output.size, dtype=np.int8)
    final_version = attempts[-1].weight_version
    pos = 0
    for r, out in zip(attempts, outs, strict=True):
        n = out.size
        t.versions.append((pos, pos + n, r.weight_version or "unknown"))
        if rules.stale_weight_tokens == "mask" and r.weight_version != final_version and n:
            mask[pos : pos + n] = 0
            t.stale_masked += n
        if r.routed_experts is not None and rules.routed_experts is not None:
            routed = arrays.get(r.routed_experts.digest)
            if routed is not None:
                # (tokens before this attempt's output, its output length, routing)
                t.routed.append((t.input.size + pos, n, np.asarray(routed)))
        pos += n
    if t.tito is not None and not t.tito.ok and rules.mask_tito_failed:
        mask[:] = 0
        t.tito_masked = True
    return mask


def _array(arrays: Mapping[bytes, np.ndarray], digest: bytes, what: str) -> np.ndarray:
    try:
        return arrays[digest]
    except KeyError:
        raise KeyError(f"{what} array {digest.hex()[:16]} missing") from None


# --------------------------------------------------------------------------
# Chains
# --------------------------------------------------------------------------


@dataclass(slots=True)
class _Chain:
    chain_id: int
    line: Line
    system_digest: str | None
    seq_tokens: np.ndarray
    turns: list[_Turn] = field(default_factory=list)
    dispatch_id: str | None = None
    owner: _Chain | None = None
    nested_dropped_turns: int = 0

    @property
    def last_seq(self) -> int:
        return max(self.turns[-1].seqs)

    def extend(self, t: _Turn) -> None:
        assert t.input is not None and t.output is not None
        self.turns.append(t)
        self.seq_tokens = np.concatenate([t.input, t.output])


@dataclass(slots=True)
class _Dispatch:
    tool_use_id: str
    chains: list[_Chain] = field(default_factory=list)


def _extends(inp: np.ndarray, seq: np.ndarray) -> bool:
    n = seq.size
    return (
        n <= inp.size
        and n > 0
        and inp[0] == seq[0]
        and inp[n - 1] == seq[n - 1]
        and bool(np.array_equal(inp[:n], seq))
    )


class _ChainBuilder:
    """Walks turns in order, assigning each usable one to a chain."""

    def __init__(self, rules: Rules, diags: list[str]) -> None:
        self.rules = rules
        self.diags = diags
        self.chains: list[_Chain] = []
        self.main_digest: str | None = None
        self.main_pending: dict[str, _Dispatch] = {}
        self.nested_pending: dict[str, _Chain] = {}
        self.last_main: _Chain | None = None

    def add(self, t: _Turn) -> None:
        if self.main_digest is None and t.system_digest is not None:
            self.main_digest = t.system_digest
        self._returns(t)
        chain = self._assign(t) if t.unusable is None else None
        self._dispatches(t, chain)

    def _is_main_system(self, digest: str | None) -> bool:
        return digest is None or self.main_digest is None or digest == self.main_digest

    def _returns(self, t: _Turn) -> None:
        if t.request is None:
            return
        for tid in t.request.tool_result_ids:
            if tid in self.main_pending and self._is_main_system(t.system_digest):
                del self.main_pending[tid]
            self.nested_pending.pop(tid, None)

    def _assign(self, t: _Turn) -> _Chain:
        assert t.input is not None
        best: _Chain | None = None
        for c in self.chains:
            if _extends(t.input, c.seq_tokens) and (
                best is None or c.seq_tokens.size >= best.seq_tokens.size
            ):
                best = c
        if best is not None:
            best.extend(t)
            self._note_decision(t, "extend", best)
        else:
            best = self._new_chain(t)
            self._note_decision(t, "new", best)
        if best.line == "main":
            self.last_main = best
        elif best.line == "nested" and best.owner is not None:
            best.owner.nested_dropped_turns += 1
        return best

    def _new_chain(self, t: _Turn) -> _Chain:
        assert t.input is not None and t.output is not None
        line: Line
        dispatch: str | None = None
        owner: _Chain | None = None
        sysd = t.system_digest
        if self._is_main_system(sysd):
            line = "main"
        elif self.nested_pending:
            line = "nested"
            # Attribute to the subagent that dispatched (the oldest pending).
            owner = next(iter(self.nested_pending.values()))
            while owner.owner is not None:
                owner = owner.owner
            dispatch = owner.dispatch_id
            self.diags.append(
                f"turn {t.turn}: chain started while a nested subagent dispatch is pending: "
                "its turns are dropped (nested subagents are not segmented)"
            )
        else:
            target = self._pick_dispatch(sysd)
            if target is not None:
                line = "subagent"
                dispatch = target.tool_use_id
            elif self.rules.orphan_chains == "main":
                line = "main"
                self.diags.append(
                    f"turn {t.turn}: foreign system prompt with no pending dispatch: "
                    "treated as main line"
                )
            else:
                line = "orphan"
                self.diags.append(
                    f"turn {t.turn}: foreign system prompt with no pending dispatch: dropped"
                )
        chain = _Chain(
            chain_id=len(self.chains),
            line=line,
            system_digest=sysd,
            seq_tokens=np.concatenate([t.input, t.output]),
            turns=[t],
            dispatch_id=dispatch,
            owner=owner,
        )
        self.chains.append(chain)
        if line == "subagent":
            self.main_pending[dispatch].chains.append(chain)  # type: ignore[index]
        return chain

    def _pick_dispatch(self, sysd: str | None) -> _Dispatch | None:
        for d in self.main_pending.values():
            if not d.chains:
                return d
        for d in reversed(self.main_pending.values()):
            if any(c.system_digest == sysd for c in d.chains):
                return d
        return None

    def _dispatches(self, t: _Turn, chain: _Chain | None) -> None:
        if t.response is None:
            return
        ids = [
            str(b.get("id"))
            for b in t.response.content
            if isinstance(b, dict)
            and b.get("type") == "tool_use"
            and b.get("name") in self.rules.dispatch_tool_names
            and b.get("id")
        ]
        if not ids:
            return
        main = chain.line == "main" if chain is not None else self._is_main_system(t.system_digest)
        for tid in ids:
            if main:
                self.main_pending.setdefault(tid, _Dispatch(tid))
            elif chain is not None and chain.line in ("subagent", "nested"):
                self.nested_pending.setdefault(tid, chain)
            else:
                self.diags.append(f"turn {t.turn}: dispatch {tid} from an unknown line ignored")

    def _note_decision(self, t: _Turn, action: str, chain: _Chain) -> None:
        d = t.decision
        if d is not None and d.action != action:
            self.diags.append(
                f"turn {t.turn}: live decision was {d.action!r} ({d.reason}), "
                f"replay found {action!r} (chain {chain.chain_id})"
            )


# --------------------------------------------------------------------------
# Segments -> samples
# --------------------------------------------------------------------------


@dataclass(slots=True)
class _Built:
    kind: SegmentKind
    chain: _Chain
    tokens: np.ndarray
    prompt_len: int
    mask: np.ndarray
    logprobs: np.ndarray
    versions: list[str]
    routed: np.ndarray | None
    truncated: list[str]
    dropped: str | None = None


def _classify(chains: list[_Chain], last_main: _Chain | None) -> list[tuple[SegmentKind, _Chain]]:
    out: list[tuple[SegmentKind, _Chain]] = []
    for c in chains:
        if c.line == "subagent":
            out.append(("subagent", c))
        elif c.line == "main":
            out.append(("final" if c is last_main else "wipe", c))
    out.sort(key=lambda kc: (kc[0] == "final", kc[1].last_seq, kc[1].chain_id))
    return out


def _build_segment(kind: SegmentKind, c: _Chain, rules: Rules) -> _Built:
    first, last = c.turns[0], c.turns[-1]
    assert first.input is not None and last.input is not None and last.output is not None
    tokens = np.concatenate([last.input, last.output])
    p = int(first.input.size)
    r = int(tokens.size) - p
    mask = np.zeros(r, dtype=np.int8)
    logprobs = np.zeros(r, dtype=np.float64)
    versions = [""] * r
    for t in c.turns:
        assert t.input is not None and t.output is not None and t.mask is not None
        s = int(t.input.size) - p
        n = int(t.output.size)
        mask[s : s + n] = t.mask
        logprobs[s : s + n] = np.where(t.mask == 1, t.logprobs, 0.0)  # type: ignore[arg-type]
        for a, b, v in t.versions:
            versions[s + a : s + b] = [v] * (b - a)
    routed = _routed(c, tokens.size, rules) if rules.routed_experts is not None else None
    return _Built(kind, c, tokens, p, mask, logprobs, versions, routed, [])


def _routed(c: _Chain, length: int, rules: Rules) -> np.ndarray:
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


def _trim(b: _Built, budget: int, why: str) -> None:
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


def _to_sample(
    b: _Built,
    *,
    index: int,
    count: int,
    reward: float,
    status: SampleStatus,
    session_id: str,
    rollout_id: str,
    rules: Rules,
    session_meta: dict[str, Any],
) -> Sample:
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
        "aborts": sum(t.aborts for t in c.turns),
        "tito_masked_turns": [t.turn for t in c.turns if t.tito_masked],
        "stale_weight_masked_tokens": sum(t.stale_masked for t in c.turns),
        "nested_dropped_turns": c.nested_dropped_turns,
        "truncated": list(b.truncated),
        "rules_version": rules.version,
        "rules_name": rules.name,
        "source_seqs": sorted(s for t in c.turns for s in t.seqs),
        "session": session_meta,
    }
    return Sample(
        tokens=b.tokens.tolist(),
        prompt_len=b.prompt_len,
        response_len=int(b.tokens.size) - b.prompt_len,
        loss_mask=b.mask.astype(np.int64).tolist(),
        rollout_logprobs=b.logprobs.tolist(),
        weight_versions=list(b.versions),
        status=status,
        reward=reward,
        rollout_id=rollout_id,
        session_id=session_id,
        metadata=meta,
        routed_experts=Tensor.from_array(b.routed) if b.routed is not None else None,
    )


def _allocate(rewards_for: list[SegmentKind], reward: float, rules: Rules) -> list[float]:
    k = len(rewards_for)
    if rules.reward_mode == "copy":
        return [reward] * k
    if rules.reward_mode == "final_only":
        return [reward if kind == "final" else 0.0 for kind in rewards_for]
    return [reward / k] * k if k else []


def _cap_count(built: list[_Built], cap: int | None) -> tuple[list[_Built], int]:
    if cap is None or len(built) <= cap:
        return built, 0
    kept = [*built[: cap - 1], built[-1]]
    return kept, len(built) - len(kept)


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------


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


def _segment_record(b: _Built) -> Segment:
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


def _reduce(
    events: Sequence[RecordedEvent], arrays: Mapping[bytes, np.ndarray], rules: Rules
) -> SessionResult:
    s = _collect(events)
    builder = _ChainBuilder(rules, s.diagnostics)
    for t in s.turns:
        _prepare_turn(t, arrays, rules)
        if t.unusable is not None:
            s.diagnostics.append(f"turn {t.turn}: unusable: {t.unusable}")
        builder.add(t)
    built, dropped = _build_segments(s, builder, rules)
    built = _select(built, rules, s.diagnostics)
    samples = _samples(s, built, rules)
    placeholder_reason = _placeholder_reason(s, rules, samples)
    reward = float(s.reward or 0.0)
    status: SampleStatus
    if placeholder_reason is not None:
        s.diagnostics.append(f"placeholders: {placeholder_reason}")
        samples = placeholders_for(
            samples,
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
        segments=[_segment_record(b) for b in sorted(built + dropped, key=_completion_order)],
        samples=samples,
        placeholder=placeholder_reason is not None,
        turns_total=len(s.turns),
        turns_used=sum(len(b.chain.turns) for b in built),
        tito_failed_turns=sum(1 for t in s.turns if t.tito is not None and not t.tito.ok),
        aborts=sum(t.aborts for t in s.turns),
        diagnostics=s.diagnostics,
    )


def _completion_order(b: _Built) -> tuple[bool, int, int]:
    return (b.kind == "final", b.chain.last_seq, b.chain.chain_id)


def _session_meta(s: _Session) -> dict[str, Any]:
    return dict(s.opened.metadata) if s.opened is not None else {}


def _build_segments(
    s: _Session, builder: _ChainBuilder, rules: Rules
) -> tuple[list[_Built], list[_Built]]:
    """Every classified chain as a segment, capped; (kept, dropped)."""
    budget = rules.context_length or (s.opened.context_length if s.opened else None)
    built: list[_Built] = []
    dropped: list[_Built] = []
    for kind, chain in _classify(builder.chains, builder.last_main):
        b = _build_segment(kind, chain, rules)
        if b.tokens.size - b.prompt_len == 0:
            b.dropped = "no response tokens"
        elif rules.max_segment_tokens is not None and b.tokens.size > rules.max_segment_tokens:
            if rules.over_segment_cap == "drop":
                b.dropped = f"{b.tokens.size} tokens over max_segment_tokens"
            else:
                _trim(b, rules.max_segment_tokens, "max_segment_tokens")
        if b.dropped is None and budget is not None:
            _trim(b, budget, "context budget")
        (dropped if b.dropped else built).append(b)
    for b in dropped:
        s.diagnostics.append(f"{b.kind} segment (chain {b.chain.chain_id}) dropped: {b.dropped}")
    return built, dropped


def _select(built: list[_Built], rules: Rules, diags: list[str]) -> list[_Built]:
    """Collapse to final or fan out, then the segment-count cap (head + final)."""
    if rules.sample_mode == "collapse_to_final" and built:
        finals = [b for b in built if b.kind == "final"]
        if not finals:
            diags.append("collapse_to_final: no final segment; the last segment is used")
        built = finals or built[-1:]
    built, n_capped = _cap_count(built, rules.max_segments)
    if n_capped:
        diags.append(f"max_segments={rules.max_segments}: {n_capped} middle segment(s) left out")
    return built


def _samples(s: _Session, built: list[_Built], rules: Rules) -> list[Sample]:
    if s.reward is None:
        s.diagnostics.append("no RewardAssigned: reward 0")
    kinds = [b.kind for b in built]
    if rules.reward_mode == "final_only" and "final" not in kinds and built:
        s.diagnostics.append("final_only reward: no final segment, no sample gets the reward")
    rewards = _allocate(kinds, float(s.reward or 0.0), rules)
    closed_truncated = s.closed is not None and s.closed.status == "truncated"
    out: list[Sample] = []
    for i, (b, reward) in enumerate(zip(built, rewards, strict=True)):
        truncated = (
            bool(b.truncated) or b.chain.turns[-1].finish_reason == "length" or closed_truncated
        )
        out.append(
            _to_sample(
                b,
                index=i,
                count=len(built),
                reward=reward,
                status="truncated" if truncated else "completed",
                session_id=s.session_id,
                rollout_id=_rollout_id(s.session_id, s.opened),
                rules=rules,
                session_meta=_session_meta(s),
            )
        )
    return out


def _placeholder_reason(s: _Session, rules: Rules, samples: list[Sample]) -> str | None:
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
    events: Sequence[RecordedEvent], arrays: Mapping[bytes, np.ndarray], rules: Rules
) -> SessionResult:
    """Reduce one session's events into samples. Never raises for bad data:
    whatever goes wrong yields placeholder samples and a diagnostic."""
    try:
        return _reduce(events, arrays, rules)
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
        sample = minimal_sample(
            pad,
            session_id=session_id,
            rollout_id=_rollout_id(session_id, opened),
            reason=reason,
            routed_experts=rules.routed_experts,
            metadata={"rules_version": rules.version},
        )
    except Exception:
        sample = minimal_sample(0, reason=reason)
    return SessionResult(
        session_id=session_id,
        rules_version=rules.version,
        status="aborted",
        reward=0.0,
        segments=[],
        samples=[sample],
        placeholder=True,
        turns_total=0,
        turns_used=0,
        tito_failed_turns=0,
        aborts=0,
        diagnostics=[reason],
    )
