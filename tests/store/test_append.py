"""Appends: optimistic concurrency, atomic batches, idempotency, contiguity."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest

from recorder.log.events import NewEvent, SandboxEvent
from recorder.log.store import ConcurrencyConflict, EventStore, IdempotencyConflict, open_store

MakeEvents = Callable[..., list[NewEvent]]


async def test_append_and_read_back(store: EventStore, make_events: MakeEvents) -> None:
    batch = make_events(3, "a")
    positions = await store.append("s1", batch)
    await store.append("s2", make_events(2, "b"))
    await store.append("s1", make_events(1, "c"), expected_seq=3)
    got = await store.read_session("s1")
    assert [e.seq for e in got] == [0, 1, 2, 3]
    assert [e.event for e in got[:3]] == [ne.event for ne in batch]
    assert [e.event_id for e in got[:3]] == [ne.event_id for ne in batch]
    assert [e.position for e in got[:3]] == positions
    assert [e.seq for e in await store.read_session("s1", from_seq=2)] == [2, 3]
    assert await store.session_ids() == ["s1", "s2"]
    sizes = await store.session_sizes()
    assert sizes == {"s1": 4, "s2": 2} and list(sizes) == ["s1", "s2"]  # first appearance
    assert await store.last_position() == max(e.position for e in await store.read_all())
    page = await store.read_all(after=positions[0], limit=2)
    assert [e.position for e in page] == positions[1:]


async def test_concurrent_appends_at_same_seq_one_wins(
    store_url: str, make_events: MakeEvents
) -> None:
    a = await open_store(store_url, create=True)
    b = await open_store(store_url)
    try:
        await a.append("s", make_events(2, "base"))
        results = await asyncio.gather(
            a.append("s", make_events(3, "a"), expected_seq=2),
            b.append("s", make_events(3, "b"), expected_seq=2),
            return_exceptions=True,
        )
        wins = [r for r in results if isinstance(r, list)]
        losses = [r for r in results if isinstance(r, ConcurrencyConflict)]
        assert len(wins) == 1 and len(losses) == 1, results
        assert losses[0].expected_seq == 2 and losses[0].actual_seq == 5
        events = await a.read_session("s")
        assert len(events) == 5
        tags = {e.event.kind.split("-")[0] for e in events[2:]}  # type: ignore[union-attr]
        assert len(tags) == 1, "the loser wrote some of its events"
    finally:
        await a.close()
        await b.close()


async def test_conflicting_batch_writes_nothing_others_in_group_commit(
    store: EventStore, make_events: MakeEvents
) -> None:
    await store.append("s", make_events(2, "base"))
    # Gathered into one group: the middle batch conflicts, the others commit.
    results = await asyncio.gather(
        store.append("t", make_events(2, "ok1")),
        store.append("s", make_events(4, "bad"), expected_seq=1),
        store.append("s", make_events(1, "ok2"), expected_seq=2),
        return_exceptions=True,
    )
    assert isinstance(results[1], ConcurrencyConflict)
    assert isinstance(results[0], list) and isinstance(results[2], list)
    kinds = [e.event.kind for e in await store.read_session("s")]  # type: ignore[union-attr]
    assert kinds == ["base-0", "base-1", "ok2-0"]
    assert len(await store.read_all()) == 5


async def test_resend_is_idempotent_and_changed_payload_rejected(
    store: EventStore, make_events: MakeEvents
) -> None:
    batch = make_events(3)
    first = await store.append("s", batch)
    await store.append("s", make_events(1, "later"))
    # Retrying after a lost ack: same positions, nothing new, expected_seq ignored.
    assert await store.append("s", batch, expected_seq=0) == first
    assert await store.append("s", batch) == first
    assert len(await store.read_all()) == 4

    changed = [
        NewEvent(event_id=batch[0].event_id, event=SandboxEvent(kind="changed")),
        *batch[1:],
    ]
    with pytest.raises(IdempotencyConflict, match="different content"):
        await store.append("s", changed)
    with pytest.raises(IdempotencyConflict, match="different content"):
        await store.append("other-session", batch)
    with pytest.raises(IdempotencyConflict, match="mixes"):
        await store.append("s", [batch[0], *make_events(1, "new")])
    assert len(await store.read_all()) == 4


async def test_duplicate_batch_in_one_group_returns_same_positions(
    store: EventStore, make_events: MakeEvents
) -> None:
    batch = make_events(2)
    a, b = await asyncio.gather(store.append("s", batch), store.append("s", batch))
    assert a == b
    assert len(await store.read_all()) == 2


async def test_each_batch_is_one_contiguous_run(store_url: str, make_events: MakeEvents) -> None:
    stores = [await open_store(store_url, create=True) for _ in range(3)]
    rng = random.Random(7)
    try:
        jobs = [
            stores[i % 3].append(f"s{i % 5}", make_events(rng.randint(1, 6), f"b{i}"))
            for i in range(60)
        ]
        batches = await asyncio.gather(*jobs)
        taken: set[int] = set()
        for positions in batches:
            assert positions == list(range(positions[0], positions[0] + len(positions)))
            assert not taken & set(positions)
            taken |= set(positions)
        # No other batch's event falls inside a batch's run.
        log = [e.position for e in await stores[0].read_all(limit=10_000)]
        assert sorted(log) == sorted(taken)
        for s in range(5):
            seqs = [e.seq for e in await stores[0].read_session(f"s{s}")]
            assert seqs == list(range(len(seqs)))
    finally:
        for s in stores:
            await s.close()


async def test_follow_yields_events_appended_later(
    store: EventStore, make_events: MakeEvents
) -> None:
    await store.append("s", make_events(2))
    seen: list[int] = []

    async def tail() -> None:
        async for ev in store.follow(poll_interval=0.01):
            seen.append(ev.position)
            if len(seen) == 5:
                return

    task = asyncio.create_task(tail())
    await asyncio.sleep(0.05)
    await store.append("s", make_events(3, "late"))
    await asyncio.wait_for(task, 10)
    assert seen == sorted(seen) and len(set(seen)) == 5


async def test_empty_append_writes_nothing(store: EventStore) -> None:
    assert await store.append("s", []) == []
    assert await store.last_position() == 0
    assert await store.session_ids() == []
    assert await store.session_sizes() == {}


async def test_batch_with_repeated_event_id_rejected(store: EventStore) -> None:
    ne = NewEvent(event=SandboxEvent(kind="x"))
    with pytest.raises(IdempotencyConflict, match="twice"):
        await store.append("s", [ne, ne])


async def test_resent_and_changed_batches_inside_a_group(
    store: EventStore, make_events: MakeEvents, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast path hits the event_id index; the group is redone with id look-ups."""
    batch = make_events(3, "a")
    original = await store.append("s", batch)
    changed = [NewEvent(event_id=batch[0].event_id, event=SandboxEvent(kind="changed"))]
    attempts: list[tuple[int, bool]] = []
    real = store._write_group  # type: ignore[attr-defined]

    async def spy(group: list[object], *, look_up_ids: bool) -> object:
        attempts.append((len(group), look_up_ids))
        return await real(group, look_up_ids=look_up_ids)

    monkeypatch.setattr(store, "_write_group", spy)
    fresh1, resent, conflict, fresh2 = await asyncio.gather(
        store.append("t", make_events(2, "fresh1")),
        store.append("s", batch),  # a retry after a lost acknowledgement
        store.append("u", changed),  # a known id with other content
        store.append("s", make_events(2, "fresh2")),
        return_exceptions=True,
    )
    assert attempts == [(4, False), (4, True)]
    assert resent == original
    assert isinstance(conflict, IdempotencyConflict)
    assert isinstance(fresh1, list) and isinstance(fresh2, list)
    # One group: the new events form one run after the earlier batch, in queue order.
    assert fresh1[0] > original[-1]
    assert fresh1 + fresh2 == list(range(fresh1[0], fresh1[0] + 4))
    session = await store.read_session("s")
    assert [e.event.kind for e in session] == ["a-0", "a-1", "a-2", "fresh2-0", "fresh2-1"]  # type: ignore[union-attr]
    assert [e.seq for e in session] == [0, 1, 2, 3, 4]
    assert len(await store.read_all()) == 7


