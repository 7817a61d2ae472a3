"""Reading sessions out of an `EventStore` for the reducer (the only I/O of replay).

`load_session` reads one session; `iter_session_logs` streams every session
of a log with keyset pages and bounded memory: events are buffered per
session only until that session is complete (closed) or the end of the log
is reached, then its arrays are fetched, it is yielded and its buffer freed.

Both paths hand the reducer the same events (all of the session's events)
and the same arrays, so live and offline reductions agree byte for byte.

The stream reads arrays with `cache=False`: one `get_arrays` call fetches the
arrays of the sessions that closed in one page of events (at most
`ARRAY_BATCH`; a session's prompt chains share pieces within that call, and a
call costs a few queries whatever it reads), and no later session reuses
them, so keeping them would only grow the store's memory with the length of
the log.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from recorder.log.events import (
    ArrayRef,
    GenerateResult,
    RecordedEvent,
    RenderedInput,
    SessionClosed,
    SessionOpened,
)
from recorder.log.store.arrays import piece_digest
from recorder.log.store.base import EventStore, SessionRange, StoreError

# (phase, position): phase 0 = yielded at its `SessionClosed` (the close's
# position), 1 = still open at the end of the log (its buffer's first event),
# 2 = re-read in full after late events (the first late event). Unique per yield,
# increasing in the stream's yield order, and the same whatever other sessions a
# pass reads: each depends on that session's own events only.
YieldKey = tuple[int, int]

# Closed sessions whose arrays the stream reads in one `get_arrays` call: a call
# costs a few round trips to the database whatever it reads (one per level of
# the piece chains), so reading sessions one by one paid them per session.
ARRAY_BATCH = 32


@dataclass(slots=True)
class SessionLog:
    """One session's events (seq order) and the arrays the reducer needs."""

    session_id: str
    events: list[RecordedEvent]
    arrays: dict[bytes, np.ndarray]
    missing_arrays: list[str] = field(default_factory=list)
    # Where `iter_session_logs` yielded it in a pass over the whole log (see
    # `YieldKey`): parallel workers each stream a slice of the sessions, and
    # their outputs merged by this key come out in the one-process order.
    order: YieldKey = (0, 0)

    @property
    def last_position(self) -> int:
        return max((e.position for e in self.events), default=0)


def needed_refs(events: Iterable[RecordedEvent], *, routed_experts: bool) -> list[ArrayRef]:
    """The arrays a reduction reads, each once, in first-use order."""
    return wanted_arrays(events, routed_experts=routed_experts)[0]


# (an output ref, the ref of the input that should re-send it, where it starts there)
Resent = tuple[ArrayRef, ArrayRef, int]


def resent_outputs(events: Iterable[RecordedEvent]) -> list[Resent]:
    """Where each turn's output ids should reappear: in the next turn's input,
    right after the turn's own input (attempts one after another).

    A chain's next request re-sends the model's output verbatim, so that input
    already holds the output's tokens; `derive_outputs` takes them from there
    when they hash to the output's digest, and the store is not asked for them.
    A guess only: a turn followed by another chain's request just fails the
    hash check and is read from the store.
    """
    return wanted_arrays(events, routed_experts=False)[1]


def wanted_arrays(
    events: Iterable[RecordedEvent], *, routed_experts: bool
) -> tuple[list[ArrayRef], list[Resent]]:
    """(`needed_refs`, `resent_outputs`) in one pass over the events (a session
    has hundreds; the stream asks for both of every session)."""
    refs: dict[bytes, ArrayRef] = {}
    out: list[Resent] = []
    key: tuple[int, str] | None = None
    start = 0
    pending: list[tuple[ArrayRef, int]] = []
    for rec in events:
        ev = rec.event
        if isinstance(ev, RenderedInput):
            ref = ev.input_ids
            if ref.digest not in refs:
                refs[ref.digest] = ref
            here = (ev.turn, ev.request_id)
            if here == key:
                continue
            for o, at in pending:  # a loop: a comprehension per input cost a call
                out.append((o, ref, at))
            key, start, pending = here, ref.length, []
        elif isinstance(ev, GenerateResult):
            for ref in (ev.output_ids, ev.logprobs, ev.routed_experts if routed_experts else None):
                if ref is not None and ref.digest not in refs:
                    refs[ref.digest] = ref
            if (ev.turn, ev.request_id) == key:
                pending.append((ev.output_ids, start))
                start += ev.output_ids.length
    return list(refs.values()), out


