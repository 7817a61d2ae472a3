"""The one store interface every backend implements (SQLite, Postgres).

Callers see only this module: `open_store(url)` in `recorder.log.store` picks the
backend from the URL. The shared test suite in `tests/store/` runs against
every backend.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Sequence

import numpy as np

from recorder.log.events import ArrayRef, NewEvent, RecordedEvent
from recorder.log.store.arrays import EncodedArray
from recorder.log.store.errors import (
    ArrayNotFound,
    ConcurrencyConflict,
    CorruptArray,
    IdempotencyConflict,
    SchemaOutOfDate,
    StorageUnavailable,
    StoreError,
)

__all__ = [
    "ArrayNotFound",
    "ConcurrencyConflict",
    "CorruptArray",
    "EventStore",
    "IdempotencyConflict",
    "ProjectionStore",
    "SchemaOutOfDate",
    "SessionLocks",
    "StorageUnavailable",
    "StoreError",
]


class SessionLocks:
    """Per-session locks across processes on one database; this one is a no-op.

    One process per database (SQLite, see `recorder serve`): the in-process
    session lock already serialises a session's turns. Postgres overrides
    it (`recorder.log.store.session_locks`).
    """

    async def lock(self, session_id: str) -> None:
        """Hold `session_id`'s lock across processes (returns once held)."""

    def unlock(self, session_id: str) -> None:
        """Let go of the lock (queued, never fails: a lost connection already let go)."""

    async def close(self) -> None:
        """Release every lock this process holds."""


# Session ids `lo <= id < hi` (code point order); None leaves that end open.
SessionRange = tuple[str | None, str | None]


class ProjectionStore(abc.ABC):
    """Derived data (samples per rules version) kept beside the log.

    Unlike events, projections are mutable: `replay reclassify` writes a new
    one per rules version and may overwrite its own rows when re-run.
    """

    @abc.abstractmethod
    async def save_projection(self, name: str, rows: Sequence[tuple[str, int, str, bytes]]) -> None:
        """Upsert rows of (session_id, covers_position, digest, payload) under `name`."""

    @abc.abstractmethod
    async def load_projection(self, name: str) -> dict[str, tuple[int, str, bytes]]:
        """session_id -> (covers_position, digest, payload) for one projection."""

    @abc.abstractmethod
    async def projection_names(self) -> list[str]:
        """Projections in the order they were first written."""