async def test_request_failing_on_every_path_fails_alone(
    store: EventStore, make_events: MakeEvents, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the look-up retry fails too, each request gets its own transaction."""
    # The driver failure is simulated on the generic path, so the store must take it.
    monkeypatch.setattr(store, "fast_writes", False)
    real = store._insert_events  # type: ignore[attr-defined]

    async def insert(conn: object, rows: list[tuple[str, int, object]]) -> None:
        if any(session_id == "poison" for session_id, _, _ in rows):
            raise RuntimeError("simulated driver failure")
        await real(conn, rows)

    monkeypatch.setattr(store, "_insert_events", insert)
    a, bad, b = await asyncio.gather(
        store.append("a", make_events(2, "a")),
        store.append("poison", make_events(1, "p")),
        store.append("b", make_events(3, "b")),
        return_exceptions=True,
    )
    assert isinstance(bad, RuntimeError)
    assert isinstance(a, list) and isinstance(b, list)
    assert len(a) == 2 and len(b) == 3
    assert sorted(e.session_id for e in await store.read_all()) == ["a"] * 2 + ["b"] * 3


async def test_group_spanning_many_sessions_reads_every_head(
    store: EventStore, make_events: MakeEvents
) -> None:
    """More sessions in one group than one IN (...) list holds (the head query is chunked)."""
    sessions = [f"s{i:04d}" for i in range(1200)]
    for expected in (0, 1):
        positions = await asyncio.gather(
            *(store.append(s, make_events(1, s), expected_seq=expected) for s in sessions)
        )
        flat = [p for ps in positions for p in ps]
        assert flat == list(range(flat[0], flat[0] + len(sessions)))
    assert [e.seq for e in await store.read_session("s1199")] == [0, 1]
    assert await store.last_position() == flat[-1]


async def test_closes_after_names_each_close_once(
    store: EventStore, make_events: MakeEvents
) -> None:
    """What a replica polls for closes served elsewhere (issue 24 item 2): each close
    once, in commit order, none at or before `after`; the backend's one query agrees
    with the default that pages through the log."""
    from recorder.log.events import SessionClosed

    def closed() -> list[NewEvent]:
        return [NewEvent(event=SessionClosed(status="completed"))]

    assert await store.closes_after(0) == (0, [])
    await store.append("a", make_events(2, "a"))
    await store.append("b", make_events(1, "b"))
    await store.append("b", closed(), expected_seq=1)
    head, ids = await store.closes_after(0)
    assert (head, ids) == (await store.last_position(), ["b"])
    assert await EventStore.closes_after(store, 0) == (head, ids)
    await store.append("a", closed(), expected_seq=2)
    await store.append("c", make_events(1, "c"))
    later, ids = await store.closes_after(head)
    assert (later, ids) == (await store.last_position(), ["a"])
    assert await EventStore.closes_after(store, head) == (later, ids)
    assert await store.closes_after(later) == (later, [])
