"""PostgreSQL backend (asyncpg).

Sequence values are handed out in call order but transactions commit in any
order, so a reader paging by position could see position 11 committed while
10 is still in flight, move past it, and never see 10. We prevent that with
a transaction-level advisory lock that every writer takes before allocating
positions and holds until COMMIT: write transactions (each one a whole group
of appends, so this costs little) commit one after another in position order,
and PostgreSQL makes a commit visible before it releases the lock. Readers
take no lock. Positions left unused by a rolled-back transaction stay gaps.

A plain group (see `sql.PlainGroup`) is written in three round trips on a
dedicated asyncpg connection (`PlainGroupWriter`); through SQLAlchemy's
adapter the same transaction takes about ten statements of ~0.4 ms each.
Anything else rolls back and is redone by the generic path
(`SqlEventStore._commit_generic`), where every edge case is handled.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import asyncpg
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from recorder.log.store import arrays as arr
from recorder.log.store.session_locks import AdvisorySessionLocks
from recorder.log.store.sql import SqlEventStore, StoreOptions
from recorder.log.store.write_requests import (
    EventRow,
    GroupRequest,
    NewRow,
    PlainGroup,
    needs_flush,
)

log = logging.getLogger(__name__)

_EVENT_COLUMNS = ["position", "session_id", "seq", "event_id", "type", "version", "ts", "payload"]
# TOAST_MAX_CHUNK_SIZE for PostgreSQL's default 8 KiB block size: four such
# chunks fill a TOAST page. Another block size only costs packing, not
# correctness.
TOAST_CHUNK_BYTES = 1996
# Arbitrary but fixed: int64 key of the writers' advisory lock.
WRITER_LOCK_KEY = 0x7472_6576_656E_7473  # "trevents"
# A plain group with at least this many events COPYs them (one more round
# trip) instead of inserting them from arrays in the group's statement:
# COPY's per-row cost is lower, and it wins from about 50 rows (measured here).
COPY_MIN_EVENTS = 50

# A session's events read through asyncpg itself (`_raw_session`, `_raw_from_last`).
_SELECT_EVENTS = f"SELECT {', '.join(_EVENT_COLUMNS)} FROM events"
READ_SESSION_SQL = _SELECT_EVENTS + " WHERE session_id = $1 AND seq >= $2 ORDER BY seq"
FROM_LAST_SQL = (
    _SELECT_EVENTS + " WHERE session_id = $1 AND seq >= coalesce((SELECT seq FROM events"
    " WHERE session_id = $1 AND type = ANY($2::text[]) ORDER BY seq DESC LIMIT 1), 0)"
    " ORDER BY seq"
)

# Stored pieces by digest, and with all their ancestors (a restart reads a
# chain's pieces in one round), through asyncpg itself.
_SELECT_PIECES = (
    "SELECT digest, parent, dtype, total_length, codec, data, data_tail, basis, basis_depth"
    " FROM arrays"
)
PIECE_ROWS_SQL = _SELECT_PIECES + " WHERE digest = ANY($1::bytea[])"
CHAIN_ROWS_SQL = (
    "WITH RECURSIVE chain(d) AS (SELECT digest FROM arrays WHERE digest = ANY($1::bytea[])"
    " UNION SELECT up.parent FROM arrays up JOIN chain ON up.digest = chain.d"
    " WHERE up.parent IS NOT NULL) " + _SELECT_PIECES + " WHERE digest IN (SELECT d FROM chain)"
)

# Each session's MAX(seq) as its own subquery: a single step down the
# (session_id, seq) index. `WHERE session_id = ANY(...) GROUP BY` would read
# every event of the session (~1.5 ms per 1,000 events, on every commit).
HEADS_SQL = (
    "SELECT h.s, (SELECT MAX(e.seq) FROM events e WHERE e.session_id = h.s)"
    " FROM unnest(CAST(:sessions AS text[])) AS h(s)"
)

# BEGIN and the lock travel as one message (asyncpg sends an argument-less
# `execute` as a simple query). The lock is its own statement, and READ
# COMMITTED takes a fresh snapshot per statement: the group statement, sent
# after the lock is held, sees every commit made before it.
BEGIN_LOCKED_SQL = (
    f"BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_advisory_xact_lock({WRITER_LOCK_KEY})"
)
# The same for a group that needs no flush (`needs_flush`: array pieces alone,
# appends made with `durable=False`): its commit does not wait for the WAL
# flush. The next durable commit's flush covers it (the WAL is one sequence),
# and nothing is acknowledged on it sooner (as on SQLite).
BEGIN_LOCKED_NO_FLUSH_SQL = (
    "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL synchronous_commit TO off;"
    f" SELECT pg_advisory_xact_lock({WRITER_LOCK_KEY})"
)

# One statement for all of a plain group but COMMIT: read the heads, reserve
# the positions, insert the pieces and (small groups) the events, and report
# what the caller must check before committing: every session's last seq (in
# `$1` order), the first reserved position and how many of the group's
# external parents/bases are stored. Events take seq = head + offset and
# position = first + ordinal, the same numbers `PlainGroup.place` computes.
# Data-modifying CTEs run exactly once; all parts share one snapshot, so the
# count sees stored pieces only, never the group's own.
PLAIN_GROUP_SQL = """
WITH heads AS MATERIALIZED (
    SELECT h.session_id, h.i,
           (SELECT MAX(e.seq) FROM events e WHERE e.session_id = h.session_id) AS last_seq
    FROM unnest($1::text[]) WITH ORDINALITY AS h(session_id, i)
), run AS MATERIALIZED (
    SELECT setval(q.s, nextval(q.s) + $2::bigint - 1) - $2::bigint + 1 AS first_position
    FROM (SELECT pg_get_serial_sequence('events', 'position')::regclass AS s) AS q
    WHERE $2::bigint > 0
), new_pieces AS (
    INSERT INTO arrays
        (digest, parent, dtype, total_length, codec, data, data_tail, basis, basis_depth)
    SELECT * FROM unnest($3::bytea[], $4::bytea[], $5::text[], $6::bigint[], $7::smallint[],
                         $8::bytea[], $9::bytea[], $10::bytea[], $11::smallint[])
    ON CONFLICT (digest) DO NOTHING
), new_events AS (
    INSERT INTO events (position, session_id, seq, event_id, type, version, ts, payload)
    SELECT run.first_position + e.i - 1, e.session_id,
           COALESCE(heads.last_seq + 1, 0) + e.seq_offset,
           e.event_id, e.type, e.version, e.ts, e.payload
    FROM unnest($12::text[], $13::bigint[], $14::uuid[], $15::text[], $16::int[],
                $17::float8[], $18::bytea[])
         WITH ORDINALITY AS e(session_id, seq_offset, event_id, type, version, ts, payload, i)
    CROSS JOIN run
    JOIN heads ON heads.session_id = e.session_id
)
SELECT ARRAY(SELECT last_seq FROM heads ORDER BY i),
       (SELECT first_position FROM run),
       (SELECT COUNT(*) FROM arrays WHERE digest = ANY($19::bytea[]))
