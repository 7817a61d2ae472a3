"""The database itself refuses to change or remove events."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from recorder.log.events import NewEvent, SandboxEvent
from recorder.log.store import EventStore, open_store

RawExecute = Callable[..., Awaitable[list[tuple[object, ...]]]]


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE events SET ts = 0",
        "UPDATE events SET payload = $1",
        "DELETE FROM events",
        "DELETE FROM events WHERE seq = 0",
    ],
)
async def test_update_and_delete_rejected(
    store: EventStore, store_url: str, raw_execute: RawExecute, sql: str
) -> None:
    await store.append("s", [NewEvent(event=SandboxEvent(kind="k"))])
    params = (b"x",) if "$1" in sql else ()
    with pytest.raises(Exception, match="append-only"):
        await raw_execute(store_url, sql, *params)
    rows = await raw_execute(store_url, "SELECT seq, type FROM events")
    assert rows == [(0, "sandbox_event")]


@pytest.mark.postgres
async def test_truncate_rejected_on_postgres(postgres_url: str, raw_execute: RawExecute) -> None:
    async with await open_store(postgres_url, create=True) as store:
        await store.append("s", [NewEvent(event=SandboxEvent(kind="k"))])
        with pytest.raises(Exception, match="append-only"):
            await raw_execute(postgres_url, "TRUNCATE events")
        assert len(await store.read_all()) == 1
