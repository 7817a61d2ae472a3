"""Alembic environment for the recorder's store (async URLs: aiosqlite, asyncpg).

`recorder.log.store.migrations.upgrade()` passes an open connection in
`config.attributes["connection"]`; the alembic CLI path builds an async
engine from `sqlalchemy.url` instead.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from recorder.log.store.tables import metadata

config = context.config


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_async(url: str) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run)
            await conn.commit()
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
    else:
        asyncio.run(_run_async(config.get_main_option("sqlalchemy.url") or ""))


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; run `recorder db upgrade`")
run_migrations_online()
