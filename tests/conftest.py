"""Fixtures shared by every test package.

`store_url` is parametrised over both backends: every test that takes it runs
on SQLite and on Postgres. Postgres comes from TR_TEST_POSTGRES_URL (set by
`.ci/run` via tools/pg_cluster.sh); without it Postgres cases are skipped
locally, and fail under CI so a missing server can never pass silently.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

POSTGRES_ENV = "TR_TEST_POSTGRES_URL"


def _postgres_admin_url() -> str:
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        if os.environ.get("CI"):
            pytest.fail(f"{POSTGRES_ENV} is not set under CI: .ci/run must start PostgreSQL")
        pytest.skip(f"{POSTGRES_ENV} not set (run tools/pg_cluster.sh start DIR)")
    return url


async def _create_database(admin_url: str) -> str:
    import asyncpg

    base, _, _ = admin_url.rpartition("/")
    name = f"tr_{uuid.uuid4().hex[:16]}"
    conn = await asyncpg.connect(admin_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return f"{base}/{name}"


async def _drop_database(admin_url: str, url: str) -> None:
    import asyncpg

    name = url.rpartition("/")[2]
    conn = await asyncpg.connect(admin_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@pytest.fixture
async def postgres_url() -> AsyncIterator[str]:
    """A fresh, empty Postgres database (dropped afterwards)."""
    admin = _postgres_admin_url()
    url = await _create_database(admin)
    try:
        yield url
    finally:
        await _drop_database(admin, url)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> Iterator[str]:
    """A fresh SQLite database file URL."""
    yield f"sqlite+aiosqlite:///{tmp_path / 'runs.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """An empty database URL, once per backend."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'runs.db'}"
        return
    admin = _postgres_admin_url()
    url = await _create_database(admin)
    try:
        yield url
    finally:
        await _drop_database(admin, url)
