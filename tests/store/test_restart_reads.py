"""The reads a restarted server makes: a session from its newest snapshot, whole piece chains."""

from __future__ import annotations

import numpy as np
import pytest

from recorder.log.events import NewEvent, SandboxEvent, SessionOpened, StateSnapshot
from recorder.log.store import ArrayNotFound, EventStore, open_store


def _snapshot(k: int) -> StateSnapshot:
    return StateSnapshot(format=1, state=bytes([k]))


async def test_read_session_from_last_starts_at_the_newest_match(store: EventStore) -> None:
    other = [NewEvent(event=SandboxEvent(kind=f"x{k}")) for k in range(3)]
    await store.append("s", [NewEvent(event=SessionOpened(session_id="s"))])
    await store.append("s", [other[0], NewEvent(event=_snapshot(1)), other[1]])
    await store.append("s", [NewEvent(event=_snapshot(2)), other[2]])
    await store.append("t", [NewEvent(event=_snapshot(9))])  # another session's: not seen
    types = ("state_snapshot", "session_opened")
    got = await store.read_session_from_last("s", types)
    assert [r.seq for r in got] == [4, 5]
    assert got[0].event == _snapshot(2)
    opened = await store.read_session_from_last("s", ("session_opened",))
    assert [r.seq for r in opened] == [0, 1, 2, 3, 4, 5]
    assert [r.seq for r in await store.read_session_from_last("s", ("nothing",))] == list(range(6))
    assert await store.read_session_from_last("missing", types) == []


async def test_a_cold_read_fetches_whole_chains_in_one_round(store_url: str) -> None:
    """`cold=True` reads each array's piece chain with one recursive query; same arrays."""
    parts = [np.arange(k * 7, k * 7 + 7, dtype=np.int32) for k in range(60)]
    async with await open_store(store_url, create=True) as w:
        refs = []
        for seed in range(3):
            ref = None
            for part in parts:
                ref = await w.put_array(part + seed, extends=ref)
            refs.append(ref)
        shared = await w.put_array(parts[0], extends=refs[0])  # shares refs[0]'s chain
    expected = [np.concatenate(parts) + seed for seed in range(3)]
    expected.append(np.concatenate([expected[0], parts[0]]))
    for cold in (True, False):
        async with await open_store(store_url) as r:
            calls = 0
            fetch = r._reader._rows  # type: ignore[attr-defined]

            async def counting(*args: object, _fetch: object = fetch) -> object:
                nonlocal calls
                calls += 1
                return await _fetch(*args)  # type: ignore[operator]

            r._reader._rows = counting  # type: ignore[attr-defined]
            got = await r.get_arrays([*refs, shared], cold=cold)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
        assert calls == (0 if cold else len(parts))  # else one round per chain depth


async def test_a_cold_read_of_a_missing_array_raises(store_url: str) -> None:
    async with await open_store(store_url, create=True) as w:
        ref = await w.put_array(np.arange(5, dtype=np.int32))
    missing = type(ref)(b"\x07" * 16, 3)
    async with await open_store(store_url) as r:
        with pytest.raises(ArrayNotFound):
            await r.get_arrays([ref, missing], cold=True)
