"""Fixtures for the store suite: an opened store per backend, event factories."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Awaitable, Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from recorder.log.events import NewEvent, SandboxEvent
from recorder.log.store.migrations import alembic_config

MakeEvents = Callable[..., list[NewEvent]]


@pytest.fixture
def make_events() -> MakeEvents:
    """make_events(n, tag="x") -> n distinct small events (fresh ids)."""

    def make(n: int, tag: str = "e") -> list[NewEvent]:
        return [NewEvent(event=SandboxEvent(kind=f"{tag}-{i}", detail={"i": i})) for i in range(n)]

    return make


RawExecute = Callable[..., Awaitable[list[tuple[object, ...]]]]


@pytest.fixture
def raw_execute() -> RawExecute:
    """raw_execute(url, sql, *params): run SQL through a plain driver connection.

    Write placeholders as $1, $2 (asyncpg style); they become ? for sqlite3.
    """

    async def run(url: str, sql: str, *params: object) -> list[tuple[object, ...]]:
        if url.startswith("sqlite"):
            path = url.split(":///", 1)[1]
            conn = sqlite3.connect(path, isolation_level=None)
            try:
                return conn.execute(re.sub(r"\$\d+", "?", sql), params).fetchall()
            finally:
                conn.close()
        import asyncpg

        pg = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
        try:
            return [tuple(r) for r in await pg.fetch(sql, *params)]
        finally:
            await pg.close()

    return run


async def assert_downgrade_refused(store_url: str, to: str, match: str) -> None:
    """Alembic's downgrade of `store_url` to revision `to` raises, saying `match`: a
    log holding rows the older format cannot read stays where it is."""
    engine = create_async_engine(store_url)

    def downgrade(conn: sa.Connection) -> None:
        from alembic import command

        cfg = alembic_config(store_url)
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, to)

    try:
        async with engine.begin() as conn:
            with pytest.raises(RuntimeError, match=match):
                await conn.run_sync(downgrade)
    finally:
        await engine.dispose()
