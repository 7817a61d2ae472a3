"""PostgreSQL backend (asyncpg).

Sequence values are handed out in call order but transactions commit in any
order, so a reader paging by position could see position 11 committed while
10 is still in flight, move past it, and never see 10. We prevent that with
a transaction-level advisory lock that every writer takes before allocating
positions and holds until COMMIT: write transactions (each one a whole group
of appends, so this costs little) commit one after another in position order,
and PostgreSQL makes a commit visible before it releases the lock. Readers
take no lock. Positions left unused by a rolled-back transaction stay gaps.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from recorder.store.sql import NewRow, SqlEventStore, StoreOptions

_EVENT_COLUMNS = ["position", "session_id", "seq", "event_id", "type", "version", "ts", "payload"]
# TOAST_MAX_CHUNK_SIZE for PostgreSQL's default 8 KiB block size: four such
# chunks fill a TOAST page. Another block size only costs packing, not
# correctness.
TOAST_CHUNK_BYTES = 1996
# Arbitrary but fixed: int64 key of the writers' advisory lock.
WRITER_LOCK_KEY = 0x7472_6576_656E_7473  # "trevents"


def create_engine(url: str, *, pool_size: int) -> AsyncEngine:
    return create_async_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)


class PostgresEventStore(SqlEventStore):
    dialect_insert = staticmethod(pg_insert)  # type: ignore[assignment]
    array_chunk_bytes = TOAST_CHUNK_BYTES

    @classmethod
    def connect(cls, url: str, options: StoreOptions | None = None) -> PostgresEventStore:
        """Page caches live in the server: only `options.piece_cache_bytes` applies."""
        return cls(url, create_engine(url, pool_size=2), create_engine(url, pool_size=5), options)

    async def _lock_writers(self, conn: AsyncConnection) -> None:
        await conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": WRITER_LOCK_KEY})

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
            "events",
            columns=_EVENT_COLUMNS,
            records=[
                (r.position, sid, seq, r.event_id, r.type, r.version, r.ts, r.payload)
                for sid, seq, r in rows
            ],
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
