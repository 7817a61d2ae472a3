"""The plain-group fast path (SQLite: one thread hop; Postgres: three round trips on
its own connection): used for plain groups, and every edge case handed to the
generic path gives the same outcome as the generic path alone."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
import pytest

from recorder.log.events import ArrayRef, NewEvent, SandboxEvent
from recorder.log.store import ArrayNotFound, ConcurrencyConflict, StoreError, open_store
from recorder.log.store import arrays as codec
from recorder.log.store.sql import SqlEventStore
from recorder.log.store.write_requests import AppendRequest, EventRow, PiecesRequest, PlainGroup

MakeEvents = Callable[..., list[NewEvent]]
RawExecute = Callable[..., Awaitable[list[tuple[object, ...]]]]
PATHS = {"fast": True, "generic": False}


async def open_sql_store(url: str, *, fast: bool = True) -> SqlEventStore:
    store = await open_store(url, create=True)
    assert isinstance(store, SqlEventStore)
    store.fast_writes = fast
    return store


@pytest.fixture(params=list(PATHS))
async def either_path(
    request: pytest.FixtureRequest, store_url: str
) -> AsyncIterator[SqlEventStore]:
    """A store per backend, once with the fast path on and once forced generic."""
    store = await open_sql_store(store_url, fast=PATHS[request.param])
    try:
        yield store
    finally:
        await store.close()


def counts(store: SqlEventStore) -> tuple[int, int]:
    return store.fast_groups, store.generic_groups


def consecutive(positions: object, after: int) -> bool:
    """A run of consecutive positions past `after` (Postgres may leave gaps between runs)."""
    assert isinstance(positions, list)
    return positions[0] > after and positions == list(range(positions[0], positions[-1] + 1))


async def test_plain_groups_take_the_fast_path(store_url: str, make_events: MakeEvents) -> None:
    store = await open_sql_store(store_url)
    try:
        encoded = codec.encode_array(np.arange(50, dtype=np.int32))
        first = await store.append("s", make_events(3), arrays=[encoded])
        await store.append("s", make_events(2, "b"), expected_seq=3)
        ref = await store.put_array(np.arange(7, dtype=np.int32))
        await store.put_array(np.arange(3, dtype=np.int32), extends=ref)  # parent checked
        await asyncio.gather(*(store.append(f"t{i}", make_events(1, f"t{i}")) for i in range(20)))
        assert store.generic_groups == 0 and store.fast_groups >= 5
        assert first == [1, 2, 3]
        assert [e.seq for e in await store.read_session("s")] == [0, 1, 2, 3, 4]
        assert (await store.get_array(encoded.ref)).tolist() == list(range(50))
        hooked: list[int] = []

        async def hook() -> None:
            hooked.append(await store.last_position())  # runs inside the open transaction

        store.before_commit = hook
        assert await store.append("s", make_events(1, "hooked")) == [26]
        assert hooked == [25] and store.generic_groups == 0
        if store_url.startswith("sqlite"):
            assert any(t.name.startswith("recorder-sqlite-writer") for t in threading.enumerate())
    finally:
        await store.close()
    assert not any(t.name.startswith("recorder-sqlite-writer") for t in threading.enumerate())
    async with await open_store(store_url) as cold:
        assert (await cold.get_array(encoded.ref)).tolist() == list(range(50))


async def test_big_plain_group_and_long_session(store_url: str, make_events: MakeEvents) -> None:
    """Groups of every size (Postgres COPYs big ones) after a long session's history."""
    store = await open_sql_store(store_url)
    try:
        for i in range(3):
            await store.append("long", make_events(1_000, f"h{i}"), expected_seq=1_000 * i)
        sizes = [1, 3, 49, 50, 51, 200]
        runs = await asyncio.gather(
            *(store.append("long" if n == 3 else f"n{n}", make_events(n, f"g{n}")) for n in sizes)
        )
        assert store.generic_groups == 0
        flat = [p for run in runs for p in run]
        assert flat == list(range(3_001, 3_001 + sum(sizes)))
        assert [e.seq for e in await store.read_session("long", from_seq=2_999)] == [
            2_999,
            3_000,
            3_001,
            3_002,
        ]
        assert [e.seq for e in await store.read_session("n200")] == list(range(200))
    finally:
        await store.close()


