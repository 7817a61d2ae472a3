"""The event store over SQLAlchemy async Core: the logic both backends share.

Backends (`sqlite.py`, `postgres.py`) subclass `SqlEventStore` and supply
only what differs: engines, the dialect's INSERT (for ON CONFLICT), how
writers serialise, and how positions are allocated.

Write path: every append and array put goes through one `GroupCommitter`
per store. A group is one transaction that (1) takes the backend's writer
lock, (2) checks that every array piece's parent and basis is stored or
written by the group, (3) checks each append's idempotency and expected seq
against the database *inside* the locked transaction, (4) inserts the array
pieces (ON CONFLICT DO NOTHING; an append's pieces travel with its events),
(5) allocates one contiguous run of positions for the accepted events, in
queue order, and inserts them. A request that fails its check fails alone;
the rest of the group commits.

Fast path: each backend first tries the group as a *plain* group (no
expected_seq mismatch, no re-sent event id, no unknown array parent or
basis) in as few driver calls as it can (`_write_plain_group`: one thread
hop on SQLite, three round trips on Postgres). Anything else rolls back and
is redone on the generic path (the steps above), so every edge case is
handled in one place. `PlainGroup` is the planning both fast paths share
(`write_requests.py`, with the requests themselves: pure, no I/O).

The generic path is optimistic about idempotency too: the group is first
written without looking its event ids up, relying on the unique index on
event_id. When that insert fails (typically a batch re-sent after a lost
acknowledgement), the group is redone with every id looked up, and re-sent
batches get their original positions. If even that fails, each request gets
its own transaction so one bad request cannot sink its neighbours.

`NewEvent.ts == 0.0` means "unset": the store stamps the append time.

One module (~960 lines) on purpose: `SqlEventStore` is the one implementation
of the `EventStore` contract both backends share, and its write path (group
commit, fast path, generic path, idempotent re-sends, array pieces travelling
with their events) is one transaction's steps, which must be read together.
What the steps are given (the requests, a plain group's layout) is in
`write_requests.py`.
"""

from __future__ import annotations

import abc
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
import numpy as np
import sqlalchemy as sa
import zstandard
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from recorder.log.events import (
    ArrayRef,
    DType,
    NewEvent,
    RecordedEvent,
    decode_event,
    encode_event,
    type_name,
)
from recorder.log.store import arrays as arr
from recorder.log.store.base import (
    ArrayNotFound,
    ConcurrencyConflict,
    EventStore,
    IdempotencyConflict,
    SessionRange,
    StorageUnavailable,
    StoreError,
)
from recorder.log.store.group_commit import GroupCommitter
from recorder.log.store.pieces import PieceReader, chain, chunks
from recorder.log.store.tables import arrays, events, projection_names, projections
from recorder.log.store.write_requests import (
    AppendRequest,
    EventRow,
    GroupRequest,
    NewRow,
    PiecesRequest,
)

# Bound on events + pieces per group transaction (keeps a group's latency and
# memory modest while still amortising the commit over thousands of rows).
MAX_GROUP_WEIGHT = 20_000
# Bound on the arrays one cold array read may have to decode through bases
# (see `SqlEventStore.put_array`'s `basis`).
MAX_BASIS_DEPTH = 16
# Recently used bases kept per store with their depth and, once built, their
# prepared dictionary (each ~ its basis + 1 MiB).
BASIS_DICTIONARIES = 8
# Default cache sizes (see `StoreOptions`).
PIECE_CACHE_BYTES = 256 * 1024 * 1024
# SQLite's page cache keeps every page a connection touched until it is full.
# The writer only appends: what it touched is what it just wrote (never read
# again by it) plus a few index pages per session. A large cache there grew
# with the log (~0.35 MB per open 100k session at 64 MiB). Reads of what was
# just written are served from the OS page cache and the decoded-piece cache.
# (`recorder serve` gives each reader a quarter of the writer's: --sqlite-cache-mb.)
WRITER_PAGE_CACHE_BYTES = 4 * 1024 * 1024
READER_PAGE_CACHE_BYTES = 16 * 1024 * 1024

_PIECE_COLUMNS = (
    arrays.c.digest,
    arrays.c.parent,
    arrays.c.dtype,
    arrays.c.total_length,
    arrays.c.codec,
    arrays.c.data,
    arrays.c.data_tail,
    arrays.c.basis,
    arrays.c.basis_depth,
)

_EVENT_COLUMNS = (
    events.c.position,
    events.c.session_id,
    events.c.seq,
    events.c.event_id,
    events.c.type,
    events.c.version,
    events.c.ts,
    events.c.payload,
)


class StoreOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How much memory one open store may spend on caches.

    The defaults suit the live server, which reads back arrays it wrote
    moments ago (each turn's prompt extends the previous one: kept decoded in
    the piece cache) and writes many small transactions (which touch the
    table's tail and one index page per session). A one-pass reader (`replay reclassify/export/stats`)
    reuses nothing across sessions: `StoreOptions.streaming()` keeps it lean.

    - `piece_cache_bytes`: bound on the decoded-array-piece LRU, counting each
      entry's bookkeeping too (0 disables the cache).
    - `writer_page_cache_bytes` / `reader_page_cache_bytes`: SQLite's page
      cache per connection (one writer connection, up to a dozen readers;
      SQLite's own default is 2 MiB). PostgreSQL caches on the server and
      ignores both.
    - `inline_reads`: SQLite reads events and arrays on the event loop's
      thread (it blocks the loop for each query): ~0.3 ms less CPU per page
      or piece round than aiosqlite's hops. PostgreSQL ignores it.
    """

    def __post_init__(self) -> None:
        for name in ("piece_cache_bytes", "writer_page_cache_bytes", "reader_page_cache_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"StoreOptions.{name} must be an int >= 0 bytes, got {value!r}")

    piece_cache_bytes: int = PIECE_CACHE_BYTES
    writer_page_cache_bytes: int = WRITER_PAGE_CACHE_BYTES
    reader_page_cache_bytes: int = READER_PAGE_CACHE_BYTES
    # Reads run on the caller's thread, on a connection of their own, where a
    # backend can (SQLite): for a reader that does nothing but read, in a loop
    # that has nothing else to do meanwhile (see `SqliteEventStore`).
    inline_reads: bool = False

    @classmethod
    def streaming(cls) -> StoreOptions:
        """Caches for a one-pass read of the whole log: no piece cache, small page caches."""
        return cls(
            piece_cache_bytes=0,
            writer_page_cache_bytes=2 * 1024 * 1024,
            reader_page_cache_bytes=4 * 1024 * 1024,
            inline_reads=True,
        )


# Event class -> (stored type name, VERSION), filled as `append` meets each class.
_TYPE_META: dict[type, tuple[str, int]] = {}


@dataclass(slots=True)
class _GroupPlan:
    """What one group transaction will write, and each request's outcome."""

    new_rows: list[NewRow] = field(default_factory=list)
    # request -> rows whose positions it returns (new or previously stored)
    answers: dict[int, list[EventRow]] = field(default_factory=dict)
    errors: dict[int, StoreError] = field(default_factory=dict)
    # First free position, when the backend learnt it while reading the heads.
    next_position: int | None = None


def _records(rows: Iterable[Any]) -> list[RecordedEvent]:
    """Event rows (`_EVENT_COLUMNS`, event_id as a UUID) as recorded events, in
    one comprehension: a replay reads every event of the log."""
    return [
        RecordedEvent(
            position=position,
            session_id=session_id,
            seq=seq,
            event_id=event_id,
            ts=ts,
            version=version,
            event=decode_event(type_, version, payload),
        )
        for position, session_id, seq, event_id, type_, version, ts, payload in rows
    ]


class SqlEventStore(EventStore):
    """`EventStore` on two engines: one for the single writer, one for readers."""

    dialect_insert: ClassVar[Callable[[sa.Table], Any]]
    # Array pieces' compressed bytes are split so `arrays.data` holds whole
    # chunks of this size and `arrays.data_tail` the rest (None: no split).
    # Postgres sets its TOAST chunk size so out-of-line pages pack full.
    array_chunk_bytes: ClassVar[int | None] = None

    def __init__(
        self,
        url: str,
        write_engine: AsyncEngine,
        read_engine: AsyncEngine,
        options: StoreOptions | None = None,
    ) -> None:
        self.url = url
        self.options = options or StoreOptions()
        self.write_engine = write_engine
        self.read_engine = read_engine
        self._writer: GroupCommitter[GroupRequest] = GroupCommitter(
            self._commit_group, max_weight=MAX_GROUP_WEIGHT
        )
        self._pieces = arr.PieceCache(self.options.piece_cache_bytes)
        self._reader = PieceReader(self._reading, self._pieces, self._piece_rows, self._chain_rows)
        # Recently used bases, least recent first: basis digest -> (its prepared
        # zstd dictionary if built yet, its chain depth). A body stored as
        # prefix + suffix encodes both against one basis without reading it twice.
        self._basis_dicts: dict[bytes, tuple[zstandard.ZstdCompressionDict | None, int]] = {}
        # Test hook: awaited inside each write transaction just before COMMIT
        # (on the fast path too).
        self.before_commit: Callable[[], Awaitable[None]] | None = None
        # False forces every group onto the generic path (benchmarks, tests).
        self.fast_writes = True
        # Groups each path committed (one handed back by the fast path counts as generic).
        self.fast_groups = 0
        self.generic_groups = 0

    @property
    def piece_cache(self) -> arr.PieceCache:
        """The decoded-piece LRU (read it to see what this store holds in memory)."""
        return self._pieces

    @property
    def max_group_weight(self) -> int:
        """Events + array pieces one group transaction may carry (1 = no grouping)."""
        return self._writer.max_weight

    @max_group_weight.setter
    def max_group_weight(self, value: int) -> None:
        self._writer.max_weight = max(1, value)

    # -- backend hooks ------------------------------------------------------

    def _reading(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """A read connection for the read hooks (`_raw_events`, `_piece_rows`, ...):
        the read engine's; a backend may hand its own (`StoreOptions.inline_reads`)."""
        return self.read_engine.connect()

    @abc.abstractmethod
    async def _lock_writers(self, conn: AsyncConnection) -> None:
        """Serialise write transactions (held until commit)."""

    @abc.abstractmethod
    async def _allocate_positions(self, conn: AsyncConnection, n: int) -> int:
        """Reserve `n` consecutive positions; return the first. Called under the lock."""

    @abc.abstractmethod
    async def _read_heads(
        self, conn: AsyncConnection, session_ids: set[str]
    ) -> tuple[dict[str, int], int | None]:
        """Next seq of each session; also the first free position if the backend
        can read it here (under the writer lock), saving `_allocate_positions`."""

    async def _write_plain_group(self, group: list[GroupRequest]) -> list[list[int] | None] | None:
        """Commit `group` if it is plain and return each request's result; else
        (or on any error) write nothing and return None. Backends override."""
        return None

    async def _after_bulk_copy(self, conn: AsyncConnection) -> None:
        """Fix up identity counters after rows were inserted with explicit keys."""

    # -- events: write ------------------------------------------------------

    async def append(
        self,
        session_id: str,
        events: Sequence[NewEvent],
        *,
        expected_seq: int | None = None,
        arrays: Sequence[arr.EncodedArray] = (),
        durable: bool = True,
    ) -> list[int]:
        if not events:
            if arrays:
                await self._put_encoded(arrays)
            return []
        now = time.time()
        rows = []
        for ne in events:  # the hottest loop of a batched append: one lookup per event type
            event = ne.event
            meta = _TYPE_META.get(type(event))
            if meta is None:
                meta = _TYPE_META[type(event)] = (type_name(event), type(event).VERSION)
            rows.append(EventRow(ne.event_id, meta[0], meta[1], ne.ts or now, encode_event(event)))
        if len({ne.event_id.int for ne in events}) != len(rows):
            raise IdempotencyConflict("a batch lists the same event_id twice; ids must be unique")
        pieces, decoded = self._unstored_pieces(arrays)
        result: list[int] = await self._submit(
            AppendRequest(session_id, rows, expected_seq, pieces, durable)
        )
        self._learn(decoded)
        return result

    def _unstored_pieces(
        self, arrays: Sequence[arr.EncodedArray]
    ) -> tuple[list[arr.Piece], list[arr.DecodedPiece]]:
        """The pieces of `arrays` still to write (a cached piece is already stored), and
        those of them to cache once durable."""
        pieces: list[arr.Piece] = []
        decoded: list[arr.DecodedPiece] = []
        for encoded in arrays:
            for piece, dec in zip(encoded.pieces, encoded.decoded, strict=True):
                if self._pieces.get(piece.digest) is None:
                    pieces.append(piece)
                    if encoded.cache:
                        decoded.append(dec)
        return pieces, decoded

    def _learn(self, decoded: Iterable[arr.DecodedPiece]) -> None:
        """Cache pieces once they are durable (the cache only holds stored pieces)."""
        for piece in decoded:
            self._pieces.put(piece)

    async def _put_encoded(self, arrays: Sequence[arr.EncodedArray], *, cache: bool = True) -> None:
        pieces, decoded = self._unstored_pieces(arrays)
        if pieces:
            await self._submit(PiecesRequest(pieces))
            if cache:
                self._learn(decoded)

    def as_unavailable(self, exc: BaseException) -> StorageUnavailable | None:
        failure = storage_failure(exc)
        if failure is None:
            return None
        self.write_failure = failure
        return StorageUnavailable(f"the event log cannot be reached: {failure}")

    async def _submit(self, request: GroupRequest) -> Any:
        """The one seam where a write's storage failure becomes `StorageUnavailable`."""
        try:
            result = await self._writer.submit(request)
        except StoreError:
            self.write_failure = None  # the database answered: a conflict is not an outage
            raise
        except Exception as exc:
            failure = storage_failure(exc)
            if failure is None:
                raise  # a bug or a bad request, not an outage
            self.write_failure = failure
            raise StorageUnavailable(f"the event log cannot be written: {failure}") from exc
        self.write_failure = None
        return result

    async def _commit_group(self, group: list[GroupRequest]) -> None:
        if self.fast_writes:
            results = await self._write_plain_group(group)
            if results is not None:
                self.fast_groups += 1
                for request, result in zip(group, results, strict=True):
                    request.resolve(result)
                return
        self.generic_groups += 1
        await self._commit_generic(group)

    async def _commit_generic(self, group: list[GroupRequest]) -> None:
        # First try: let the unique index on event_id catch re-sent ids. Only
        # if the insert fails (a retry after a lost ack, usually) do we redo the
        # group looking every id up first; if even that fails, each request
        # gets its own transaction so the culprit fails alone.
        try:
            plan = await self._write_group(group, look_up_ids=False)
        except Exception:
            try:
                plan = await self._write_group(group, look_up_ids=True)
            except Exception as e:
                if len(group) == 1:
                    group[0].fail(e)
                    return
                for request in group:
                    await self._commit_generic([request])
                return
        for i, request in enumerate(group):
            if i in plan.errors:
                request.fail(plan.errors[i])
            elif isinstance(request, AppendRequest):
                request.resolve([r.position for r in plan.answers[i]])
            else:
                request.resolve(None)

    async def _write_group(self, group: list[GroupRequest], *, look_up_ids: bool) -> _GroupPlan:
        async with self.write_engine.begin() as conn:
            await self._lock_writers(conn)
            plan = _GroupPlan()
            carrying = [(i, r.pieces) for i, r in enumerate(group) if r.pieces]
            if carrying:
                external = arr.external_bases(p for _, ps in carrying for p in ps)
                present = await self._present_digests(conn, list(external)) if external else set()
                plan.errors.update(arr.missing_bases(carrying, present))
            appends = [
                (i, r)
                for i, r in enumerate(group)
                if isinstance(r, AppendRequest) and i not in plan.errors
            ]
            if appends:
                await self._plan_appends(conn, appends, plan, look_up_ids=look_up_ids)
            # Pieces of appends refused for concurrency/idempotency are written too.
            pieces = [
                p
                for i, ps in carrying
                if not isinstance(plan.errors.get(i), ArrayNotFound)
                for p in ps
            ]
            if pieces:
                await self._insert_pieces(conn, pieces)
            if plan.new_rows:
                first = plan.next_position
                if first is None:
                    first = await self._allocate_positions(conn, len(plan.new_rows))
                for offset, (_, _, row) in enumerate(plan.new_rows):
                    row.position = first + offset
                await self._insert_events(conn, plan.new_rows)
            if self.before_commit is not None:
                await self.before_commit()
        return plan

    async def _insert_events(self, conn: AsyncConnection, rows: list[NewRow]) -> None:
        """Insert planned rows (positions assigned). Backends override with raw driver calls."""
        await conn.execute(
            events.insert(),
            [
                {
                    "position": r.position,
                    "session_id": session_id,
                    "seq": seq,
                    "event_id": r.event_id,
                    "type": r.type,
                    "version": r.version,
                    "ts": r.ts,
                    "payload": r.payload,
                }
                for session_id, seq, r in rows
            ],
        )

    async def _plan_appends(
        self,
        conn: AsyncConnection,
        appends: list[tuple[int, AppendRequest]],
        plan: _GroupPlan,
        *,
        look_up_ids: bool,
    ) -> None:
        stored = (
            await self._stored_by_id(conn, [row.event_id for _, r in appends for row in r.rows])
            if look_up_ids
            else {}
        )
        next_seq, plan.next_position = await self._read_heads(
            conn, {r.session_id for _, r in appends}
        )
        pending: dict[uuid.UUID, tuple[str, EventRow]] = {}
        for i, request in appends:
            known = (
                [stored.get(row.event_id) or pending.get(row.event_id) for row in request.rows]
                if stored or pending
                else []
            )
            if any(k is not None for k in known):
                _record_outcome(plan, i, _resend_outcome(request, known))
                continue
            seq = next_seq.get(request.session_id, 0)
            if request.expected_seq is not None and request.expected_seq != seq:
                outcome: list[EventRow] | StoreError = ConcurrencyConflict(
                    request.session_id, request.expected_seq, seq
                )
                if not look_up_ids:  # a retry after a lost ack also arrives at a stale seq
                    found = await self._stored_by_id(conn, [r.event_id for r in request.rows])
                    if found:
                        outcome = _resend_outcome(
                            request, [found.get(r.event_id) for r in request.rows]
                        )
                _record_outcome(plan, i, outcome)
                continue
            sid = request.session_id
            plan.new_rows.extend((sid, seq + k, row) for k, row in enumerate(request.rows))
            if look_up_ids:  # on the fast path the unique index catches in-group repeats
                pending.update((row.event_id, (sid, row)) for row in request.rows)
            next_seq[sid] = seq + len(request.rows)
            plan.answers[i] = request.rows

    async def _stored_by_id(
        self, conn: AsyncConnection, ids: list[uuid.UUID]
    ) -> dict[uuid.UUID, tuple[str, EventRow]]:
        found: dict[uuid.UUID, tuple[str, EventRow]] = {}
        cols = (events.c.session_id, events.c.event_id, events.c.type, events.c.version)
        for chunk in chunks(ids):
            stmt = sa.select(*cols, events.c.ts, events.c.payload, events.c.position).where(
                events.c.event_id.in_(chunk)
            )
            for session_id, event_id, type_, version, ts, payload, position in await conn.execute(
                stmt
            ):
                found[event_id] = (
                    session_id,
                    EventRow(event_id, type_, version, ts, payload, position),
                )
        return found

    # -- events: read -------------------------------------------------------

    async def read_session(self, session_id: str, *, from_seq: int = 0) -> list[RecordedEvent]:
        async with self._reading() as conn:
            return _records(await self._raw_session(conn, session_id, from_seq))

    async def _raw_session(
        self, conn: AsyncConnection, session_id: str, from_seq: int
    ) -> Sequence[Any]:
        """Rows of `_EVENT_COLUMNS` (event_id as a UUID) of the session from `from_seq` on.

        Backends read through their driver: a replica checks a session's head
        with this before every turn, usually one index probe that finds
        nothing, and SQLAlchemy's statement handling costs more than that.
        """
        stmt = (
            sa.select(*_EVENT_COLUMNS)
            .where(events.c.session_id == session_id, events.c.seq >= from_seq)
            .order_by(events.c.seq)
        )
        return list(await conn.execute(stmt))

    async def read_session_from_last(
        self, session_id: str, types: Sequence[str]
    ) -> list[RecordedEvent]:
        async with self._reading() as conn:
            return _records(await self._raw_from_last(conn, session_id, types))

    async def _raw_from_last(
        self, conn: AsyncConnection, session_id: str, types: Sequence[str]
    ) -> Sequence[Any]:
        """Rows of `_EVENT_COLUMNS` of the session from its newest event of `types` on.

        The newest matching seq is found walking the (session_id, seq) index
        backwards: a few rows when the session's last turn wrote a snapshot.
        """
        newest = (
            sa.select(events.c.seq)
            .where(events.c.session_id == session_id, events.c.type.in_(list(types)))
            .order_by(events.c.seq.desc())
            .limit(1)
            .scalar_subquery()
        )
        stmt = (
            sa.select(*_EVENT_COLUMNS)
            .where(events.c.session_id == session_id, events.c.seq >= sa.func.coalesce(newest, 0))
            .order_by(events.c.seq)
        )
        return list(await conn.execute(stmt))

    async def read_all(
        self, *, after: int = 0, limit: int = 1000, sessions: SessionRange | None = None
    ) -> list[RecordedEvent]:
        async with self._reading() as conn:
            return _records(await self._raw_events(conn, after, limit, sessions))

    async def _raw_events(
        self, conn: AsyncConnection, after: int, limit: int, sessions: SessionRange | None = None
    ) -> Sequence[Any]:
        """Rows of `_EVENT_COLUMNS` (event_id as a UUID) after `after`, in position order.

        A session range compares ids byte-wise (`COLLATE "C"`: UTF-8 byte order
        is code point order, Python's, whatever the database's collation), which
        also keeps the planner on the position index: the page stays a keyset
        scan that skips other sessions' rows without sorting a range's events.
        """
        stmt = sa.select(*_EVENT_COLUMNS).where(events.c.position > after)
        if sessions is not None:
            sid = events.c.session_id.collate("C")
            lo, hi = sessions
            if lo is not None:
                stmt = stmt.where(sid >= lo)
            if hi is not None:
                stmt = stmt.where(sid < hi)
        return list(await conn.execute(stmt.order_by(events.c.position).limit(limit)))

    async def closes_after(self, after: int) -> tuple[int, list[str]]:
        # Positions are allocated under the writer lock, in commit order: no
        # close at or below the head read here can commit later.
        async with self.read_engine.connect() as conn:
            head = int(await conn.scalar(sa.select(sa.func.max(events.c.position))) or 0)
            stmt = (
                sa.select(events.c.session_id)
                .where(
                    events.c.position > after,
                    events.c.position <= head,
                    events.c.type == "session_closed",
                )
                .order_by(events.c.position)
            )
            return max(head, after), list(await conn.scalars(stmt))

    async def session_sizes(self) -> dict[str, int]:
        # One scan of the (session_id, seq) index, which covers it.
        first = sa.func.min(events.c.position)
        stmt = (
            sa.select(events.c.session_id, sa.func.count(), first)
            .group_by(events.c.session_id)
            .order_by(first)
        )
        async with self.read_engine.connect() as conn:
            return {r[0]: int(r[1]) for r in await conn.execute(stmt)}

    async def last_position(self) -> int:
        async with self.read_engine.connect() as conn:
            value = await conn.scalar(sa.select(sa.func.max(events.c.position)))
        return int(value or 0)

    # -- arrays -------------------------------------------------------------

    async def put_array(
        self,
        array: np.ndarray,
        *,
        extends: ArrayRef | None = None,
        basis: ArrayRef | None = None,
        basis_offset: int | None = None,
        cache: bool = True,
        along: Sequence[arr.EncodedArray] = (),
        into: list[arr.EncodedArray] | None = None,
        prior: np.ndarray | bytes | None = None,
    ) -> ArrayRef:
        if basis is None:
            encoded = arr.encode_array(array, extends=extends, prior=prior)
        else:
            encoded = await self._encode_with_basis(array, extends, basis, basis_offset)
        if into is not None:
            into.extend(
                a if a.cache == cache else msgspec.structs.replace(a, cache=cache)
                for a in (*along, encoded)
            )
            return encoded.ref
        await self._put_encoded([*along, encoded], cache=cache)
        if basis is not None and basis_offset is None:
            self._supersede(basis, encoded.ref)
        return encoded.ref

    async def _encode_with_basis(
        self,
        array: np.ndarray,
        extends: ArrayRef | None,
        basis: ArrayRef,
        basis_offset: int | None,
    ) -> arr.EncodedArray:
        """The `EncodedArray` of `put_array(..., basis=)`, with or without `basis_offset`."""
        suffix, dtype = arr.as_suffix(array, extends.dtype if extends is not None else None)
        if extends is not None and len(suffix) == 0:
            return arr.EncodedArray(extends)
        if basis_offset is not None:
            piece, suffix = await self._encode_copy(suffix, dtype, extends, basis, basis_offset)
        else:
            piece, suffix = await self._encode_on_basis(suffix, dtype, extends, basis)
        suffix.setflags(write=False)
        decoded = arr.DecodedPiece(
            piece.digest, piece.parent, dtype, piece.total_length, suffix, piece.depth
        )
        ref = ArrayRef(piece.digest, piece.total_length, dtype)
        return arr.EncodedArray(ref, (piece,), (decoded,))

    def release(self, old: ArrayRef, keep: Sequence[ArrayRef]) -> None:
        kept: set[bytes] = set()
        for ref in keep:
            kept |= self._pieces.chain_digests(ref.digest)
        self._pieces.discard(d for d in self._pieces.chain_digests(old.digest) if d not in kept)

    async def _encode_copy(
        self, suffix: np.ndarray, dtype: DType, extends: ArrayRef | None, basis: ArrayRef, at: int
    ) -> tuple[arr.Piece, np.ndarray]:
        """(piece to store, its suffix) for `put_array(..., basis=, basis_offset=)`.

        The basis is read (from the piece cache when hot) and its bytes at
        `at` compared with the suffix: a mismatch raises ValueError, nothing
        is stored. Past `MAX_BASIS_DEPTH` the suffix is stored plainly.
        """
        pieces = await self._reader.load([basis.digest], cache=True)
        basis_chain = chain(pieces, basis.digest)
        if arr.chain_depth(basis_chain) + 1 > MAX_BASIS_DEPTH:
            return arr.encode_piece(suffix, dtype, extends), suffix
        raw = suffix.tobytes()
        piece = arr.encode_copy_piece(raw, dtype, extends, basis, basis_chain, at)
        return piece, np.frombuffer(raw, arr.NUMPY_DTYPES[dtype])

    def _supersede(self, basis: ArrayRef, new: ArrayRef) -> None:
        """The basis's cached pieces that `new`'s chain does not use leave the piece cache.

        A basis is the previous version of what is stored now (a session's
        previous request body): once the new version is stored, nothing reads
        the old one's own pieces hot, and keeping them would add one old tail
        (system prompt and tools, ~70 kB for Claude Code) per turn, and one whole
        body per rebase, until the cache is full. They stay stored; the basis's
        depth and dictionary stay in `_basis_dicts` for the next piece on it.
        """
        kept = self._pieces.chain_digests(new.digest)
        self._pieces.discard(d for d in self._pieces.chain_digests(basis.digest) if d not in kept)

    async def _encode_on_basis(
        self, suffix: np.ndarray, dtype: DType, extends: ArrayRef | None, basis: ArrayRef
    ) -> tuple[arr.Piece, np.ndarray]:
        """(piece to store, its suffix) for `put_array(..., basis=basis)`.

        Bounds cold reads: an array may depend on at most `MAX_BASIS_DEPTH`
        bases in turn. Past that, a suffix whose prefix chain is already that
        deep is stored with its prefix as one plain root piece (a fresh start
        for the chains built on it), and otherwise plainly after its prefix.
        """
        known = self._basis_dicts.pop(basis.digest, None)
        wanted = [] if extends is None else [extends]
        if known is None:
            wanted.append(basis)
        pieces = await self._reader.load([r.digest for r in wanted], cache=True)
        basis_chain = chain(pieces, basis.digest) if known is None else []
        dictionary, basis_depth = known or (None, arr.chain_depth(basis_chain))
        prefix_chain = chain(pieces, extends.digest) if extends is not None else []
        prefix_depth = arr.chain_depth(prefix_chain) if prefix_chain else 0
        if max(prefix_depth, basis_depth + 1) > MAX_BASIS_DEPTH:
            self._remember_basis(basis, dictionary, basis_depth)
            if prefix_depth < MAX_BASIS_DEPTH:
                return arr.encode_piece(suffix, dtype, extends), suffix
            whole = np.concatenate([*(p.suffix for p in prefix_chain), suffix])
            return arr.encode_piece(whole, dtype, None), whole
        if dictionary is None:
            if not basis_chain:  # known depth, no dictionary yet
                pieces = await self._reader.load([basis.digest], cache=True)
                basis_chain = chain(pieces, basis.digest)
            dictionary = arr.basis_dictionary(arr.chain_bytes(basis_chain))
        self._remember_basis(basis, dictionary, basis_depth)
        piece = arr.encode_piece_on_basis(suffix, dtype, extends, basis, dictionary, basis_depth)
        return piece, suffix

    def _remember_basis(
        self, basis: ArrayRef, dictionary: zstandard.ZstdCompressionDict | None, depth: int
    ) -> None:
        self._basis_dicts[basis.digest] = (dictionary, depth)
        while len(self._basis_dicts) > BASIS_DICTIONARIES:
            self._basis_dicts.pop(next(iter(self._basis_dicts)))

    async def _insert_pieces(self, conn: AsyncConnection, pieces: Iterable[arr.Piece]) -> None:
        """Insert pieces whose parents and bases are known present (ON CONFLICT DO NOTHING)."""
        unique = {p.digest: p for p in pieces}
        stmt = type(self).dialect_insert(arrays).on_conflict_do_nothing(index_elements=["digest"])
        await conn.execute(stmt, [self.piece_row(p) for p in unique.values()])

    def piece_row(self, p: arr.Piece) -> dict[str, Any]:
        """The `arrays` row that stores piece `p`."""
        return self.array_row(
            p.digest,
            p.parent,
            p.dtype,
            p.total_length,
            p.codec,
            p.data,
            basis=p.basis,
            basis_depth=p.depth,
        )

    def array_row(
        self,
        digest: bytes,
        parent: bytes | None,
        dtype: str,
        total_length: int,
        codec: int,
        blob: bytes,
        *,
        basis: bytes | None = None,
        basis_depth: int = 0,
    ) -> dict[str, Any]:
        """An `arrays` row for this backend, `blob` split as `array_chunk_bytes` says."""
        data, tail = arr.split_blob(blob, self.array_chunk_bytes)
        return {
            "digest": digest,
            "parent": parent,
            "dtype": dtype,
            "total_length": total_length,
            "codec": codec,
            "data": data,
            "data_tail": tail,
            "basis": basis,
            "basis_depth": basis_depth,
        }

    async def _present_digests(self, conn: AsyncConnection, digests: list[bytes]) -> set[bytes]:
        present: set[bytes] = set()
        for chunk in chunks(digests):
            stmt = sa.select(arrays.c.digest).where(arrays.c.digest.in_(chunk))
            present.update(bytes(d) for d in await conn.scalars(stmt))
        return present

    async def get_array(self, ref: ArrayRef) -> np.ndarray:
        return (await self.get_arrays([ref]))[0]

    async def get_arrays(
        self, refs: Sequence[ArrayRef], *, cache: bool = True, cold: bool = False
    ) -> list[np.ndarray]:
        """Fetch every missing piece round by round (one IN query per chain depth).

        Cached pieces cost no query, so reading a session's turns in order
        fetches only each turn's new suffix. `cache=False` still uses what is
        cached but keeps nothing new: a one-pass reader leaves the cache as it
        found it. `cold=True` fetches the uncached arrays' whole piece chains
        in the first round (a recursive query): a chain grown over 100 turns
        costs one round trip instead of 100. All rounds share one connection.
        """
        return await self._reader.arrays(refs, cache=cache, cold=cold)

    async def _chain_rows(self, conn: AsyncConnection, digests: Sequence[bytes]) -> Iterable[Any]:
        """`_piece_rows` of `digests` and of every ancestor (parent, its parent, ...)."""
        rows: list[Any] = []
        for chunk in chunks(digests):
            seed = sa.select(arrays.c.digest.label("d")).where(arrays.c.digest.in_(chunk))
            chain = seed.cte("chain", recursive=True)
            up = arrays.alias("up")
            chain = chain.union(
                sa.select(up.c.parent).where(up.c.digest == chain.c.d, up.c.parent.is_not(None))
            )
            stmt = sa.select(*_PIECE_COLUMNS).where(arrays.c.digest.in_(sa.select(chain.c.d)))
            rows.extend(await conn.execute(stmt))
        return rows

    async def _piece_rows(self, conn: AsyncConnection, digests: Sequence[bytes]) -> Iterable[Any]:
        """(digest, parent, dtype, total_length, codec, data, data_tail, basis, basis_depth)
        per stored digest."""
        stmt = sa.select(*_PIECE_COLUMNS).where(arrays.c.digest.in_(digests))
        return await conn.execute(stmt)

    # -- projections --------------------------------------------------------

    async def save_projection(self, name: str, rows: Sequence[tuple[str, int, str, bytes]]) -> None:
        insert = type(self).dialect_insert
        async with self.write_engine.begin() as conn:
            await conn.execute(
                insert(projection_names).on_conflict_do_nothing(index_elements=["name"]),
                [{"name": name}],
            )
            if rows:
                stmt = insert(projections)
                stmt = stmt.on_conflict_do_update(
                    index_elements=["name", "session_id"],
                    set_={
                        "covers_position": stmt.excluded.covers_position,
                        "digest": stmt.excluded.digest,
                        "payload": stmt.excluded.payload,
                    },
                )
                await conn.execute(
                    stmt,
                    [
                        {
                            "name": name,
                            "session_id": s,
                            "covers_position": c,
                            "digest": d,
                            "payload": p,
                        }
                        for s, c, d, p in rows
                    ],
                )

    async def load_projection(self, name: str) -> dict[str, tuple[int, str, bytes]]:
        stmt = sa.select(
            projections.c.session_id,
            projections.c.covers_position,
            projections.c.digest,
            projections.c.payload,
        ).where(projections.c.name == name)
        async with self.read_engine.connect() as conn:
            return {s: (c, d, bytes(p)) for s, c, d, p in await conn.execute(stmt)}

    async def projection_names(self) -> list[str]:
        stmt = sa.select(projection_names.c.name).order_by(projection_names.c.ordinal)
        async with self.read_engine.connect() as conn:
            return list(await conn.scalars(stmt))

    # -- lifecycle ----------------------------------------------------------

    async def close(self) -> None:
        await self._writer.close()
        await self.write_engine.dispose()
        if self.read_engine is not self.write_engine:
            await self.read_engine.dispose()


def storage_failure(exc: BaseException) -> str | None:
    """A plain reason if `exc` means the storage cannot take writes now; None for other errors.

    Read from the driver's whole error chain, never shown to clients: it
    names hosts, ports and SQLAlchemy links.
    """
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__ or getattr(seen, "orig", None)
    text = " ".join(f"{type(e).__name__} {e}" for e in chain).lower()
    if "disk is full" in text or "no space left" in text or "diskfull" in text:
        return "the disk is full"
    if "store is closed" in text:
        return "the store is closed (the recorder is shutting down)"
    unreachable = ("connect", "shutting down", "starting up", "administrator command")
    if any(isinstance(e, OSError) for e in chain) or any(w in text for w in unreachable):
        return "the database is unreachable"
    return None


def _record_outcome(plan: _GroupPlan, i: int, outcome: list[EventRow] | StoreError) -> None:
    if isinstance(outcome, StoreError):
        plan.errors[i] = outcome
    else:
        plan.answers[i] = outcome


def _resend_outcome(
    request: AppendRequest, known: list[tuple[str, EventRow] | None]
) -> list[EventRow] | StoreError:
    """A batch naming stored ids: all identical -> the stored rows; else an error."""
    if any(k is None for k in known):
        return IdempotencyConflict(
            f"session {request.session_id!r}: the batch mixes already-stored event ids with "
            "new ones; re-send the original batch unchanged, or use fresh ids for new events"
        )
    out: list[EventRow] = []
    for row, k in zip(request.rows, known, strict=True):
        assert k is not None
        session_id, stored = k
        if (session_id, stored.type, stored.version, bytes(stored.payload)) != (
            request.session_id,
            row.type,
            row.version,
            row.payload,
        ):
            return IdempotencyConflict(
                f"event {row.event_id} is already stored with different content (session "
                f"{session_id!r}, type {stored.type!r}); an event id may only be re-sent with "
                "the identical event"
            )
        out.append(stored)
    return out
