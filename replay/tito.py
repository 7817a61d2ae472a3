"""`replay tito`: find TITO-failed turns and show token by token where they diverge.

Two comparisons for one turn:
- decode -> re-encode: the ids the model emitted vs the ids its decoded text
  encodes back to (the recorded `TitoVerdict.reencoded_ids`, or recomputed
  with a tokenizer);
- template re-render: the engine input we sent (exact chain tokens) vs a fresh
  render of the request's messages through the chat template (needs the
  tokenizer and the raw request body).
The tokenizer is loaded with `recorder.model.tokenizer.load_tokenizer` (the same
code the live server uses; an HF directory or a GGUF file), imported lazily.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from rich.console import Group
from rich.table import Table
from rich.text import Text

from recorder.log.events import (
    GenerateResult,
    MessagesRequest,
    RecordedEvent,
    RenderedInput,
    TitoVerdict,
)
from recorder.log.store.base import EventStore


class Decoder(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def decode_tokens(self, ids: Sequence[int]) -> list[str]: ...


@dataclass(slots=True)
class TitoFailure:
    session_id: str
    turn: int
    output_tokens: int
    first_divergence: int | None


@dataclass(slots=True)
class TurnTokens:
    session_id: str
    turn: int
    emitted: list[int]
    reencoded: list[int] | None
    input_ids: list[int] | None
    body: bytes | None
    verdict: TitoVerdict | None
    dialect: str = "anthropic"


def load_tokenizer(path: str) -> Decoder:
    from recorder.model.tokenizer import load_tokenizer as _load

    return _load(path)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing id (or of the shorter end), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class _FailureScan:
    """Accumulates TITO failures and output sizes over a stream of events."""

    def __init__(self) -> None:
        self.outputs: dict[tuple[str, int], int] = {}
        self.failures: list[TitoFailure] = []
        self.verdicts = 0

    def add(self, rec: RecordedEvent) -> None:
        ev = rec.event
        if isinstance(ev, GenerateResult):
            key = (rec.session_id, ev.turn)
            self.outputs[key] = self.outputs.get(key, 0) + ev.output_ids.length
        elif isinstance(ev, TitoVerdict):
            self.verdicts += 1
            if not ev.ok:
                self.failures.append(TitoFailure(rec.session_id, ev.turn, 0, ev.first_divergence))

    def result(self) -> tuple[list[TitoFailure], int]:
        for f in self.failures:
            f.output_tokens = self.outputs.get((f.session_id, f.turn), 0)
        return self.failures, self.verdicts


async def list_failures(
    store: EventStore, session_id: str | None = None, *, page_size: int = 1000
) -> tuple[list[TitoFailure], int]:
    """TITO-failed turns (of one session or the whole log) and how many verdicts exist."""
    scan = _FailureScan()
    if session_id is not None:
        for rec in await store.read_session(session_id):
            scan.add(rec)
        return scan.result()
    after = 0
    while True:
        page = await store.read_all(after=after, limit=page_size)
        for rec in page:
            scan.add(rec)
        if len(page) < page_size:
            break
        after = page[-1].position
    return scan.result()


async def turn_tokens(store: EventStore, session_id: str, turn: int) -> TurnTokens:
    events = [
        e for e in await store.read_session(session_id) if getattr(e.event, "turn", None) == turn
    ]
    if not events:
        raise LookupError(f"session {session_id!r} has no turn {turn}")
    results = sorted(
        (e.event for e in events if isinstance(e.event, GenerateResult)), key=lambda r: r.attempt
    )
    verdict = next((e.event for e in events if isinstance(e.event, TitoVerdict)), None)
    rendered = next((e.event for e in events if isinstance(e.event, RenderedInput)), None)
    request = next((e.event for e in events if isinstance(e.event, MessagesRequest)), None)
    refs = [r.output_ids for r in results]
    extra = [
        ref
        for ref in (
            verdict.reencoded_ids if verdict else None,
            rendered.input_ids if rendered else None,
            request.body if request else None,
        )
        if ref is not None
    ]
    arrays = await store.get_arrays([*refs, *extra])
    emitted = [int(x) for a in arrays[: len(refs)] for x in a]
    rest = iter(arrays[len(refs) :])
    reencoded = _ids(next(rest)) if verdict and verdict.reencoded_ids else None
    input_ids = _ids(next(rest)) if rendered else None
    body = np.asarray(next(rest), dtype=np.uint8).tobytes() if request else None
    dialect = request.dialect if request else "anthropic"
    return TurnTokens(session_id, turn, emitted, reencoded, input_ids, body, verdict, dialect)


def _ids(arr: Any) -> list[int]:
    return [int(x) for x in np.asarray(arr).reshape(-1)]


def reencode(tok: Decoder, ids: Sequence[int]) -> list[int]:
    return list(tok.encode(tok.decode(ids)))


def rerender(tok: Any, body: bytes, dialect: str = "anthropic") -> list[int]:
    """Ids of a fresh full render of the request (the template path, no chain reuse).

    A Responses request chained by `previous_response_id` cannot be rendered on
    its own (its history is in the log): it raises InvalidRequest.
    """
    import asyncio

    from recorder.dialects import dialect_named

    req, _ = asyncio.run(dialect_named(dialect).parse(body))
    text = tok.render(req.messages, req.tools, True, **req.template_kwargs)
    return list(tok.encode(text))


def side_by_side(
    title: str,
    left_name: str,
    left: Sequence[int],
    right_name: str,
    right: Sequence[int],
    tok: Decoder | None,
    *,
    context: int = 8,
    limit: int = 400,
) -> Group:
    """Aligned ids (and decoded pieces) with the first divergence marked.

    Long sequences are windowed around the divergence (`context` rows before).
    """
    div = first_divergence(left, right)
    n = max(len(left), len(right))
    start = 0 if div is None else max(0, div - context)
    stop = min(n, start + limit)
    lp = tok.decode_tokens(list(left[start:stop])) if tok else None
    rp = tok.decode_tokens(list(right[start:stop])) if tok else None
    status = "identical" if div is None else f"first divergence at index {div}"
    heading = Text(f"{title}: {len(left)} vs {len(right)} ids, {status}", style="bold")
    table = Table()
    table.add_column("#", justify="right")
    table.add_column(left_name, justify="right")
    if tok:
        table.add_column("piece")
    table.add_column(right_name, justify="right")
    if tok:
        table.add_column("piece ")
    table.add_column("")
    for i in range(start, stop):
        a = str(left[i]) if i < len(left) else "—"
        b = str(right[i]) if i < len(right) else "—"
        row: list[str | Text] = [str(i), a]
        if lp is not None:
            row.append(repr(lp[i - start]) if i < len(left) else "")
        row.append(b)
        if rp is not None:
            row.append(repr(rp[i - start]) if i < len(right) else "")
        differs = a != b
        row.append(
            Text("◀ first divergence", style="bold red") if i == div else ("≠" if differs else "")
        )
        table.add_row(*row, style="red" if differs else "")
    if stop < n:
        table.caption = f"{n - stop} more rows not shown"
    return Group(heading, table)


def failures_table(failures: Sequence[TitoFailure], verdicts: int) -> Table:
    rate = f"{len(failures) / verdicts:.1%}" if verdicts else "n/a"
    table = Table(title=f"TITO-failed turns: {len(failures)} of {verdicts} checked ({rate})")
    for col in ("session", "turn", "output tokens", "first divergence"):
        table.add_column(col)
    for f in failures:
        div = "" if f.first_divergence is None else str(f.first_divergence)
        table.add_row(f.session_id, str(f.turn), str(f.output_tokens), div)
    return table