"""


# The writer connection plans `PLAIN_GROUP_SQL` once: left to choose, the
# server re-plans it on every call (its generic plan's estimates for the
# unnested arrays look worse), which costs more than executing it.
PLAIN_WRITER_SETTINGS = {"plan_cache_mode": "force_generic_plan"}


def create_engine(url: str, *, pool_size: int) -> AsyncEngine:
    return create_async_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)


def connect_params(engine: AsyncEngine) -> dict[str, Any]:
    """`asyncpg.connect` keywords for the database `engine` connects to."""
    _, params = engine.dialect.create_connect_args(engine.url)
    # Options of SQLAlchemy's adapter, not of asyncpg.
    for key in ("async_creator_fn", "prepared_statement_name_func"):
        params.pop(key, None)
    cache = params.pop("prepared_statement_cache_size", None)
    if cache is not None:
        params["statement_cache_size"] = int(cache)
    return dict(params)


def _columns(rows: Sequence[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """Rows as `width` column lists (unnest takes one array per column)."""
    if not rows:
        return [[] for _ in range(width)]
    return [list(c) for c in zip(*rows, strict=True)]


class PlainGroupWriter:
    """Writes a plain group on its own asyncpg connection in three round trips:
    BEGIN + lock, `PLAIN_GROUP_SQL`, COMMIT (plus a COPY for big groups).

    A dedicated connection rather than the write engine's pool: a pool
    checkout pings the server (three round trips with SQLAlchemy's adapter),
    the adapter's transaction state would disagree with a BEGIN issued
    underneath it, and one long-lived connection keeps its prepared statements.
    It costs one server connection per writing store, opened at the first
    write. `write` returns each request's result, or None when the group is
    not plain or anything failed: the transaction was rolled back and nothing
    of the group is written, so the caller redoes it on the generic path.
    """

    def __init__(
        self, params: Callable[[], dict[str, Any]], piece_row: Callable[[arr.Piece], dict[str, Any]]
    ) -> None:
        self._params = params
        self._piece_row = piece_row
        self._conn: asyncpg.Connection | None = None

    async def write(
        self, group: Sequence[GroupRequest], before_commit: Callable[[], Awaitable[None]] | None
    ) -> list[list[int] | None] | None:
        plan = PlainGroup(group)
        pieces = list({p.digest: p for r in group for p in r.pieces}.values())
        bases = list(arr.external_bases(pieces))
        copy = plan.n_rows >= COPY_MIN_EVENTS
        try:
            conn = await self._connection()
            await conn.execute(
                BEGIN_LOCKED_SQL if needs_flush(group) else BEGIN_LOCKED_NO_FLUSH_SQL
            )
            last_seqs, first, present = await conn.fetchrow(
                PLAIN_GROUP_SQL,
                plan.sessions,
                plan.n_rows,
                *self._piece_columns(pieces),
                *_columns([] if copy else _relative_rows(plan), 7),
                bases,
            )
            if present != len(bases):
                return await self._roll_back("an array names an unknown parent or basis")
            next_seq = {
                s: q + 1 for s, q in zip(plan.sessions, last_seqs, strict=True) if q is not None
            }
            results = plan.place(next_seq, first or 0)
            if results is None:
                return await self._roll_back("an expected_seq does not match")
            if copy:
                await conn.copy_records_to_table(
                    "events",
                    columns=_EVENT_COLUMNS,
                    records=[
                        _event_record(sid, seq + k, row)
                        for sid, seq, run in plan.runs(next_seq)
                        for k, row in enumerate(run)
                    ],
                )
            if before_commit is not None:
                await before_commit()
            await conn.execute("COMMIT")
            return results
        except asyncpg.PostgresError as e:  # e.g. UniqueViolationError: a re-sent event id
            return await self._roll_back(f"{type(e).__name__}: {e}")
        except Exception as e:  # a lost connection, or a confused one: start afresh
            self._drop()
            log.debug("group redone on the generic write path: %s: %s", type(e).__name__, e)
            return None
        except BaseException:  # cancelled mid-transaction: the connection's state is unknown
            self._drop()
            raise

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await conn.close(timeout=5)
            except Exception:  # already broken: just let go of the socket
                conn.terminate()

    async def _connection(self) -> asyncpg.Connection:
        if self._conn is None or self._conn.is_closed():
            params = self._params()
            settings = {**params.pop("server_settings", {}), **PLAIN_WRITER_SETTINGS}
            self._conn = await asyncpg.connect(**params, server_settings=settings)
        return self._conn

    def _piece_columns(self, pieces: list[arr.Piece]) -> list[list[Any]]:
        rows = [self._piece_row(p) for p in pieces]
        names = (
            "digest",
            "parent",
            "dtype",
            "total_length",
            "codec",
            "data",
            "data_tail",
            "basis",
            "basis_depth",
        )
        return [[r[n] for r in rows] for n in names]

    async def _roll_back(self, why: str) -> None:
        log.debug("group redone on the generic write path: %s", why)
        conn = self._conn
        if conn is None or not conn.is_in_transaction():
            return
        try:
            await conn.execute("ROLLBACK")
        except Exception:  # a broken connection: open a fresh one next time
            self._drop()

    def _drop(self) -> None:
        """Close the connection at once; the server rolls back its open transaction."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.terminate()


def _relative_rows(plan: PlainGroup) -> list[tuple[Any, ...]]:
    """`PLAIN_GROUP_SQL`'s event columns: seqs relative to each session's head."""
    return [
        (sid, seq + k, r.event_id, r.type, r.version, r.ts, r.payload)
        for sid, seq, run in plan.runs({})
        for k, r in enumerate(run)
    ]


def _event_record(session_id: str, seq: int, r: EventRow) -> tuple[Any, ...]:
    """One row of `_EVENT_COLUMNS` (its position assigned)."""
    return (r.position, session_id, seq, r.event_id, r.type, r.version, r.ts, r.payload)


class PostgresEventStore(SqlEventStore):
    dialect_insert = staticmethod(pg_insert)  # type: ignore[assignment]
    array_chunk_bytes = TOAST_CHUNK_BYTES

    def __init__(
        self,
        url: str,
        write_engine: AsyncEngine,
        read_engine: AsyncEngine,
        options: StoreOptions | None = None,
        *,
        read_only: bool = False,
    ) -> None:
        """`read_only`: the engines cannot write (the viewer's): every write goes
        through them, to be refused, and none through an asyncpg connection of ours
        (it would connect without the engines' read-only settings)."""
        super().__init__(url, write_engine, read_engine, options)
        self._plain = (
            None
            if read_only
            else PlainGroupWriter(lambda: connect_params(write_engine), self.piece_row)
        )
        self.session_locks = AdvisorySessionLocks(lambda: connect_params(write_engine))

    @classmethod
    def connect(cls, url: str, options: StoreOptions | None = None) -> PostgresEventStore:
        """Page caches live in the server: only `options.piece_cache_bytes` applies."""
        return cls(url, create_engine(url, pool_size=2), create_engine(url, pool_size=5), options)

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            if self._plain is not None:
                await self._plain.close()
            await self.session_locks.close()

    async def _write_plain_group(self, group: list[GroupRequest]) -> list[list[int] | None] | None:
        if self._plain is None:
            return None  # the generic path, where a read-only engine refuses it
        return await self._plain.write(group, self.before_commit)

    async def _raw_session(
        self, conn: AsyncConnection, session_id: str, from_seq: int
    ) -> Sequence[Any]:
        return await (await _driver(conn)).fetch(READ_SESSION_SQL, session_id, from_seq)

    async def _raw_from_last(
        self, conn: AsyncConnection, session_id: str, types: Sequence[str]
    ) -> Sequence[Any]:
        return await (await _driver(conn)).fetch(FROM_LAST_SQL, session_id, list(types))

    async def _piece_rows(self, conn: AsyncConnection, digests: Sequence[bytes]) -> Iterable[Any]:
        return await (await _driver(conn)).fetch(PIECE_ROWS_SQL, list(digests))

    async def _chain_rows(self, conn: AsyncConnection, digests: Sequence[bytes]) -> Iterable[Any]:
        return await (await _driver(conn)).fetch(CHAIN_ROWS_SQL, list(digests))

    async def _lock_writers(self, conn: AsyncConnection) -> None:
        await conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": WRITER_LOCK_KEY})

    async def _read_heads(
        self, conn: AsyncConnection, session_ids: set[str]
    ) -> tuple[dict[str, int], int | None]:
        rows = await conn.execute(sa.text(HEADS_SQL), {"sessions": sorted(session_ids)})
        return {s: q + 1 for s, q in rows if q is not None}, None

    async def _allocate_positions(self, conn: AsyncConnection, n: int) -> int:
        last = await conn.scalar(
            sa.text(
                "SELECT setval(s, nextval(s) + :n - 1) FROM "
                "(SELECT pg_get_serial_sequence('events', 'position')::regclass AS s) q"
            ),
            {"n": n},
        )
        return int(last) - n + 1

    async def _insert_events(self, conn: AsyncConnection, rows: list[NewRow]) -> None:
        # COPY on the raw asyncpg connection, inside the transaction that holds
        # the writer lock: the fastest bulk path PostgreSQL has.
        raw = await conn.get_raw_connection()
        await raw.driver_connection.copy_records_to_table(  # type: ignore[union-attr]
            "events", columns=_EVENT_COLUMNS, records=[_event_record(*r) for r in rows]
        )

    async def _after_bulk_copy(self, conn: AsyncConnection) -> None:
        for table, column in (("events", "position"), ("projection_names", "ordinal")):
            await conn.execute(
                sa.text(
                    f"SELECT setval(pg_get_serial_sequence('{table}', '{column}'), "
                    f"GREATEST((SELECT MAX({column}) FROM {table}), 1), "
                    f"(SELECT MAX({column}) FROM {table}) IS NOT NULL)"
                )
            )


async def _driver(conn: AsyncConnection) -> asyncpg.Connection:
    """The asyncpg connection under a SQLAlchemy connection (a read outside a transaction)."""
    return (await conn.get_raw_connection()).driver_connection  # type: ignore[return-value]