def derive_outputs(resent: Sequence[Resent], arrays: dict[bytes, np.ndarray]) -> None:
    """Add to `arrays` each output of `resent` found in its input (read already).

    Found means the slice hashes to the output's digest as the store's own
    check of a one-piece array does (`arrays.piece_digest`), so it is exactly
    the stored array; anything else (another chain's input, a multi-piece
    output) is left for the store to read.
    """
    for out, inp, at in resent:
        source = arrays.get(inp.digest)
        if out.digest in arrays or source is None or out.dtype != inp.dtype:
            continue
        if source.size < at + out.length:
            continue
        piece = source[at : at + out.length]
        raw = piece if piece.flags.c_contiguous else piece.tobytes()  # hashed in place
        if piece_digest(None, out.dtype, raw) == out.digest:
            piece.flags.writeable = False  # shared with the input it views
            arrays[out.digest] = piece


async def _load_deriving(
    store: EventStore, refs: Sequence[ArrayRef], resent: Sequence[Resent], *, cache: bool
) -> tuple[dict[bytes, np.ndarray], list[str]]:
    """`load_arrays`, taking the outputs `resent` names from their inputs where they are."""
    later = {o.digest for o, _i, _at in resent}
    arrays, problems = await load_arrays(
        store, [r for r in refs if r.digest not in later], cache=cache
    )
    derive_outputs(resent, arrays)
    rest = [r for r in refs if r.digest in later and r.digest not in arrays]
    found, more = await load_arrays(store, rest, cache=cache)
    arrays.update(found)
    return arrays, problems + more


async def load_arrays(
    store: EventStore, refs: Sequence[ArrayRef], *, cache: bool = True
) -> tuple[dict[bytes, np.ndarray], list[str]]:
    """Fetch arrays in one batch; on a store error, one by one, skipping bad ones.

    A missing or corrupt array makes its turn unusable in the reducer; it
    never stops the replay. Returns (arrays, "digest: error" for the skipped).
    `cache=False` leaves nothing of this read in the store's caches.
    """
    if not refs:
        return {}, []
    try:
        got = await store.get_arrays(refs, cache=cache)
        return {r.digest: a for r, a in zip(refs, got, strict=True)}, []
    except StoreError:
        pass
    arrays: dict[bytes, np.ndarray] = {}
    problems: list[str] = []
    for ref in refs:
        try:
            (arrays[ref.digest],) = await store.get_arrays([ref], cache=cache)
        except StoreError as exc:
            problems.append(f"{ref.digest.hex()[:16]}: {type(exc).__name__}: {exc}")
    return arrays, problems


async def _session_log(
    store: EventStore,
    session_id: str,
    events: list[RecordedEvent],
    routed_experts: bool,
    *,
    cache: bool,
    order: YieldKey = (0, 0),
) -> SessionLog:
    (log,) = await _session_logs(store, [(session_id, events, order)], routed_experts, cache=cache)
    return log


_SEQ_ORDER = attrgetter("seq", "position")

# (session id, its events, where the stream yields it)
_Ready = tuple[str, list[RecordedEvent], YieldKey]


async def _session_logs(
    store: EventStore, ready: Sequence[_Ready], routed_experts: bool, *, cache: bool
) -> list[SessionLog]:
    """`SessionLog`s of several sessions, their arrays read in one call.

    Each session gets exactly the arrays it would get read alone: on a store
    error the batch falls back to reading each session by itself (and that,
    to one array at a time), so one bad array costs only its own turn.
    """
    wanted: list[tuple[list[ArrayRef], list[Resent]]] = []
    for _sid, events, _order in ready:
        events.sort(key=_SEQ_ORDER)
        wanted.append(wanted_arrays(events, routed_experts=routed_experts))
    got = await _batch_arrays(store, wanted, cache=cache) if len(ready) > 1 else None
    out = []
    for (sid, events, order), (refs, resent) in zip(ready, wanted, strict=True):
        if got is not None:
            arrays, problems = {r.digest: got[r.digest] for r in refs}, []
        else:
            arrays, problems = await _load_deriving(store, refs, resent, cache=cache)
        out.append(SessionLog(sid, events, arrays, problems, order))
    return out