class EventStore(ProjectionStore):
    """An append-only event log plus a content-addressed array store.

    Sequence numbers (`seq`) count per session from 0. Positions are global,
    increasing in commit order as seen by `read_all`/`follow` (gaps allowed,
    never filled later).
    """

    url: str
    # Why the last write failed for want of storage, or None once a write
    # succeeds again: what `/health` reports.
    write_failure: str | None = None
    # Held by a server for each turn (and close) of a session; see SessionLocks.
    session_locks: SessionLocks = SessionLocks()

    def as_unavailable(self, exc: BaseException) -> StorageUnavailable | None:
        """`exc` as a `StorageUnavailable` (and remembered for `/health`) if it means the
        storage cannot be reached now; None for any other error (a bug, a conflict)."""
        return None

    # -- events ---------------------------------------------------------

    @abc.abstractmethod
    async def append(
        self,
        session_id: str,
        events: Sequence[NewEvent],
        *,
        expected_seq: int | None = None,
        arrays: Sequence[EncodedArray] = (),
        durable: bool = True,
    ) -> list[int]:
        """Append a batch atomically; return the global positions.

        `expected_seq` is the seq the first event must get (optimistic
        concurrency): on mismatch raise `ConcurrencyConflict`, writing no
        event. None appends at the end. Re-sending a batch whose event ids
        are all stored with identical payloads returns the original positions
        and writes nothing new; a known id with a different payload raises
        `IdempotencyConflict`.

        `arrays` (from `recorder.log.store.arrays.encode_array`) are written in
        the same transaction as the events, so the refs the events name are
        durable when this returns, at the cost of one commit instead of one
        per array. An `extends=` parent this database does not hold raises
        `ArrayNotFound` and writes nothing. An append refused inside the
        transaction (`ConcurrencyConflict`, `IdempotencyConflict` for a stored
        id) still writes its arrays: pieces are content-addressed, so they
        are harmless alone and a retry finds them stored. With no events,
        `arrays` are simply stored.

        `durable=False`: the commit may skip its flush to disk (an fsync on
        SQLite, the WAL flush on Postgres). The batch is visible at once and
        survives a crash of this process; it survives power loss with the next
        durable commit, whose flush covers everything written before it. For
        events nothing is acknowledged on before a later durable append of the
        same session (a turn's request and engine attempt, recorded while the
        engine works; its answer is appended durably before the client sees it).
        """

    @abc.abstractmethod
    async def read_session(self, session_id: str, *, from_seq: int = 0) -> list[RecordedEvent]:
        """All events of one session in seq order."""

    async def read_session_from_last(
        self, session_id: str, types: Sequence[str]
    ) -> list[RecordedEvent]:
        """The session's events from its newest event of one of `types` on, in seq order
        (all of them if it has none).

        Lets a restart read a session from its newest snapshot or attempt
        without reading its whole history; backends do it in one query.
        """
        events = await self.read_session(session_id)
        wanted = set(types)
        for i in range(len(events) - 1, -1, -1):
            if events[i].type in wanted:
                return events[i:]
        return events

    @abc.abstractmethod
    async def read_all(
        self, *, after: int = 0, limit: int = 1000, sessions: SessionRange | None = None
    ) -> list[RecordedEvent]:
        """One keyset page of events with position > `after`, in position order.

        Never returns an event while an earlier-positioned one may still commit
        (so a reader that pages with the last position it saw misses nothing).
        `sessions` keeps only the events of session ids in that range (compared
        as code points, as Python compares str): a parallel replay worker pages
        through its own sessions without decoding anyone else's events.
        """

    async def follow(
        self, *, after: int = 0, page_size: int = 1000, poll_interval: float = 0.05
    ) -> AsyncIterator[RecordedEvent]:
        """Tail the log forever from `after`, yielding every committed event once."""
        import anyio

        while True:
            page = await self.read_all(after=after, limit=page_size)
            for ev in page:
                yield ev
                after = ev.position
            if len(page) < page_size:
                await anyio.sleep(poll_interval)

    async def closes_after(self, after: int) -> tuple[int, list[str]]:
        """The log's head position and the ids of the sessions closed in (`after`, head].

        What a replica polls to learn of closes other processes served (it
        passes the head back as the next `after`). Backends do it in one query;
        this default pages through the whole log.
        """
        head, closed = after, []
        while True:
            page = await self.read_all(after=head, limit=1000)
            for event in page:
                head = event.position
                if event.type == "session_closed":
                    closed.append(event.session_id)
            if len(page) < 1000:
                return head, closed

    async def session_ids(self) -> list[str]:
        """Every session id in the log, in order of first appearance."""
        return list(await self.session_sizes())

    @abc.abstractmethod
    async def session_sizes(self) -> dict[str, int]:
        """Every session id in the log (in order of first appearance) -> its number
        of events: how a parallel replay weighs sessions when it splits them."""

    @abc.abstractmethod
    async def last_position(self) -> int:
        """The highest committed position (0 for an empty log)."""

    # -- arrays ---------------------------------------------------------

    @abc.abstractmethod
    async def put_array(
        self,
        array: np.ndarray,
        *,
        extends: ArrayRef | None = None,
        basis: ArrayRef | None = None,
        basis_offset: int | None = None,
        cache: bool = True,
        along: Sequence[EncodedArray] = (),
        into: list[EncodedArray] | None = None,
        prior: np.ndarray | bytes | None = None,
    ) -> ArrayRef:
        """Store a 1-D array now; return its ref.

        An array that events will name costs one commit less when passed to
        `append(..., arrays=[encode_array(...)])` with those events instead.

        With `extends`, `array` is only the suffix to append to the array that
        `extends` names: the prefix is shared, not stored again.

        With `basis` (any stored array, typically the previous version of this
        one), the new piece is compressed against the basis's content, so what
        repeats it costs almost nothing. The ref names content only: it is the
        same with or without `basis`, unless the store bounds a long basis
        chain by storing the whole array afresh (then it is the ref of the
        whole array stored without `extends`).

        With `basis` and `basis_offset`, the new piece is the basis's bytes
        from that byte offset (a copy: 16 bytes stored, nothing compressed);
        ValueError, nothing stored, when those bytes are not the piece's.

        `cache=False`: the new piece stays out of the store's piece cache (an
        array nothing reads hot: a request body; a read fetches it).

        `along`: arrays from `recorder.log.store.arrays.encode_array` stored in
        the same commit (`extends` may name one of them): a body stored as
        prefix, middle and tail pieces costs one commit, not three.

        `into`: store nothing now; add the encoded arrays (`along` and this one,
        `cache` applied) to `into`, for an `append(..., arrays=)` with the
        events that name them: one commit for both. A store that drops a
        basis's cached pieces once the array is stored (`basis` without
        `basis_offset`) keeps them then.

        `prior` (with `extends`, without `basis`): the content of the array
        `extends` names, or its last `arrays.PRIOR_BYTES` bytes or more, which
        the caller holds anyway; the suffix may be compressed against them
        (`arrays.CODEC_ZSTD_PRIOR`). Its ref is the same either way.
        """

    def release(self, old: ArrayRef, keep: Sequence[ArrayRef]) -> None:
        """A hint: `old`'s pieces outside the arrays `keep` names will not be read hot again.

        Stores with a piece cache drop them from it (they stay stored); the
        default does nothing.
        """

    @abc.abstractmethod
    async def get_array(self, ref: ArrayRef) -> np.ndarray:
        """The whole array a ref names. Raises `CorruptArray` on a bad hash."""

    async def get_arrays(
        self, refs: Sequence[ArrayRef], *, cache: bool = True, cold: bool = False
    ) -> list[np.ndarray]:
        """Many arrays at once; backends batch the reads.

        `cache=False`: the caller reads each array once (a streaming replay),
        so the backend keeps nothing of this read in its caches. Arrays may
        be read-only views of one buffer when one is a prefix of another (a
        session's engine inputs): copy one before writing into it, or before
        keeping a short one long after the rest (it holds the whole buffer).
        `cold=True`: the caller expects nothing of these arrays cached (a
        restart), so the backend fetches each array's whole piece chain at
        once rather than piece by piece.
        """
        return [await self.get_array(r) for r in refs]

    # -- lifecycle ------------------------------------------------------

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> EventStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
