"""The event store: `open_store(url)` returns the backend for a URL or path.

store = await open_store("runs.db", create=True)       # SQLite file
store = await open_store("postgresql://u@host/db")     # Postgres (asyncpg)
store = await open_store("runs.db", options=StoreOptions.streaming())  # one-pass reader
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa

from recorder.log.store import migrations
from recorder.log.store.arrays import EncodedArray, encode_array
from recorder.log.store.base import (
    ArrayNotFound,
    ConcurrencyConflict,
    CorruptArray,
    EventStore,
    IdempotencyConflict,
    ProjectionStore,
    SchemaOutOfDate,
    StoreError,
)
from recorder.log.store.sql import StoreOptions

__all__ = [
    "ArrayNotFound",
    "ConcurrencyConflict",
    "CorruptArray",
    "EncodedArray",
    "EventStore",
    "IdempotencyConflict",
    "ProjectionStore",
    "SchemaOutOfDate",
    "StoreError",
    "StoreOptions",
    "encode_array",
    "normalize_url",
    "open_store",
]

_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "sqlite+aiosqlite": "sqlite+aiosqlite",
    "postgres": "postgresql+asyncpg",
    "postgresql": "postgresql+asyncpg",
    "postgresql+asyncpg": "postgresql+asyncpg",
}


def normalize_url(url_or_path: str) -> str:
    """An async SQLAlchemy URL: bare paths become SQLite, drivers become async ones."""
    if "://" not in url_or_path:
        return f"sqlite+aiosqlite:///{Path(url_or_path).expanduser().resolve()}"
    scheme, rest = url_or_path.split("://", 1)
    try:
        return f"{_DRIVERS[scheme]}://{rest}"
    except KeyError:
        raise ValueError(
            f"unsupported database URL {url_or_path!r}: use a file path, sqlite:///PATH "
            "or postgresql://USER@HOST/DB"
        ) from None


async def open_store(
    url_or_path: str, *, create: bool = False, options: StoreOptions | None = None
) -> EventStore:
    """Open the store at a URL or SQLite path.

    `create=True` creates/upgrades the schema first. Otherwise a database not
    at the current schema revision raises `SchemaOutOfDate`. `options` sizes
    the store's caches (default `StoreOptions()`: sized for the live server).
    """
    url = normalize_url(url_or_path)
    backend = sa.make_url(url).get_backend_name()
    if backend == "sqlite":
        from recorder.log.store.sqlite import SqliteEventStore, create_private, database_path

        path = database_path(url)
        if create and path is not None:
            create_private(path)
        if not create and path is not None and not path.exists():
            raise SchemaOutOfDate(
                f"{path} does not exist: run `recorder db upgrade --db {url}` to create it "
                "(or open with create=True)"
            )
        store: EventStore = SqliteEventStore.connect(url, options)
    else:
        from recorder.log.store.postgres import PostgresEventStore

        store = PostgresEventStore.connect(url, options)
    engine = store.write_engine  # type: ignore[attr-defined]
    try:
        if create:
            await migrations.upgrade(engine)
        else:
            await migrations.ensure_current(engine, url)
    except BaseException:
        await store.close()
        raise
    return store
