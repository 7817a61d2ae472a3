"""Projections: upserted per name, names listed in first-write order."""

from __future__ import annotations

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