async def test_group_with_one_conflict(either_path: SqlEventStore, make_events: MakeEvents) -> None:
    base = await either_path.append("s", make_events(2, "base"))
    before = counts(either_path)
    ok, bad = await asyncio.gather(
        either_path.append("t", make_events(2, "ok")),
        either_path.append("s", make_events(3, "bad"), expected_seq=1),
        return_exceptions=True,
    )
    assert isinstance(bad, ConcurrencyConflict) and bad.actual_seq == 2
    assert consecutive(ok, after=base[-1]) and len(ok) == 2  # type: ignore[arg-type]
    assert counts(either_path)[1] == before[1] + 1  # redone (or done) on the generic path
    assert [e.session_id for e in await either_path.read_all()] == ["s", "s", "t", "t"]


async def test_resent_batch_gets_its_original_positions(
    either_path: SqlEventStore, make_events: MakeEvents
) -> None:
    batch = make_events(3)
    first = await either_path.append("s", batch)
    fresh = await either_path.append("s", make_events(1, "fresh"))
    resent, other = await asyncio.gather(
        either_path.append("s", batch), either_path.append("u", make_events(2, "u"))
    )
    assert resent == first and consecutive(other, after=fresh[0]) and len(other) == 2
    assert await either_path.append("s", batch, expected_seq=0) == first
    assert len(await either_path.read_all()) == 6


