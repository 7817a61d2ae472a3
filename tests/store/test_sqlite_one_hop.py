"""SQLite's one-hop group write: used for plain groups, and every edge case handed to
the generic path gives the same outcome as the generic path alone."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest

from recorder.events import ArrayRef, NewEvent, SandboxEvent
from recorder.store import (
    ArrayNotFound,
    ConcurrencyConflict,
    StoreError,
    open_store,
)
from recorder.store import arrays as codec
from recorder.store.sql import AppendRequest, EventRow, PiecesRequest
from recorder.store.sqlite import SqliteEventStore, plan_plain_group

MakeEvents = Callable[..., list[NewEvent]]
PATHS = {"one-hop": True, "generic": False}


@pytest.fixture(params=list(PATHS))
async def either_path(
    request: pytest.FixtureRequest, sqlite_url: str
) -> AsyncIterator[SqliteEventStore]:
    """A SQLite store, once with the one-hop path on and once forced generic."""
    store = await open_store(sqlite_url, create=True)
    assert isinstance(store, SqliteEventStore)
    store.one_hop_writes = PATHS[request.param]
    try:
        yield store
    finally:
        await store.close()


def counts(store: SqliteEventStore) -> tuple[int, int]:
    return store.one_hop_groups, store.generic_groups


async def test_plain_groups_take_one_hop(sqlite_url: str, make_events: MakeEvents) -> None:
    async with await open_store(sqlite_url, create=True) as store:
        assert isinstance(store, SqliteEventStore)
        encoded = codec.encode_array(np.arange(50, dtype=np.int32))
        first = await store.append("s", make_events(3), arrays=[encoded])
        await store.append("s", make_events(2, "b"), expected_seq=3)
        ref = await store.put_array(np.arange(7, dtype=np.int32))
        await store.put_array(np.arange(3, dtype=np.int32), extends=ref)  # parent checked
        await asyncio.gather(*(store.append(f"t{i}", make_events(1, f"t{i}")) for i in range(20)))
        assert store.generic_groups == 0 and store.one_hop_groups >= 5
        assert first == [1, 2, 3]
        assert [e.seq for e in await store.read_session("s")] == [0, 1, 2, 3, 4]
        assert (await store.get_array(encoded.ref)).tolist() == list(range(50))
        hooked: list[int] = []

        async def hook() -> None:
            hooked.append(await store.last_position())  # runs inside the open transaction

        store.before_commit = hook
        await store.append("s", make_events(1, "hooked"))
        assert hooked == [25] and store.generic_groups == 0
        assert any(t.name.startswith("recorder-sqlite-writer") for t in threading.enumerate())
    assert not any(t.name.startswith("recorder-sqlite-writer") for t in threading.enumerate())
    async with await open_store(sqlite_url) as cold:
        assert (await cold.get_array(encoded.ref)).tolist() == list(range(50))


async def test_group_with_one_conflict(
    either_path: SqliteEventStore, make_events: MakeEvents
) -> None:
    await either_path.append("s", make_events(2, "base"))
    before = counts(either_path)
    ok, bad = await asyncio.gather(
        either_path.append("t", make_events(2, "ok")),
        either_path.append("s", make_events(3, "bad"), expected_seq=1),
        return_exceptions=True,
    )
    assert isinstance(bad, ConcurrencyConflict) and bad.actual_seq == 2
    assert ok == [3, 4]
    assert counts(either_path)[1] == before[1] + 1  # redone (or done) on the generic path
    assert [e.session_id for e in await either_path.read_all()] == ["s", "s", "t", "t"]


async def test_resent_batch_gets_its_original_positions(
    either_path: SqliteEventStore, make_events: MakeEvents
) -> None:
    batch = make_events(3)
    first = await either_path.append("s", batch)
    fresh = await either_path.append("s", make_events(1, "fresh"))
    resent, other = await asyncio.gather(
        either_path.append("s", batch), either_path.append("u", make_events(2, "u"))
    )
    assert resent == first and other == [fresh[0] + 1, fresh[0] + 2]
    assert await either_path.append("s", batch, expected_seq=0) == first
    assert len(await either_path.read_all()) == 6


async def mixed_history(store: SqliteEventStore) -> list[object]:
    """A scripted run full of edge cases; returns every outcome (positions or error type)."""

    def ev(tag: str, n: int = 1) -> list[NewEvent]:
        # Fixed ids, so both runs append the very same events.
        return [
            NewEvent(event=SandboxEvent(kind=f"{tag}{i}"), event_id=_uuid(tag, i)) for i in range(n)
        ]

    ghost = ArrayRef(b"\x09" * 16, 3, "int32")
    a = codec.encode_array(np.arange(10, dtype=np.int32))
    b = codec.encode_array(np.arange(4, dtype=np.int32), extends=a.ref)
    rounds = [
        [("s", ev("a", 2), None, [a]), ("t", ev("b"), None, [])],
        [("s", ev("c"), 2, [b]), ("s", ev("d"), 0, []), ("u", ev("e"), None, [])],
        [("s", ev("a", 2), None, [a]), ("t", ev("f", 2), 1, []), ("t", ev("b"), 5, [])],
        [
            ("v", ev("g"), None, [codec.encode_array(np.arange(2, dtype=np.int32), extends=ghost)]),
            ("v", ev("h"), 0, []),
        ],
        [("w", [NewEvent(event=SandboxEvent(kind="x"), event_id=_uuid("a", 0))], None, [])],
    ]
    outcomes: list[object] = []
    for batch in rounds:
        results = await asyncio.gather(
            *(
                store.append(sid, evs, expected_seq=exp, arrays=arrs)
                for sid, evs, exp, arrs in batch
            ),
            return_exceptions=True,
        )
        outcomes += [type(r).__name__ if isinstance(r, StoreError) else r for r in results]
    log = [(e.position, e.session_id, e.seq, e.event_id) for e in await store.read_all()]
    arrays = (await store.get_array(b.ref)).tolist()
    return [*outcomes, log, arrays]


def _uuid(tag: str, i: int) -> uuid.UUID:
    return uuid.uuid5(uuid.NAMESPACE_OID, f"{tag}-{i}")


async def test_one_hop_and_generic_paths_agree(sqlite_url: str) -> None:
    runs = {}
    for name, one_hop in PATHS.items():
        url = sqlite_url.replace("runs.db", f"{name}.db")
        async with await open_store(url, create=True) as store:
            assert isinstance(store, SqliteEventStore)
            store.one_hop_writes = one_hop
            runs[name] = await mixed_history(store)
            if one_hop:
                assert store.one_hop_groups >= 1 and store.generic_groups >= 3
            else:
                assert store.one_hop_groups == 0
    assert runs["one-hop"] == runs["generic"]
    outcomes = runs["generic"]
    assert outcomes[:5] == [[1, 2], [3], [4], "ConcurrencyConflict", [5]]
    assert outcomes[5:8] == [[1, 2], [6, 7], [3]]  # re-sent batches keep their positions
    assert outcomes[8:10] == ["ArrayNotFound", [8]]
    assert outcomes[10] == "IdempotencyConflict"


async def test_plan_plain_group_matches_queue_order() -> None:
    def rows(n: int) -> list[EventRow]:
        return [EventRow(_uuid("p", i), "t", 1, 0.0, b"") for i in range(n)]  # type: ignore[arg-type]

    group: list[AppendRequest | PiecesRequest] = [
        AppendRequest("a", rows(2), None),
        PiecesRequest([]),
        AppendRequest("b", rows(1), 4),
        AppendRequest("a", rows(1), 2),
    ]
    plan = plan_plain_group(group, {"b": 4}, 10)
    assert plan is not None
    assert plan.results == [[10, 11], None, [12], [13]]
    assert [(p, s, q) for p, s, q, *_ in plan.events] == [
        (10, "a", 0),
        (11, "a", 1),
        (12, "b", 4),
        (13, "a", 2),
    ]
    assert plan_plain_group(group, {"b": 3}, 10) is None


async def test_unknown_parent_falls_back_and_fails_alone(sqlite_url: str) -> None:
    async with await open_store(sqlite_url, create=True) as store:
        assert isinstance(store, SqliteEventStore)
        ghost = ArrayRef(b"\x05" * 16, 2, "int32")
        ok, bad = await asyncio.gather(
            store.put_array(np.arange(5, dtype=np.int32)),
            store.put_array(np.arange(2, dtype=np.int32), extends=ghost),
            return_exceptions=True,
        )
        assert isinstance(ok, ArrayRef) and isinstance(bad, ArrayNotFound)
        assert counts(store) == (0, 1)
        assert (await store.get_array(ok)).tolist() == list(range(5))
