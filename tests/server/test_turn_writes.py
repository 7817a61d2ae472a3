"""How many store writes a turn costs, and the journal machinery that keeps it at two.

A turn's request body, engine input, request events and first attempt go to
the log in one append while the engine works (its claim), its answer in one
more (durable, before the client sees it): two commits, each a thread hop on
SQLite and round trips on Postgres. The journal gets there by buffering arrays
like events (`Journal.arrays`), running its queued steps in one task, and
buffering an engine result at once when no step is queued.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np

from recorder.log import events as ev
from recorder.log.events import SandboxEvent
from recorder.log.store import open_store
from recorder.server.journal import Journal
from tests.server.conftest import Harness
from tests.server.test_e2e import ONE_TURN_LOG, ask, echo


def _writes(h: Harness) -> int:
    store = h.store
    return store.fast_groups + store.generic_groups  # type: ignore[attr-defined]


async def test_a_turn_costs_two_store_writes_and_stores_its_request_whole(
    any_harness: Harness,
) -> None:
    h = any_harness
    sid = await h.open_session()
    messages = [{"role": "user", "content": "first question " * 40}]
    answer = await ask(h.client(sid), messages, stream=False)
    assert await h.types(sid) == ONE_TURN_LOG
    for stream in (False, True):  # each turn extends the chain and stores its body as deltas
        messages = [*messages, echo(answer), {"role": "user", "content": f"next {stream}"}]
        before = _writes(h)
        answer = await ask(h.client(sid), messages, stream=stream)
        assert _writes(h) == before + 2
    requests = await h.payloads(sid, ev.MessagesRequest)
    rendered = await h.payloads(sid, ev.RenderedInput)
    assert len(requests) == len(rendered) == 3
    body = (await h.store.get_array(requests[-1].body)).tobytes()
    assert json.loads(body)["messages"] == messages
    engine_input = h.engine.requests[-1].input_ids
    assert await h.array(rendered[-1].input_ids) == engine_input


class _CountingStore:
    """A real store that counts its appends."""

    def __init__(self, store: object) -> None:
        self._store = store
        self.appends = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def append(self, *args: object, **kwargs: object) -> object:
        self.appends += 1
        return await self._store.append(*args, **kwargs)  # type: ignore[attr-defined]


async def test_buffered_arrays_are_written_by_the_next_append_only(sqlite_url: str) -> None:
    store = await open_store(sqlite_url, create=True)
    try:
        counting = _CountingStore(store)
        journal = Journal(counting, "s", 0)  # type: ignore[arg-type]
        first = await journal.arrays.put_array(np.arange(50, dtype=np.int32))
        second = await journal.arrays.put_array(np.arange(50, 80, dtype=np.int32), extends=first)
        assert store.fast_groups + store.generic_groups == 0  # nothing written yet
        landed: list[int] = []
        journal.after_append(lambda: landed.append(journal.next_seq))
        journal.add(SandboxEvent(kind="names the arrays"))
        assert landed == []
        await journal.flush()
        assert landed == [1] and counting.appends == 1
        assert store.fast_groups + store.generic_groups == 1  # arrays and event: one commit
        assert (await store.get_array(second)).tolist() == list(range(80))
    finally:
        await store.close()


async def test_a_dropped_buffer_never_runs_its_after_append_callbacks(sqlite_url: str) -> None:
    store = await open_store(sqlite_url, create=True)
    try:
        journal = Journal(store, "s", 0)
        ran: list[str] = []
        journal.add(SandboxEvent(kind="never written"))
        journal.after_append(lambda: ran.append("dropped"))
        await journal.settle()
        journal.add(SandboxEvent(kind="written"))
        journal.after_append(lambda: ran.append("written"))
        await journal.flush()
        assert ran == ["written"]
        assert [r.event.kind for r in await store.read_session("s")] == ["written"]  # type: ignore[union-attr]
    finally:
        await store.close()


async def test_buffering_runs_at_once_when_idle_and_in_order_otherwise(sqlite_url: str) -> None:
    store = await open_store(sqlite_url, create=True)
    try:
        journal = Journal(store, "s", 0)
        order: list[str] = []
        journal.now_or_then(lambda: order.append("idle: at once"))
        assert order == ["idle: at once"] and not journal.busy
        gate = asyncio.Event()

        async def slow() -> None:
            await gate.wait()
            order.append("slow step")

        journal.then(slow)
        journal.now_or_then(lambda: order.append("after the slow step"))
        await asyncio.sleep(0.01)
        assert order == ["idle: at once"] and journal.busy
        gate.set()
        await journal.drain()
        assert order == ["idle: at once", "slow step", "after the slow step"]
        assert not journal.busy
    finally:
        await store.close()
