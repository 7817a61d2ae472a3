"""Open an event log so the viewer can never hold up (or change) a live recorder.

SQLite: every connection is opened `mode=ro` through a URI, so it cannot take
the write lock at all, and reads in WAL mode never block the writer (a reader
sees the last committed snapshot). Postgres: every transaction is read-only
(`default_transaction_read_only`), and the viewer takes no advisory lock: it
reads through `SqlEventStore`'s read paths only.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from recorder.log.store import StoreOptions, migrations, normalize_url
from recorder.log.store.base import EventStore, SchemaOutOfDate


def readonly_sqlite_url(url: str) -> str:
    """`sqlite+aiosqlite:///file:PATH?mode=ro&uri=true` for a sqlite URL."""
    db = sa.make_url(url).database
    if not db or db == ":memory:":
        raise ValueError(f"{url}: the viewer needs a database file")
    path = Path(db)
    if not path.exists():
        raise SchemaOutOfDate(f"{path} does not exist: give the path of a recorder event log")
    return f"sqlite+aiosqlite:///file:{quote(str(path))}?mode=ro&uri=true"


def _sqlite_engine(url: str) -> AsyncEngine:
    from recorder.log.store.sqlite import BUSY_TIMEOUT_MS, READER_CACHE_KIB

    engine = create_async_engine(
        readonly_sqlite_url(url), connect_args={"timeout": BUSY_TIMEOUT_MS / 1000}
    )

    @sa.event.listens_for(engine.sync_engine, "connect")
    def _configure(dbapi_conn: object, _record: object) -> None:
        cur = dbapi_conn.cursor()  # type: ignore[attr-defined]
        cur.execute("PRAGMA query_only=ON")
        cur.execute(f"PRAGMA cache_size=-{READER_CACHE_KIB}")
        cur.close()

    return engine


def _postgres_engine(url: str) -> AsyncEngine:
    return create_async_engine(
        url,
        pool_size=4,
        max_overflow=4,
        pool_pre_ping=True,
        connect_args={"server_settings": {"default_transaction_read_only": "on"}},
    )


async def open_readonly(url_or_path: str) -> EventStore:
    """The store at `url_or_path` (same forms as every `replay` command), read-only."""
    url = normalize_url(url_or_path)
    options = StoreOptions()
    store: EventStore
    if sa.make_url(url).get_backend_name() == "sqlite":
        from recorder.log.store.sqlite import SqliteEventStore

        engine = _sqlite_engine(url)
        store = SqliteEventStore(url, engine, engine, options, read_only=True)
    else:
        from recorder.log.store.postgres import PostgresEventStore

        engine = _postgres_engine(url)
        store = PostgresEventStore(url, engine, engine, options, read_only=True)
    try:
        await migrations.ensure_current(engine, url)
    except BaseException:
        await store.close()
        raise
    return store