async def test_fast_path_survives_a_dropped_connection(
    store_url: str, make_events: MakeEvents, raw_execute: RawExecute
) -> None:
    """A server-side disconnect costs one group the generic path, then the fast path reconnects."""
    store = await open_sql_store(store_url)
    try:
        await store.append("s", make_events(1, "a"))
        if store_url.startswith("postgresql"):
            await raw_execute(
                store_url,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
        await store.append("s", make_events(1, "b"), expected_seq=1)
        await store.append("s", make_events(1, "c"), expected_seq=2)
        assert [e.seq for e in await store.read_session("s")] == [0, 1, 2]
        assert store.fast_groups >= 2 and store.generic_groups <= 1
    finally:
        await store.close()


async def test_connection_lost_before_commit(
    postgres_url: str, make_events: MakeEvents, raw_execute: RawExecute
) -> None:
    """Postgres: the fast path's connection dies inside its transaction; the group
    is redone on the generic path, stored once, and the next group reconnects."""
    store = await open_sql_store(postgres_url)
    killed: list[object] = []

    async def kill_writer() -> None:
        if not killed:  # the fast path's transaction is open; the pool's connections idle
            killed.extend(
                await raw_execute(
                    postgres_url,
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname ="
                    " current_database() AND state = 'idle in transaction'"
                    " AND pid <> pg_backend_pid()",
                )
            )

    try:
        await store.append("s", make_events(1, "a"))
        store.before_commit = kill_writer
        positions = await store.append("s", make_events(2, "b"), expected_seq=1)
        assert killed == [(True,)] and counts(store) == (1, 1)
        store.before_commit = None
        await store.append("s", make_events(1, "c"), expected_seq=3)
        assert counts(store) == (2, 1)
        stored = await store.read_session("s")
        assert [e.seq for e in stored] == [0, 1, 2, 3]
        assert [e.position for e in stored[1:3]] == positions
    finally:
        await store.close()


async def mixed_history(store: SqlEventStore) -> list[object]:
    """A scripted run full of edge cases; returns every outcome (error type, or
    positions as ranks in the final log: Postgres may leave gaps, SQLite not)."""

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
    stored = await store.read_all()
    rank = {e.position: k + 1 for k, e in enumerate(stored)}
    outcomes = [[rank[p] for p in o] if isinstance(o, list) else o for o in outcomes]
    log = [(rank[e.position], e.session_id, e.seq, e.event_id) for e in stored]
    arrays = (await store.get_array(b.ref)).tolist()
    return [*outcomes, log, arrays]


def _uuid(tag: str, i: int) -> uuid.UUID:
    return uuid.uuid5(uuid.NAMESPACE_OID, f"{tag}-{i}")


@pytest.fixture
def other_url(request: pytest.FixtureRequest, store_url: str) -> str:
    """A second empty database on `store_url`'s backend."""
    if store_url.startswith("sqlite"):
        return store_url.replace("runs.db", "other.db")
    return str(request.getfixturevalue("postgres_url"))


async def test_fast_and_generic_paths_agree(store_url: str, other_url: str) -> None:
    runs = {}
    for (name, fast), url in zip(PATHS.items(), (store_url, other_url), strict=True):
        store = await open_sql_store(url, fast=fast)
        try:
            runs[name] = await mixed_history(store)
            if fast:
                assert store.fast_groups >= 1 and store.generic_groups >= 3
            else:
                assert store.fast_groups == 0
        finally:
            await store.close()
    assert runs["fast"] == runs["generic"]
    outcomes = runs["generic"]
    assert outcomes[:5] == [[1, 2], [3], [4], "ConcurrencyConflict", [5]]
    assert outcomes[5:8] == [[1, 2], [6, 7], [3]]  # re-sent batches keep their positions
    assert outcomes[8:10] == ["ArrayNotFound", [8]]
    assert outcomes[10] == "IdempotencyConflict"


async def test_plain_group_follows_queue_order() -> None:
    def rows(n: int) -> list[EventRow]:
        return [EventRow(_uuid("p", i), "t", 1, 0.0, b"") for i in range(n)]

    plan = PlainGroup(
        [
            AppendRequest("a", rows(2), None),
            PiecesRequest([]),
            AppendRequest("b", rows(1), 4),
            AppendRequest("a", rows(1), 2),
        ]
    )
    assert plan.sessions == ["a", "b"]
    assert plan.place({"b": 4}, 10) == [[10, 11], None, [12], [13]]
    placed = [(r.position, s, q + k) for s, q, rs in plan.runs({"b": 4}) for k, r in enumerate(rs)]
    assert placed == [
        (10, "a", 0),
        (11, "a", 1),
        (12, "b", 4),
        (13, "a", 2),
    ]
    assert plan.place({"b": 3}, 10) is None  # b's expected_seq no longer matches
    assert plan.place({"a": 1, "b": 4}, 10) is None  # nor a's second append


async def test_unknown_parent_falls_back_and_fails_alone(store_url: str) -> None:
    store = await open_sql_store(store_url)
    try:
        ghost = ArrayRef(b"\x05" * 16, 2, "int32")
        ok, bad = await asyncio.gather(
            store.put_array(np.arange(5, dtype=np.int32)),
            store.put_array(np.arange(2, dtype=np.int32), extends=ghost),
            return_exceptions=True,
        )
        assert isinstance(ok, ArrayRef) and isinstance(bad, ArrayNotFound)
        assert counts(store) == (0, 1)
        assert (await store.get_array(ok)).tolist() == list(range(5))
    finally:
        await store.close()


async def test_sqlite_fsyncs_every_group_with_events(
    sqlite_url: str, make_events: MakeEvents
) -> None:
    """Array pieces alone and `durable=False` appends commit without an fsync; any
    other append commits with it (synchronous=FULL), which covers what came before."""
    from recorder.log.store.sqlite import SqliteEventStore

    store = await open_sql_store(sqlite_url)
    assert isinstance(store, SqliteEventStore)

    async def synchronous() -> int:
        conn = store._one_hop._conn
        assert conn is not None
        loop = asyncio.get_running_loop()
        executor = store._one_hop._executor
        ((mode,),) = await loop.run_in_executor(
            executor, lambda: conn.execute("PRAGMA synchronous").fetchall()
        )
        return int(mode)

    try:
        ref = await store.put_array(np.arange(9, dtype=np.int32))
        assert await synchronous() == 1  # NORMAL
        more = codec.encode_array(np.arange(3, dtype=np.int32), extends=ref)
        await store.append("s", make_events(2, "a"), arrays=[more], durable=False)
        assert await synchronous() == 1
        await store.append("s", make_events(2, "b"))
        assert await synchronous() == 2  # FULL
        assert counts(store) == (3, 0)
        assert (await store.get_array(more.ref)).tolist() == [*range(9), *range(3)]
        assert [r.seq for r in await store.read_session("s")] == [0, 1, 2, 3]
    finally:
        await store.close()
