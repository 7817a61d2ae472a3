"""Fixtures for replay tests: opened stores, per backend."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from recorder.store import EventStore, open_store


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[EventStore]:
    """An opened, migrated store on each backend."""
    s = await open_store(store_url, create=True)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def sqlite_store(sqlite_url: str) -> AsyncIterator[EventStore]:
    s = await open_store(sqlite_url, create=True)
    try:
        yield s
    finally:
        await s.close()