async def _batch_arrays(
    store: EventStore, wanted: Sequence[tuple[list[ArrayRef], list[Resent]]], *, cache: bool
) -> dict[bytes, np.ndarray] | None:
    """Every array `wanted` names, in two calls (the outputs not found in their
    inputs come second); None on a store error (the caller reads per session)."""
    later = {o.digest for _refs, resent in wanted for o, _i, _at in resent}
    first = {r.digest: r for refs, _resent in wanted for r in refs if r.digest not in later}
    try:
        got: dict[bytes, np.ndarray] = {}
        if first:
            read = await store.get_arrays(list(first.values()), cache=cache)
            got.update(zip(first, read, strict=True))
        for _refs, resent in wanted:
            derive_outputs(resent, got)
        underived = later - got.keys()
        rest = {r.digest: r for refs, _resent in wanted for r in refs if r.digest in underived}
        if rest:
            read = await store.get_arrays(list(rest.values()), cache=cache)
            got.update(zip(rest, read, strict=True))
    except StoreError:
        return None
    return got


async def load_session(
    store: EventStore, session_id: str, *, routed_experts: bool = False
) -> SessionLog:
    """All of one session's events and the arrays its reduction needs.

    Reads through the store's piece cache: the live server reduces a session
    right after writing it, and `replay show` may look at it again.
    """
    events = await store.read_session(session_id)
    return await session_log(store, session_id, events, routed_experts=routed_experts)


async def session_log(
    store: EventStore,
    session_id: str,
    events: Sequence[RecordedEvent],
    *,
    routed_experts: bool = False,
) -> SessionLog:
    """`load_session` for events already read (a caller that looks at them first,
    e.g. to key a cache by the session's last position)."""
    return await _session_log(store, session_id, list(events), routed_experts, cache=True)


async def iter_session_logs(
    store: EventStore,
    *,
    page_size: int = 1000,
    until: int | None = None,
    session_ids: Iterable[str] | None = None,
    sessions: SessionRange | None = None,
    routed_experts: bool = False,
) -> AsyncIterator[SessionLog]:
    """Every session of the log up to position `until` (default: the end now).

    A session is yielded when its `SessionClosed` arrives, or at the end of
    the log if it never closed. Arrays are read without caching (see the
    module docstring), so memory does not grow with the number of sessions. A
    session that gets events after it was yielded (a late reward, a retry
    re-opening it) is yielded again, later, in full: the later yield supersedes
    the earlier one. `sessions` reads only the ids in that range (the store
    filters the pages), for one worker of a parallel replay.
    """
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    if until is None:
        until = await store.last_position()
    wanted = set(session_ids) if session_ids is not None else None
    page_filter = {"sessions": sessions} if sessions is not None else {}
    buffers: dict[str, list[RecordedEvent]] = {}
    yielded: set[str] = set()
    dirty: dict[str, int] = {}  # session -> position of its first late event
    ready: list[_Ready] = []  # closed, in yield order, arrays not read yet
    after = 0
    while after < until:
        page = await store.read_all(after=after, limit=page_size, **page_filter)
        if not page:
            break
        for rec in page:
            if rec.position > until:
                break
            sid = rec.session_id
            if wanted is not None and sid not in wanted:
                continue
            if sid in yielded:
                if isinstance(rec.event, SessionOpened) and sid not in dirty:
                    yielded.discard(sid)  # a clean restart: buffer it afresh
                else:
                    dirty.setdefault(sid, rec.position)
                    continue
            buf = buffers.get(sid)
            if buf is None:
                buf = buffers[sid] = []
            buf.append(rec)
            if isinstance(rec.event, SessionClosed):
                del buffers[sid]
                yielded.add(sid)
                ready.append((sid, buf, (0, rec.position)))
                if len(ready) >= ARRAY_BATCH:
                    for log in await _session_logs(store, ready, routed_experts, cache=False):
                        yield log
                    ready = []
        # Before the next page: a session is yielded within a page of its close.
        if ready:
            for log in await _session_logs(store, ready, routed_experts, cache=False):
                yield log
            ready = []
        after = page[-1].position
        if page[-1].position > until or len(page) < page_size:
            break
    for sid, buf in list(buffers.items()):
        del buffers[sid]
        if sid in dirty:
            continue
        yielded.add(sid)
        yield await _session_log(
            store, sid, buf, routed_experts, cache=False, order=(1, buf[0].position)
        )
    for sid, first_late in dirty.items():
        events = [e for e in await store.read_session(sid) if e.position <= until]
        yield await _session_log(
            store, sid, events, routed_experts, cache=False, order=(2, first_late)
        )
