"""Many writers on separate connections, a tailing reader, and lock contention."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable

from recorder.log.events import NewEvent, SandboxEvent
from recorder.log.store import ConcurrencyConflict, EventStore, open_store
from recorder.log.store.sql import SqlEventStore

MakeEvents = Callable[..., list[NewEvent]]


def _slow_commit(seed: int) -> Callable[[], asyncio.Future[None]]:
    """Hold each write transaction open a random 0-3 ms before COMMIT."""
    rng = random.Random(seed)

    def hook() -> asyncio.Future[None]:
        return asyncio.ensure_future(asyncio.sleep(rng.uniform(0, 0.003)))

    return hook


async def store_caught_up(reader: EventStore, tail: asyncio.Task[None], last: int) -> None:
    """Wait for the tail to reach `last` (it may already be parked past every event)."""
    if await reader.last_position() < last:
        raise AssertionError("an acknowledged event is not visible to a new reader")
    await asyncio.wait_for(tail, 30)


async def test_tailing_reader_sees_every_commit_in_commit_order(
    store_url: str, make_events: MakeEvents
) -> None:
    writers = [await open_store(store_url, create=True) for _ in range(8)]
    reader = await open_store(store_url)
    clock = itertools.count()
    acked: list[tuple[int, int, list[int]]] = []  # (submitted, acknowledged, positions)
    batches_per_writer = 40
    rng = random.Random(1)
    sizes = [[rng.randint(1, 3) for _ in range(batches_per_writer)] for _ in writers]
    total = sum(map(sum, sizes))

    async def write(w: int, store: EventStore) -> None:
        assert isinstance(store, SqlEventStore)
        store.before_commit = _slow_commit(w)
        for b, n in enumerate(sizes[w]):
            submitted = next(clock)
            positions = await store.append(f"w{w}", make_events(n, f"{w}.{b}"))
            acked.append((submitted, next(clock), positions))

    seen: list[int] = []
    last_committed: list[int] = []  # set once every writer is done

    async def tail() -> None:
        async for ev in reader.follow(page_size=7, poll_interval=0.001):
            seen.append(ev.position)
            if last_committed and ev.position >= last_committed[0]:
                return

    try:
        tail_task = asyncio.create_task(tail())
        await asyncio.gather(*(write(i, s) for i, s in enumerate(writers)))
        last_committed.append(max(p for _, _, ps in acked for p in ps))
        await store_caught_up(reader, tail_task, last_committed[0])
    finally:
        for s in [*writers, reader]:
            await s.close()

    committed = sorted(p for _, _, ps in acked for p in ps)
    assert len(committed) == total
    assert seen == committed, "the tailing reader missed or reordered committed events"
    # A batch acknowledged before another was submitted has the lower positions.
    for (_, ack_a, pos_a), (sub_b, _, pos_b) in itertools.product(acked, acked):
        if ack_a < sub_b:
            assert max(pos_a) < min(pos_b)


async def test_sqlite_eight_writers_read_then_append_never_locked(
    sqlite_url: str,
) -> None:
    first = await open_store(sqlite_url, create=True)
    writers = [first] + [await open_store(sqlite_url) for _ in range(7)]
    conflicts = 0

    async def work(w: int, store: EventStore) -> None:
        nonlocal conflicts
        for i in range(100):
            own = await store.read_session(f"own{w}")
            await store.append(
                f"own{w}", [NewEvent(event=SandboxEvent(kind=f"{w}:{i}"))], expected_seq=len(own)
            )
            if i % 10 == 0:
                while True:
                    shared = await store.read_session("shared")
                    try:
                        await store.append(
                            "shared",
                            [NewEvent(event=SandboxEvent(kind=f"{w}:{i}"))],
                            expected_seq=len(shared),
                        )
                        break
                    except ConcurrencyConflict:
                        conflicts += 1

    try:
        # Any "database is locked" OperationalError would propagate from gather.
        await asyncio.gather(*(work(i, s) for i, s in enumerate(writers)))
        for w in range(8):
            kinds = [e.event.kind for e in await first.read_session(f"own{w}")]  # type: ignore[union-attr]
            assert kinds == [f"{w}:{i}" for i in range(100)]
        shared = await first.read_session("shared")
        assert [e.seq for e in shared] == list(range(80))
        assert len({e.event.kind for e in shared}) == 80  # type: ignore[union-attr]
        assert len(await first.read_all(limit=10_000)) == 880
    finally:
        for s in writers:
            await s.close()
