"""Projections: upserted per name, names listed in first-write order."""

from __future__ import annotations

import pytest

from recorder.log.store import EventStore


async def test_projection_upsert_and_order(store: EventStore) -> None:
    assert await store.projection_names() == []
    await store.save_projection("rules-b", [("s1", 3, "d1", b"one"), ("s2", 5, "d2", b"two")])
    await store.save_projection("rules-a", [("s1", 3, "dx", b"x")])
    await store.save_projection("rules-b", [("s1", 9, "d1'", b"one'")])
    assert await store.projection_names() == ["rules-b", "rules-a"]
    assert await store.load_projection("rules-b") == {
        "s1": (9, "d1'", b"one'"),
        "s2": (5, "d2", b"two"),
    }
    assert await store.load_projection("rules-a") == {"s1": (3, "dx", b"x")}
    assert await store.load_projection("missing") == {}


async def test_a_failed_projection_write_writes_nothing(store: EventStore) -> None:
    """A batch is one transaction: a bad row rolls back the rows before it, and
    the store keeps writing afterwards."""
    await store.save_projection("rules-a", [("s1", 3, "d1", b"one")])
    bad = [("s2", 4, "d2", b"two"), ("s3", 5, "d3", None)]  # payload is NOT NULL
    with pytest.raises(Exception):  # noqa: B017 - each backend raises its driver's error
        await store.save_projection("rules-a", bad)  # type: ignore[list-item]
    assert await store.load_projection("rules-a") == {"s1": (3, "d1", b"one")}
    await store.save_projection("rules-a", [("s2", 4, "d2", b"two")])
    assert set(await store.load_projection("rules-a")) == {"s1", "s2"}
