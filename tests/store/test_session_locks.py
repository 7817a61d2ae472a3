"""The per-session advisory locks survive their connection being killed under them."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from recorder.log.store import open_store
from recorder.log.store.postgres import PostgresEventStore

pytestmark = pytest.mark.postgres


async def _terminate_other_backends(url: str) -> int:
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
    try:
        name = url.rpartition("/")[2]
        return await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
    finally:
        await conn.close()


async def test_lock_after_its_connection_was_terminated(postgres_url: str) -> None:
    store = await open_store(postgres_url, create=True)
    other = await open_store(postgres_url)
    try:
        assert isinstance(store, PostgresEventStore)
        locks = store.session_locks
        await locks.lock("a")
        locks.unlock("a")
        await locks.lock("a")  # held on the lock connection
        assert await _terminate_other_backends(postgres_url) >= 1

        # The killed connection's locks are gone, and the next lock reconnects.
        await asyncio.wait_for(other.session_locks.lock("a"), 10)
        other.session_locks.unlock("a")
        for session in ("a", "b"):
            await locks.lock(session)
        # ... and these locks are real: another process cannot take them.
        held = await other.session_locks._try("b")
        assert not held
        locks.unlock("a")
        locks.unlock("b")
    finally:
        await other.close()
        await store.close()


async def test_lock_right_after_the_server_killed_the_idle_connection(postgres_url: str) -> None:
    """The server's termination notice may reach an idle connection before it looks closed."""
    store = await open_store(postgres_url, create=True)
    try:
        locks = store.session_locks
        for round in range(5):
            await locks.lock(f"s{round}")
            locks.unlock(f"s{round}")
            await asyncio.sleep(0.01)  # the unlock is sent in the background
            await _terminate_other_backends(postgres_url)
            await asyncio.sleep(0.002 * round)
            await asyncio.wait_for(locks.lock(f"s{round}"), 10)
            locks.unlock(f"s{round}")
    finally:
        await store.close()
