"""Session registry and journal, without a server: load-once, locking, ordered steps."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from recorder.log.events import NewEvent, SandboxEvent
from recorder.log.store.arrays import EncodedArray
from recorder.log.store.base import ConcurrencyConflict
from recorder.server.deltas import BodyPrefixes
from recorder.server.journal import Journal, finish_even_if_cancelled
from recorder.server.sessions import SessionRegistry, SessionState


class FakeStore:
    """Just enough of EventStore.append: expected-seq checks and a slow commit."""

    def __init__(self, delay: float = 0.0) -> None:
        self.rows: list[tuple[str, int, str]] = []
        self.arrays: list[list[bytes]] = []  # digests written with each append
        self.delay = delay

    async def append(
        self,
        session_id: str,
        events: Sequence[NewEvent],
        *,
        expected_seq: int | None = None,
        arrays: Sequence[EncodedArray] = (),
    ) -> list[int]:
        await asyncio.sleep(self.delay)
        seq = sum(1 for r in self.rows if r[0] == session_id)
        if expected_seq is not None and expected_seq != seq:
            raise ConcurrencyConflict(session_id, expected_seq, seq)
        for i, e in enumerate(events):
            self.rows.append((session_id, seq + i, e.event.kind))  # type: ignore[union-attr]
        self.arrays.append([a.ref.digest for a in arrays])
        return list(range(seq, seq + len(events)))


def mark(name: str) -> SandboxEvent:
    return SandboxEvent(kind=name)


async def test_registry_loads_a_session_once_when_raced() -> None:
    calls = 0

    async def loader(session_id: str) -> SessionState | None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        if session_id == "missing":
            return None
        return SessionState(session_id=session_id, journal=Journal(FakeStore(), session_id, 0))  # type: ignore[arg-type]

    registry = SessionRegistry(loader)
    states = await asyncio.gather(*(registry.get("s1") for _ in range(10)))
    assert calls == 1 and all(s is states[0] for s in states)
    assert await registry.get("missing") is None
    assert await registry.get("not a valid id!") is None
    assert calls == 2  # an id that cannot be a session never reaches the log


async def test_only_the_most_recently_closed_sessions_stay_cached() -> None:
    loads: list[str] = []

    def closed(session_id: str) -> SessionState:
        state = SessionState(session_id=session_id, journal=Journal(FakeStore(), session_id, 0))  # type: ignore[arg-type]
        state.status = "closed"
        return state

    async def loader(session_id: str) -> SessionState | None:
        loads.append(session_id)
        return closed(session_id)

    registry = SessionRegistry(loader, max_closed=2)
    live = SessionState(session_id="live", journal=Journal(FakeStore(), "live", 0))  # type: ignore[arg-type]
    registry.put(live)
    busy = closed("busy")
    await busy.lock.acquire()  # a request still holds it
    for state in (busy, closed("a"), closed("b"), closed("c")):
        registry.put(state)
    assert registry.cached("a") is None  # dropped: older than the 2 newest
    assert registry.cached("busy") is busy  # in use: kept
    assert registry.cached("live") is live  # open sessions are never dropped
    assert len(registry) == 4
    again = await registry.get("a")  # named again: reloaded from the log
    assert again is not None and again.status == "closed" and loads == ["a"]
    busy.lock.release()
    registry.put(closed("d"))  # the next close drops what is now idle and old
    assert registry.cached("busy") is None and registry.cached("live") is live
    assert [sid for sid in "abcd" if registry.cached(sid)] == ["a", "d"]  # the reload counts
    reopened = SessionState(session_id="d", journal=Journal(FakeStore(), "d", 0))  # type: ignore[arg-type]
    registry.put(reopened)  # open again: no longer counted among the closed
    registry.put(closed("e"))
    registry.put(closed("f"))
    assert registry.cached("d") is reopened and registry.cached("a") is None


async def test_sessions_closed_elsewhere_leave_the_cache_once_idle() -> None:
    """Issue 24 item 2: a close another replica served drops the session held here as
    open; one in use is kept (and named back to be passed again); one closed here
    stays among the bounded closed ones; the next request rebuilds it from the log."""

    def state(session_id: str) -> SessionState:
        return SessionState(session_id=session_id, journal=Journal(FakeStore(), session_id, 0))  # type: ignore[arg-type]

    async def loader(session_id: str) -> SessionState | None:
        reloaded = state(session_id)
        reloaded.status = "closed"
        return reloaded

    registry = SessionRegistry(loader)
    idle, busy, here, kept = state("idle"), state("busy"), state("here"), state("kept")
    here.status = "closed"
    for s in (idle, busy, here, kept):
        registry.put(s)
    await busy.lock.acquire()
    assert registry.forget_closed(["idle", "busy", "here", "idle", "never"]) == ["busy"]
    assert registry.cached("idle") is None and registry.cached("busy") is busy
    assert registry.cached("here") is here and registry.cached("kept") is kept
    assert registry.open_count() == 2 and registry.closed_elsewhere == 1
    busy.lock.release()
    assert registry.forget_closed(["busy"]) == []
    assert registry.cached("busy") is None and registry.open_count() == 1
    again = await registry.get("idle")
    assert again is not None and again.status == "closed"


async def test_the_cache_is_bounded_by_memory_least_recently_used_idle_first() -> None:
    """Issue 24 item 2: open sessions count too. Past the bound, the least recently
    used idle sessions leave memory (one in use stays); named again, one is rebuilt."""
    loads: list[str] = []

    async def loader(session_id: str) -> SessionState | None:
        loads.append(session_id)
        return SessionState(session_id=session_id, journal=Journal(FakeStore(), session_id, 0))  # type: ignore[arg-type]

    async def turn_with_body(state: SessionState) -> None:
        state.body_prefixes = BodyPrefixes(window=b"x" * 1000)

    registry = SessionRegistry(loader, max_held_bytes=2500)
    for sid in ("a", "b"):
        await registry.locked(sid, turn_with_body)
    assert registry.held_total == 2000 and len(registry) == 2
    busy = await registry.acquire("a")  # "a" is in use: the oldest, yet kept
    assert busy is not None
    await registry.locked("c", turn_with_body)
    assert registry.cached("b") is None and registry.cached("a") is busy
    assert registry.held_total <= 2500 and registry.shed == 1
    registry.release(busy)  # now the most recently used
    assert registry.open_count() == 2 and registry.held_total == 2000
    await registry.locked("b", turn_with_body)  # rebuilt from the log
    assert loads == ["a", "b", "c", "b"] and registry.cached("c") is None
    assert registry.cached("a") is busy
    assert registry.held_total == 2000 and registry.shed == 2


async def test_a_cancelled_loader_does_not_cancel_the_requests_waiting_for_it() -> None:
    release = asyncio.Event()
    loads = 0

    async def loader(session_id: str) -> SessionState | None:
        nonlocal loads
        loads += 1
        await release.wait()
        return SessionState(session_id=session_id, journal=Journal(FakeStore(), session_id, 0))  # type: ignore[arg-type]

    registry = SessionRegistry(loader)
    first = asyncio.create_task(registry.get("s"))  # starts the load
    await asyncio.sleep(0)
    second = asyncio.create_task(registry.get("s"))  # waits for that load
    await asyncio.sleep(0)
    first.cancel()  # the first client disconnects mid-load
    with pytest.raises(asyncio.CancelledError):
        await first
    release.set()
    state = await second
    assert state is not None and state.session_id == "s"
    assert loads == 2  # the waiter loaded the session itself


async def test_suspect_state_is_rebuilt_under_the_same_lock() -> None:
    loads = 0

    async def loader(session_id: str) -> SessionState | None:
        nonlocal loads
        loads += 1
        return SessionState(session_id=session_id, journal=Journal(FakeStore(), session_id, 0))  # type: ignore[arg-type]

    registry = SessionRegistry(loader)
    first = await registry.acquire("s")
    assert first is not None
    waiter = asyncio.create_task(registry.acquire("s"))
    await asyncio.sleep(0.01)
    first.suspect = True  # the running turn failed unexpectedly
    first.lock.release()
    second = await waiter
    assert second is not None and second is not first
    assert second.lock is first.lock and second.lock.locked()
    assert loads == 2
    second.lock.release()


async def test_steps_run_in_order_and_flush_waits_for_them() -> None:
    store = FakeStore(delay=0.01)
    journal = Journal(store, "s", 0)  # type: ignore[arg-type]
    slow = asyncio.Event()

    async def first() -> None:
        await slow.wait()
        journal.add(mark("a"))
        await journal.flush_buffer()

    async def second() -> None:
        journal.add(mark("b"))

    journal.then(first)
    journal.then(second)
    asyncio.get_running_loop().call_later(0.05, slow.set)
    await journal.write(mark("c"))
    assert [r[2] for r in store.rows] == ["a", "b", "c"]
    assert journal.next_seq == 3


async def test_a_failed_step_fails_the_rest_and_surfaces_in_flush() -> None:
    journal = Journal(FakeStore(), "s", 0)  # type: ignore[arg-type]
    ran: list[str] = []

    async def boom() -> None:
        raise RuntimeError("store down")

    async def after() -> None:
        ran.append("after")

    journal.then(boom)
    journal.then(after)
    with pytest.raises(RuntimeError, match="store down"):
        await journal.flush()
    assert ran == []
    await journal.settle()  # the turn ends: the failure was reported, the buffer is clean
    journal.add(mark("x"))
    await journal.flush()
    assert journal.next_seq == 1


async def test_a_cancelled_caller_does_not_cut_a_write_in_half() -> None:
    store = FakeStore(delay=0.05)
    journal = Journal(store, "s", 0)  # type: ignore[arg-type]
    task = asyncio.create_task(finish_even_if_cancelled(journal.write(mark("a"))))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [r[2] for r in store.rows] == ["a"]
    assert journal.next_seq == 1  # the seq followed the write that did land


async def test_finish_even_if_cancelled_hands_back_what_the_work_ended_with() -> None:
    async def work(result: str, delay: float = 0.0) -> str:
        await asyncio.sleep(delay)
        if result == "boom":
            raise ValueError(result)
        return result

    assert await finish_even_if_cancelled(work("done")) == "done"
    with pytest.raises(ValueError, match="boom"):
        await finish_even_if_cancelled(work("boom"))
    # Cancelled twice while it works: the work still ends, then the cancel is raised.
    finished: list[str] = []

    async def slow() -> None:
        await asyncio.sleep(0.05)
        finished.append("slow")

    task = asyncio.create_task(finish_even_if_cancelled(slow()))
    for _ in range(2):
        await asyncio.sleep(0.01)
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == ["slow"]
    # A failure of the work wins over the caller's cancel (it must be reported).
    task = asyncio.create_task(finish_even_if_cancelled(work("boom", 0.03)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(ValueError, match="boom"):
        await task


async def test_conflict_keeps_the_batch_for_the_caller() -> None:
    store = FakeStore()
    await store.append("s", [NewEvent(event=mark("other writer"))])
    journal = Journal(store, "s", 0)  # type: ignore[arg-type]
    journal.add(mark("a"))
    with pytest.raises(ConcurrencyConflict):
        await journal.flush()
    assert len(journal.pending) == 1 and journal.next_seq == 0


def test_journal_event_ids_are_unique_and_time_ordered() -> None:
    from recorder.log.ids import uuid7

    ids = [uuid7() for _ in range(10_000)]
    assert len(set(ids)) == 10_000
    assert ids == sorted(ids)
    assert all(i.version == 7 for i in ids[:10])


async def test_held_background_work_starts_on_release_or_drain() -> None:
    journal = Journal(FakeStore(), "s", 0)  # type: ignore[arg-type]
    started: list[str] = []

    async def work(name: str) -> str:
        started.append(name)
        return name

    journal.hold()
    held = journal.background(lambda: work("held"))
    await asyncio.sleep(0.01)
    assert started == []  # waits while the engine request is being sent
    journal.release()
    assert await held == "held"
    free = journal.background(lambda: work("free"))  # not held: starts at once
    assert await free == "free"
    journal.hold()
    late = journal.background(lambda: work("late"))

    async def needs_it() -> None:
        await late

    journal.then(needs_it)
    await asyncio.wait_for(journal.drain(), 1)  # draining releases: no deadlock
    assert started == ["held", "free", "late"]


async def test_arrays_travel_with_the_next_append_and_survive_a_refusal() -> None:
    store = FakeStore()
    await store.append("s", [NewEvent(event=mark("other writer"))])
    journal = Journal(store, "s", 0)  # type: ignore[arg-type]
    ref = journal.add_array(np.arange(50, dtype=np.int32))
    journal.add(mark("a"))
    with pytest.raises(ConcurrencyConflict):
        await journal.flush()
    journal.next_seq = 1  # the caller re-read the stream
    await journal.flush()
    assert store.arrays[-1] == [ref.digest]  # kept for the retry, written with its event
    assert ref.length == 50 and ref.dtype == "int32"
