"""SQLite backend (aiosqlite): WAL, one writer connection, BEGIN IMMEDIATE.

- WAL lets readers run beside the writer and see committed snapshots only.
- Writes start with BEGIN IMMEDIATE, taking the write lock up front: a
  deferred transaction that reads and then writes can fail with "database is
  locked" without waiting, whereas BEGIN IMMEDIATE waits on `busy_timeout`.
  Holding the lock from position allocation to COMMIT also means positions
  commit in order, so `read_all` paging by position never skips an event.
- synchronous=FULL: with WAL, NORMAL already survives kill -9 of the process
  (committed frames sit in the OS page cache), but loses the last commits on
  power loss or a kernel crash. We acknowledge an append as durable, so we
  fsync the WAL on every commit; group commit amortises that fsync over every
  append gathered into the transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool

from recorder.store.sql import (
    IN_CHUNK,
    READER_PAGE_CACHE_BYTES,
    WRITER_PAGE_CACHE_BYTES,
    NewRow,
    SqlEventStore,
    StoreOptions,
)

BUSY_TIMEOUT_MS = 60_000
# Default page cache per connection, in KiB (SQLite's default is 2 MiB): the
# event_id index takes random inserts, and a warm cache keeps a write group's
# dirty pages few. Readers get less since there are several of them.
# `StoreOptions` sets other sizes per store.
WRITER_CACHE_KIB = WRITER_PAGE_CACHE_BYTES // 1024
READER_CACHE_KIB = READER_PAGE_CACHE_BYTES // 1024


def database_path(url: str) -> Path | None:
    """The file a sqlite URL points at (None for in-memory)."""
    db = sa.make_url(url).database
    return None if not db or db == ":memory:" else Path(db)


def create_engine(url: str, *, writer: bool, cache_kib: int | None = None) -> AsyncEngine:
    """An engine whose transactions begin IMMEDIATE (writer) or DEFERRED (reader).

    `cache_kib`: page cache per connection (default: WRITER/READER_CACHE_KIB).
    """
    engine = create_async_engine(
        url,
        poolclass=AsyncAdaptedQueuePool,
        pool_size=1 if writer else 4,
        max_overflow=0 if writer else 8,
        connect_args={"timeout": BUSY_TIMEOUT_MS / 1000},
        # Every transaction is ended by its Connection (engine.begin() commits
        # or rolls back; Connection.close() rolls back an open one), so the
        # pool's extra ROLLBACK on check-in would only cost a thread hop.
        pool_reset_on_return=None if writer else "rollback",
    )
    begin = "BEGIN IMMEDIATE" if writer else "BEGIN"
    if cache_kib is None:
        cache_kib = WRITER_CACHE_KIB if writer else READER_CACHE_KIB

    @event.listens_for(engine.sync_engine, "connect")
    def _configure(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control from the driver so BEGIN is ours.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute(f"PRAGMA cache_size=-{cache_kib}")
        cur.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql(begin)

    return engine


class SqliteEventStore(SqlEventStore):
    dialect_insert = staticmethod(sqlite_insert)  # type: ignore[assignment]

    @classmethod
    def connect(cls, url: str, options: StoreOptions | None = None) -> SqliteEventStore:
        if database_path(url) is None:
            raise ValueError(
                f"{url}: in-memory SQLite cannot be shared by the writer and readers; "
                "give a file path"
            )
        options = options or StoreOptions()
        return cls(
            url,
            create_engine(url, writer=True, cache_kib=_kib(options.writer_page_cache_bytes)),
            create_engine(url, writer=False, cache_kib=_kib(options.reader_page_cache_bytes)),
            options,
        )

    async def _lock_writers(self, conn: AsyncConnection) -> None:
        """BEGIN IMMEDIATE already holds the database write lock."""

    # The hot path talks to the raw aiosqlite connection, inside the same
    # BEGIN IMMEDIATE transaction: through SQLAlchemy each statement costs
    # several hops to aiosqlite's thread (cursor, execute, fetch, close); raw,
    # one. On a loaded machine a hop is ~0.3 ms, a sizeable share of a
    # 1000-event batch.

    async def _read_heads(
        self, conn: AsyncConnection, session_ids: set[str]
    ) -> tuple[dict[str, int], int | None]:
        # One statement for the seqs and the last position: BEGIN IMMEDIATE
        # holds the write lock, so MAX(position)+1 stays free until COMMIT.
        raw = await _driver(conn)
        ordered = sorted(session_ids)
        next_seq: dict[str, int] = {}
        last_position = 0
        for i in range(0, max(len(ordered), 1), IN_CHUNK):
            chunk = ordered[i : i + IN_CHUNK]
            sql = (
                "SELECT session_id, MAX(seq) FROM events"
                f" WHERE session_id IN ({','.join('?' * len(chunk))}) GROUP BY session_id"
            )
            if i == 0:  # session_id is NOT NULL, so NULL marks the position row
                sql += " UNION ALL SELECT NULL, MAX(position) FROM events"
            for session_id, value in await raw.execute_fetchall(sql, chunk):
                if session_id is None:
                    last_position = value or 0
                else:
                    next_seq[session_id] = value + 1
        return next_seq, last_position + 1

    async def _allocate_positions(self, conn: AsyncConnection, n: int) -> int:
        # Rows are never deleted (triggers), so MAX+1 never reuses a position.
        raw = await _driver(conn)
        ((last,),) = await raw.execute_fetchall("SELECT MAX(position) FROM events")
        return int(last or 0) + 1

    async def _raw_events(self, conn: AsyncConnection, after: int, limit: int) -> Sequence[Any]:
        raw = await _driver(conn)
        rows = await raw.execute_fetchall(
            "SELECT position, session_id, seq, event_id, type, version, ts, payload FROM events"
            " WHERE position > ? ORDER BY position LIMIT ?",
            (after, limit),
        )
        return [(p, s, q, uuid.UUID(bytes=e), t, v, ts, b) for p, s, q, e, t, v, ts, b in rows]

    async def _piece_rows(self, conn: AsyncConnection, digests: Sequence[bytes]) -> Iterable[Any]:
        raw = await _driver(conn)
        rows: Iterable[Any] = await raw.execute_fetchall(
            "SELECT digest, parent, dtype, total_length, codec, data, data_tail, basis,"
            " basis_depth FROM arrays"
            f" WHERE digest IN ({','.join('?' * len(digests))})",
            digests,
        )
        return rows

    async def _insert_events(self, conn: AsyncConnection, rows: list[NewRow]) -> None:
        raw = await _driver(conn)
        await raw.executemany(
            "INSERT INTO events (position, session_id, seq, event_id, type, version, ts, payload)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (r.position, sid, seq, r.event_id.bytes, r.type, r.version, r.ts, r.payload)
                for sid, seq, r in rows
            ],
        )


def _kib(n_bytes: int) -> int:
    """PRAGMA cache_size=-N takes KiB; 0 would mean "no limit given", so keep >= 1 page."""
    return max(1, n_bytes // 1024)


async def _driver(conn: AsyncConnection) -> Any:
    """The aiosqlite connection under a SQLAlchemy connection (same transaction)."""
    return (await conn.get_raw_connection()).driver_connection
