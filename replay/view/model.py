"""What the session, turn and sample pages show, built from the log (no HTML here).

Samples come from the same `load_session` + `reduce_log` path as `replay
show` and `replay export`, so the page shows exactly what a trainer gets.
Token texts need a tokenizer: `--tokenizer PATH`, else the one the session
recorded (`SessionOpened.tokenizer.name_or_path`) when that path exists here;
without one the pages show token ids.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from recorder.log.events import (
    ChainDecision,
    GenerateResult,
    MessagesRequest,
    RecordedEvent,
    RenderedInput,
    SandboxEvent,
    SessionOpened,
)
from recorder.log.store.base import EventStore
from replay import reduce_log
from replay.load import session_log
from replay.rules import Rules
from replay.samples import Sample, SessionResult
from replay.show import describe
from replay.tito import TurnTokens, first_divergence, reencode, turn_tokens
from replay.tito import rerender as rerender_ids


class TokenText:
    """Token id -> display text through a tokenizer, cached per id (or the bare id)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, ids: Sequence[int]) -> list[str]:
        if self.tokenizer is None:
            return [f"‹{i}›" for i in ids]
        missing = sorted({int(i) for i in ids} - self._cache.keys())
        if missing:
            self._cache.update(zip(missing, self.tokenizer.decode_tokens(missing), strict=True))
        return [self._cache[int(i)] for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        """A run of tokens as one text (an engine input is shown as two runs, not
        as 100k spans)."""
        if self.tokenizer is None:
            return "".join(f"‹{i}›" for i in ids)
        return str(self.tokenizer.decode(list(ids)))


class Tokenizers:
    """Loads each tokenizer path once; a path that fails to load shows ids instead."""

    def __init__(self, override: str | None) -> None:
        self.override = override
        self._loaded: dict[str, TokenText] = {}

    def for_events(self, events: Sequence[RecordedEvent]) -> TokenText:
        path = self.override
        if path is None:
            opened = next((e.event for e in events if isinstance(e.event, SessionOpened)), None)
            ident = opened.tokenizer if opened else None
            if ident is not None and Path(ident.name_or_path).exists():
                path = ident.name_or_path
        if path is None:
            return TokenText(None)
        if path not in self._loaded:
            try:
                from recorder.model.tokenizer import load_tokenizer

                self._loaded[path] = TokenText(load_tokenizer(path))
            except Exception:
                self._loaded[path] = TokenText(None)
        return self._loaded[path]


@dataclass(slots=True)
class Reduced:
    events: list[RecordedEvent]
    result: SessionResult


class Reductions:
    """The last few reduced sessions, keyed by (session, log position): a page and
    its token chunks reduce once; a session that grew reduces afresh."""

    def __init__(self, store: EventStore, rules: Rules, keep: int = 8) -> None:
        self.store, self.rules, self.keep = store, rules, keep
        self._cache: OrderedDict[tuple[str, int], Reduced] = OrderedDict()

    async def get(self, session_id: str) -> Reduced | None:
        events = await self.store.read_session(session_id)
        if not events:
            return None
        key = (session_id, max(e.position for e in events))
        hit = self._cache.get(key)
        if hit is None:
            routed = self.rules.routed_experts is not None
            log = await session_log(self.store, session_id, events, routed_experts=routed)
            hit = Reduced(log.events, reduce_log(log, self.rules))
            self._cache[key] = hit
            while len(self._cache) > self.keep:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return hit


# -------------------------------------------------------------- session


@dataclass(slots=True)
class TimelineRow:
    seq: int
    ts: float
    turn: int | None
    type: str
    detail: str


@dataclass(slots=True)
class Lane:
    """One chain: its turns, how it began, and the segment it became."""

    chain_id: int
    parent: int | None
    reason: str
    turns: list[int] = field(default_factory=list)
    kind: str = ""
    dropped: str | None = None
    sample: int | None = None


def timeline(events: Sequence[RecordedEvent]) -> list[TimelineRow]:
    return [
        TimelineRow(r.seq, r.ts, getattr(r.event, "turn", None), r.type, describe(r.event))
        for r in sorted(events, key=lambda e: e.seq)
    ]


def lanes(events: Sequence[RecordedEvent], result: SessionResult) -> list[Lane]:
    """Chains in the order they began, with the segment each became (if any)."""
    out: dict[int, Lane] = {}
    for rec in sorted(events, key=lambda e: e.seq):
        ev = rec.event
        if isinstance(ev, ChainDecision):
            lane = out.get(ev.chain_id)
            if lane is None:
                lane = out[ev.chain_id] = Lane(ev.chain_id, ev.parent_chain_id, ev.reason)
            if ev.turn not in lane.turns:
                lane.turns.append(ev.turn)
    for seg in result.segments:
        lane = out.setdefault(seg.chain_id, Lane(seg.chain_id, None, ""))
        lane.kind, lane.dropped = seg.kind, seg.dropped
        lane.turns = sorted(set(lane.turns) | set(seg.turns))
    for i, s in enumerate(result.samples):
        cid = s.metadata.get("chain_id")
        if cid in out and out[cid].sample is None:
            out[cid].sample = i
    return list(out.values())


def rollout_story(events: Sequence[RecordedEvent]) -> dict[str, dict[str, Any]]:
    """The rollout's diff and grader records (last of each kind), if it is a rollout."""
    story: dict[str, dict[str, Any]] = {}
    for rec in events:
        ev = rec.event
        if isinstance(ev, SandboxEvent) and ev.kind in ("diff_taken", "eval_result", "failed"):
            story[ev.kind] = dict(ev.detail)
    return story


def turn_numbers(events: Sequence[RecordedEvent]) -> list[int]:
    return sorted(
        {
            r.event.turn
            for r in events
            if isinstance(r.event, MessagesRequest | RenderedInput | GenerateResult)
        }
    )


# -------------------------------------------------------------- turn


@dataclass(slots=True)
class Comparison:
    """Two id sequences aligned from a little before their first divergence
    (`replay tito`'s side-by-side, as data for the page)."""

    title: str
    left_name: str
    right_name: str
    left: list[int]
    right: list[int]
    divergence: int | None
    start: int
    left_text: list[str]
    right_text: list[str]

    @property
    def stop(self) -> int:
        return self.start + max(len(self.left_text), len(self.right_text))


def compare(
    title: str,
    left_name: str,
    left: Sequence[int],
    right_name: str,
    right: Sequence[int],
    text: TokenText,
    *,
    context: int = 8,
    limit: int = 200,
) -> Comparison:
    div = first_divergence(left, right)
    start = 0 if div is None else max(0, div - context)
    a, b = list(left[start : start + limit]), list(right[start : start + limit])
    return Comparison(
        title, left_name, right_name, list(left), list(right), div, start, text(a), text(b)
    )


@dataclass(slots=True)
class TurnView:
    tokens: TurnTokens
    messages: list[dict[str, Any]]
    system: Any
    prefix_len: int
    n_input: int
    reused_text: str
    new_text: str
    output_text: list[str]
    logprobs: list[float]
    comparisons: list[Comparison]
    notes: list[str]
    body_error: str = ""


async def turn_view(
    store: EventStore,
    events: Sequence[RecordedEvent],
    turn: int,
    text: TokenText,
    *,
    rerender: bool = False,
) -> TurnView:
    """One turn as the turn page shows it; `rerender` also renders the request
    afresh through the chat template (needs the tokenizer; costs a full render)."""
    tt = await turn_tokens(store, events[0].session_id, turn)
    rendered = [
        r.event for r in events if isinstance(r.event, RenderedInput) and r.event.turn == turn
    ]
    results = sorted(
        (r.event for r in events if isinstance(r.event, GenerateResult) and r.event.turn == turn),
        key=lambda g: g.attempt,
    )
    refs = [g.logprobs for g in results if g.logprobs is not None]
    lps = [float(x) for a in (await store.get_arrays(refs) if refs else []) for x in a]
    messages: list[dict[str, Any]] = []
    system: Any = None
    error = ""
    if tt.body is not None:
        try:
            body = json.loads(tt.body)
            messages = list(body.get("messages") or body.get("input") or [])
            system = body.get("system")
        except (ValueError, AttributeError) as exc:
            error = f"request body is not JSON: {exc}"
    comparisons, notes = await _comparisons(tt, text, rerender)
    ids = tt.input_ids or []
    cut = prefix_len(rendered)
    return TurnView(
        tokens=tt,
        messages=messages,
        system=system,
        prefix_len=cut,
        n_input=len(ids),
        reused_text=text.decode(ids[:cut]),
        new_text=text.decode(ids[cut:]),
        output_text=text(tt.emitted),
        logprobs=lps,
        comparisons=comparisons,
        notes=notes,
        body_error=error,
    )


async def _comparisons(
    tt: TurnTokens, text: TokenText, rerender: bool
) -> tuple[list[Comparison], list[str]]:
    """The two comparisons `replay tito --turn` prints: decode→re-encode, and the
    engine input against a fresh template render."""
    tok = text.tokenizer
    out: list[Comparison] = []
    notes: list[str] = []
    reencoded, source = tt.reencoded, "recorded"
    if reencoded is None and tok is not None:
        reencoded, source = reencode(tok, tt.emitted), "re-encoded now"
    if reencoded is None:
        notes.append("no re-encoded ids recorded: start replay view with --tokenizer PATH")
    else:
        out.append(
            compare(
                f"decode→re-encode ({source})",
                "emitted",
                tt.emitted,
                "re-encoded",
                reencoded,
                text,
            )
        )
    if not rerender:
        return out, notes
    if tok is None or tt.body is None or tt.input_ids is None:
        notes.append("template re-render: needs a tokenizer and the recorded request")
        return out, notes
    try:
        fresh = await asyncio.to_thread(rerender_ids, tok, tt.body, tt.dialect)
    except Exception as exc:
        notes.append(f"template re-render failed: {type(exc).__name__}: {exc}")
        return out, notes
    out.append(
        compare(
            "engine input vs template re-render", "sent", tt.input_ids, "re-rendered", fresh, text
        )
    )
    return out, notes


def prefix_len(rendered: Sequence[RenderedInput]) -> int:
    return rendered[-1].prefix_len if rendered else 0


# -------------------------------------------------------------- sample


@dataclass(slots=True)
class Span:
    """Tokens [start, end) of a sample and where they came from."""

    start: int
    end: int
    turn: int
    origin: str  # "prompt" (inserted before the turn) or "output" (the engine's)


def origins(sample: Sample, events: Sequence[RecordedEvent]) -> list[Span]:
    """Which turn each token of `sample` came from, and whether the engine emitted it.

    A chain's turn t sees input_ids of length L_t (all earlier turns' tokens
    plus what the request inserted) and emits O_t tokens at [L_t, L_t + O_t).
    """
    turns = [int(t) for t in sample.metadata.get("turns", [])]
    lengths: dict[int, int] = {}
    outputs: dict[int, int] = {}
    for r in events:
        ev = r.event
        if isinstance(ev, RenderedInput) and ev.turn in turns:
            lengths[ev.turn] = ev.input_ids.length
        elif isinstance(ev, GenerateResult) and ev.turn in turns:
            outputs[ev.turn] = outputs.get(ev.turn, 0) + ev.output_ids.length
    spans: list[Span] = []
    at, n = 0, len(sample.tokens)
    for i, t in enumerate(turns):
        if t not in lengths:
            continue
        start = min(lengths[t], n)
        if start > at:
            spans.append(Span(at, start, t, "prompt"))
        nxt = next((lengths[u] for u in turns[i + 1 :] if u in lengths), n)
        end = min(start + outputs.get(t, 0), nxt, n)
        if end > start:
            spans.append(Span(start, end, t, "output"))
        at = max(at, end)
    if at < n:
        spans.append(Span(at, n, turns[-1] if turns else -1, "prompt"))
    return spans


def mask_reason(sample: Sample, span: Span) -> str:
    """Why tokens of `span` that have loss_mask 0 are not trained."""
    meta = sample.metadata
    if span.origin == "prompt":
        return "inserted by the client or template (tool result, user text, glue)"
    if "placeholder" in meta:
        return f"placeholder: {meta['placeholder']}"
    if span.turn in meta.get("tito_masked_turns", []):
        return "TITO mismatch: decode→re-encode differs"
    if span.turn in meta.get("turns_trained_elsewhere", []):
        return "context here: trained in the branch the conversation went on with"
    if meta.get("stale_weight_masked_tokens"):
        return "stale weight version"
    return "masked by the rules"


def token_rows(
    sample: Sample, spans: Sequence[Span], text: TokenText, start: int, stop: int
) -> list[list[Any]]:
    """[id, text, mask, logprob, weight version, turn, origin, reason] for tokens [start, stop).

    Prompt tokens carry mask -1 (no loss is computed there at all)."""
    stop = min(stop, len(sample.tokens))
    ids = sample.tokens[start:stop]
    texts = text(ids)
    p = sample.prompt_len
    spans_sorted = sorted(spans, key=lambda s: s.start)
    rows: list[list[Any]] = []
    k = 0
    for j, (tid, tx) in enumerate(zip(ids, texts, strict=True)):
        i = start + j
        while k + 1 < len(spans_sorted) and spans_sorted[k].end <= i:
            k += 1
        span = spans_sorted[k] if spans_sorted else Span(0, len(sample.tokens), -1, "prompt")
        if i < p:
            rows.append([tid, tx, -1, 0.0, "", span.turn, span.origin, "prompt"])
            continue
        r = i - p
        mask = sample.loss_mask[r]
        reason = "" if mask else mask_reason(sample, span)
        rows.append(
            [
                tid,
                tx,
                mask,
                sample.rollout_logprobs[r],
                sample.weight_versions[r],
                span.turn,
                span.origin,
                reason,
            ]
        )
    return rows


def masked_regions(sample: Sample, spans: Sequence[Span]) -> list[tuple[int, int, str]]:
    """Runs of untrained response tokens with one reason: (start, end, reason)."""
    out: list[tuple[int, int, str]] = []
    mask = np.asarray(sample.loss_mask)
    p = sample.prompt_len
    for span in spans:
        lo, hi = max(span.start, p), span.end
        if hi <= lo:
            continue
        seg = mask[lo - p : hi - p]
        if (seg == 0).any():
            out.append((lo, hi, mask_reason(sample, span) + f" ({int((seg == 0).sum())} tokens)"))
    return out
