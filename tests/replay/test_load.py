"""Loading sessions from a real store: one session, and the bounded-memory stream."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from builders import Log, small_logs, write_to
from click.testing import CliRunner

from recorder.log.events import ArrayRef, RecordedEvent, SandboxEvent
from recorder.log.store import CorruptArray, EventStore, StoreOptions, open_store
from recorder.log.store.sql import SqlEventStore
from replay import close_session_samples
from replay.export import export_samples
from replay.load import iter_session_logs, load_arrays, load_session, needed_refs
from replay.reclassify import reclassify
from replay.reducer import reduce_session
from replay.rules import Rules
from replay.samples import encode_result
from replay.stats import log_stats


async def test_store_path_equals_in_memory_reduction(store: EventStore) -> None:
    logs = small_logs()
    for log in logs:
        await write_to(store, log)
    for log in logs:
        live = await close_session_samples(store, log.session_id, Rules())
        in_memory = reduce_session(log.events, log.arrays, Rules())
        assert encode_result(live) == encode_result(in_memory), log.session_id


async def test_load_session_reads_only_needed_arrays(sqlite_store: EventStore) -> None:
    log = small_logs()[0]
    await write_to(sqlite_store, log)
    loaded = await load_session(sqlite_store, log.session_id)
    assert [e.seq for e in loaded.events] == list(range(len(log.events)))
    # Inputs, outputs and logprobs: not the raw request bodies.
    assert all(a.dtype != np.uint8 for a in loaded.arrays.values())
    assert loaded.missing_arrays == []


async def interleaved(store: EventStore) -> list[Log]:
    """Sessions whose events interleave in the log, appended turn by turn."""
    logs = small_logs()
    mappings = []
    for log in logs:
        mappings.append({d: await store.put_array(a) for d, a in log.arrays.items()})
    from builders import _rewrite_refs

    from recorder.log.events import NewEvent

    cursors = [0] * len(logs)
    while any(c < len(log.events) for c, log in zip(cursors, logs, strict=True)):
        for i, log in enumerate(logs):
            chunk = log.events[cursors[i] : cursors[i] + 3]
            cursors[i] += 3
            if chunk:
                await store.append(
                    log.session_id,
                    [
                        NewEvent(
                            event=_rewrite_refs(r.event, mappings[i]), event_id=r.event_id, ts=r.ts
                        )
                        for r in chunk
                    ],
                )
    return logs


@pytest.mark.parametrize("page_size", [1, 4, 1000])
async def test_stream_yields_every_session_once_whatever_the_page_size(
    sqlite_store: EventStore, page_size: int
) -> None:
    logs = await interleaved(sqlite_store)
    got = {}
    async for log in iter_session_logs(sqlite_store, page_size=page_size):
        assert log.session_id not in got
        got[log.session_id] = encode_result(reduce_session(log.events, log.arrays, Rules()))
    assert set(got) == {log.session_id for log in logs}
    for log in logs:
        assert got[log.session_id] == encode_result(reduce_session(log.events, log.arrays, Rules()))


class CountingStore:
    """Wraps a store and records the highest position read so far."""

    def __init__(self, inner: EventStore) -> None:
        self.inner = inner
        self.read_up_to = 0

    async def read_all(self, *, after: int = 0, limit: int = 1000) -> list[RecordedEvent]:
        page = await self.inner.read_all(after=after, limit=limit)
        if page:
            self.read_up_to = max(self.read_up_to, page[-1].position)
        return page

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


async def test_stream_yields_a_session_as_soon_as_it_closes(sqlite_store: EventStore) -> None:
    logs = [Log(f"seq-{i}").open() for i in range(6)]
    for log in logs:
        log.turn([1, 2], [3, 2])
        log.close()
        await write_to(sqlite_store, log)
    counting = CountingStore(sqlite_store)
    per_session = len(logs[0].events)
    order = []
    async for log in iter_session_logs(counting, page_size=2):  # type: ignore[arg-type]
        order.append(log.session_id)
        # Never more than one page past this session's close: nothing else is buffered.
        assert counting.read_up_to <= log.last_position + 2
        assert counting.read_up_to < log.last_position + per_session
    assert order == [log.session_id for log in logs]


class FaultyArrays:
    """Wraps a store: `get_arrays` fails for any request naming `bad`, and
    records the digests each call asked for."""

    def __init__(self, inner: EventStore, bad: bytes) -> None:
        self.inner = inner
        self.bad = bad
        self.calls: list[set[bytes]] = []

    async def last_position(self) -> int:
        return await self.inner.last_position()

    async def read_all(self, *, after: int = 0, limit: int = 1000) -> list[RecordedEvent]:
        return await self.inner.read_all(after=after, limit=limit)

    async def get_arrays(self, refs: Sequence[ArrayRef], *, cache: bool = True) -> list[Any]:
        self.calls.append({r.digest for r in refs})
        if any(r.digest == self.bad for r in refs):
            from recorder.log.store import ArrayNotFound

            raise ArrayNotFound(f"array {self.bad.hex()} is gone")
        return await self.inner.get_arrays(refs, cache=cache)


async def test_stream_reads_a_pages_sessions_arrays_at_once_and_a_bad_one_costs_only_its_own(
    sqlite_store: EventStore,
) -> None:
    """Sessions closing in one page share one `get_arrays` call; when it fails,
    each session is read alone, so a missing array is reported by its own
    session only and every other session gets the arrays a lone read gives."""
    logs = [Log(f"batch-{i}").open() for i in range(4)]
    for i, log in enumerate(logs):
        log.turn([1, 2, 10 + i], [20 + i, 2])
        log.close()
        await write_to(sqlite_store, log)
    alone = {log.session_id: await load_session(sqlite_store, log.session_id) for log in logs}
    streamed = [log async for log in iter_session_logs(sqlite_store, page_size=1000)]
    assert [log.session_id for log in streamed] == [log.session_id for log in logs]
    for log in streamed:
        want = alone[log.session_id].arrays
        assert log.arrays.keys() == want.keys() and log.missing_arrays == []
        assert all(np.array_equal(log.arrays[d], want[d]) for d in want)

    victim = alone["batch-2"]
    bad = next(
        d for d in victim.arrays if all(d not in alone[s].arrays for s in alone if s != "batch-2")
    )
    faulty = FaultyArrays(sqlite_store, bad)
    got = {log.session_id: log async for log in iter_session_logs(faulty, page_size=1000)}  # type: ignore[arg-type]
    first = faulty.calls[0]
    assert all(set(alone[s].arrays) <= first for s in alone), "one call for the whole page"
    (problem,) = got["batch-2"].missing_arrays  # reported once
    assert bad.hex()[:16] in problem
    assert bad not in got["batch-2"].arrays
    for sid, log in got.items():
        if sid != "batch-2":
            assert log.missing_arrays == [] and log.arrays.keys() == alone[sid].arrays.keys()


class AskedFor:
    """Wraps a store and records every digest `get_arrays` is asked for."""

    def __init__(self, inner: EventStore) -> None:
        self.inner = inner
        self.asked: set[bytes] = set()

    async def last_position(self) -> int:
        return await self.inner.last_position()

    async def read_all(self, *, after: int = 0, limit: int = 1000) -> list[RecordedEvent]:
        return await self.inner.read_all(after=after, limit=limit)

    async def read_session(self, session_id: str) -> list[RecordedEvent]:
        return await self.inner.read_session(session_id)

    async def get_arrays(self, refs: Sequence[ArrayRef], *, cache: bool = True) -> list[Any]:
        self.asked |= {r.digest for r in refs}
        return await self.inner.get_arrays(refs, cache=cache)


@pytest.mark.parametrize("sessions", [1, 3])
async def test_outputs_the_next_input_re_sends_are_taken_from_it_not_read(
    store: EventStore, sessions: int
) -> None:
    """A turn's output ids are in the next input of its chain: the loader takes
    them from there (checked against the output's digest), so the store is
    never asked for them, and the arrays equal what the store holds. An output
    the next request does not re-send (the last turn, a side request's, one
    followed by another chain's request) is read."""
    from recorder.log.events import GenerateResult

    logs = []
    for i in range(sessions):
        log = Log(f"resend-{i}").open()
        t = log.turn([1, 2, 3 + i], [10 + i, 11, 2])
        log.turn([7, 8], [30 + i, 2], system="side")  # another chain between
        t = log.turn(t.then([4, 5]), [12, 13 + i, 2])
        log.turn(t.then([6]), [14, 2])
        log.close()
        await write_to(store, log)
        logs.append(log)
    asking = AskedFor(store)
    streamed = [log async for log in iter_session_logs(asking, page_size=1000)]  # type: ignore[arg-type]
    assert len(streamed) == sessions
    for log in streamed:
        plain = await load_arrays(store, needed_refs(log.events, routed_experts=False))
        assert plain[1] == [] and log.missing_arrays == []
        assert log.arrays.keys() == plain[0].keys()
        assert all(np.array_equal(log.arrays[d], a) for d, a in plain[0].items())
        outputs = [
            e.event.output_ids.digest for e in log.events if isinstance(e.event, GenerateResult)
        ]
        # Only the next request is looked at: turn 0's output is re-sent after the
        # side request, so it is read like the side turn's and the last turn's.
        assert [d in asking.asked for d in outputs] == [True, True, False, True]
    alone = await load_session(asking, streamed[0].session_id)  # type: ignore[arg-type]
    assert alone.arrays.keys() == streamed[0].arrays.keys()


async def test_unclosed_sessions_are_yielded_at_the_end(sqlite_store: EventStore) -> None:
    open_log = Log("still-open").open()
    open_log.turn([1], [2])
    closed = Log("closed").open()
    closed.turn([1], [3])
    closed.close()
    await write_to(sqlite_store, open_log)
    await write_to(sqlite_store, closed)
    order = [log.session_id async for log in iter_session_logs(sqlite_store)]
    assert order == ["closed", "still-open"]


async def test_late_event_after_close_re_yields_the_whole_session(sqlite_store: EventStore) -> None:
    log = Log("late").open()
    log.turn([1, 2], [3, 2])
    log.close()
    await write_to(sqlite_store, log)
    other = Log("other").open()
    other.close()
    await write_to(sqlite_store, other)
    from recorder.log.events import NewEvent, RewardAssigned

    await sqlite_store.append("late", [NewEvent(event=RewardAssigned(reward=0.5))])
    yields = [
        (s.session_id, len(s.events), reduce_session(s.events, s.arrays, Rules()).reward)
        async for s in iter_session_logs(sqlite_store)
    ]
    n = len(log.events)
    assert yields == [("late", n, 0.0), ("other", 2, 0.0), ("late", n + 1, 0.5)]


async def test_reopened_session_is_buffered_afresh(sqlite_store: EventStore) -> None:
    log = Log("again").open()
    log.turn([1, 2], [3, 4])
    log.close("aborted")
    log.open(attempt=1)
    log._turn = 0
    t = log.turn([1, 2], [5, 2])
    log.reward(1.0).close()
    await write_to(sqlite_store, log)
    got = [s async for s in iter_session_logs(sqlite_store, page_size=3)]
    assert [s.session_id for s in got] == ["again", "again"]
    last = reduce_session(got[-1].events, got[-1].arrays, Rules())
    assert last.samples[0].tokens == t.full and last.reward == 1.0
    full = await close_session_samples(sqlite_store, "again")
    assert encode_result(full) == encode_result(last)


async def test_stream_stops_at_until_and_filters_sessions(sqlite_store: EventStore) -> None:
    for log in small_logs():
        await write_to(sqlite_store, log)
    first = small_logs()[0]
    got = [s async for s in iter_session_logs(sqlite_store, until=len(first.events))]
    assert [s.session_id for s in got] == [first.session_id]
    only = [s.session_id async for s in iter_session_logs(sqlite_store, session_ids=["c-subagent"])]
    assert only == ["c-subagent"]
    with pytest.raises(ValueError, match="page_size"):
        [s async for s in iter_session_logs(sqlite_store, page_size=0)]


class FlakyArrays:
    """get_arrays fails for any batch holding the bad ref."""

    def __init__(self, inner: EventStore, bad: bytes) -> None:
        self.inner = inner
        self.bad = bad

    async def get_arrays(self, refs: Sequence[ArrayRef], *, cache: bool = True) -> list[np.ndarray]:
        if any(r.digest == self.bad for r in refs):
            raise CorruptArray(f"array {self.bad.hex()} is corrupt")
        return await self.inner.get_arrays(refs, cache=cache)


async def test_a_corrupt_array_only_loses_its_turn(sqlite_store: EventStore) -> None:
    good = await sqlite_store.put_array(np.array([1, 2, 3], dtype=np.int32))
    bad = await sqlite_store.put_array(np.array([4], dtype=np.int32))
    arrays, problems = await load_arrays(FlakyArrays(sqlite_store, bad.digest), [good, bad])  # type: ignore[arg-type]
    assert list(arrays) == [good.digest]
    assert len(problems) == 1 and "corrupt" in problems[0]


async def test_events_of_other_kinds_do_not_disturb_the_stream(sqlite_store: EventStore) -> None:
    from recorder.log.events import NewEvent

    await sqlite_store.append("sandbox-only", [NewEvent(event=SandboxEvent(kind="boot"))])
    log = small_logs()[0]
    await write_to(sqlite_store, log)
    ids = [s.session_id async for s in iter_session_logs(sqlite_store)]
    assert ids == [log.session_id, "sandbox-only"]


async def test_partitions_cover_every_session_once(store: EventStore) -> None:
    """Id ranges (what parallel workers stream) hold every session exactly once,
    whatever the database's collation (PostgreSQL compares them byte-wise)."""
    from replay.partitions import plan_ranges

    logs = [*small_logs(), Log("B-upper").open().close(), Log("é-accent").open().close()]
    for log in logs:
        await write_to(store, log)
    ids = [log.session_id for log in logs]
    for n in (1, 2, 3, 4, 10):
        ranges = plan_ranges(ids, n)
        assert len(ranges) == min(n, len(ids))
        parts = [
            [s.session_id async for s in iter_session_logs(store, sessions=r, page_size=2)]
            for r in ranges
        ]
        flat = [sid for part in parts for sid in part]
        assert sorted(flat) == sorted(ids)
        for (lo, hi), part in zip(ranges, parts, strict=True):
            assert all((lo is None or lo <= sid) and (hi is None or sid < hi) for sid in part)
    assert plan_ranges(ids, 3) == plan_ranges(reversed(ids), 3)


# -- memory: a streaming reduce keeps no array pieces --------------------------


async def _written_logs(url: str, n: int) -> list[str]:
    """`n` closed sessions written through a store that is then closed (its cache gone)."""
    async with await open_store(url, create=True) as w:
        for i in range(n):
            log = Log(f"mem-{i}").open()
            t = log.turn([1, 2, 3 + i], [10, 11, 2])
            log.turn(t.then([4, 5 + i]), [12, 2])
            log.reward(1.0).close()
            await write_to(w, log)
    return [f"mem-{i}" for i in range(n)]


def _piece_count(store: EventStore) -> int:
    assert isinstance(store, SqlEventStore)
    return len(store.piece_cache)


async def test_streaming_keeps_no_pieces_after_any_session(store_url: str, tmp_path: Path) -> None:
    """Reclassify, export and stats on a store opened with default (large) caches:
    after every session the piece cache holds exactly what it held before."""
    ids = await _written_logs(store_url, 6)
    async with await open_store(store_url) as store:
        await load_session(store, ids[0])  # the live path caches: that must stay as is
        held = _piece_count(store)
        assert held > 0
        counts: list[int] = []

        def check(_result: object) -> None:
            counts.append(_piece_count(store))

        async for log in iter_session_logs(store, page_size=3):
            assert log.arrays and not log.missing_arrays
            counts.append(_piece_count(store))
        report = await reclassify(store, Rules(), on_session=check, batch=2)
        await export_samples(store, tmp_path / "out.jsonl", "jsonl", Rules(), on_session=check)
        await log_stats(store, Rules(), on_session=check)
        assert report.sessions == len(ids)
        assert counts == [held] * (4 * len(ids))


def test_whole_log_commands_open_the_store_lean(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """reclassify/export/stats open with `StoreOptions.streaming()`; show keeps the defaults."""
    import asyncio

    import recorder.log.store
    from replay.cli import main

    asyncio.run(_written_logs(sqlite_url, 2))
    opened: list[StoreOptions | None] = []
    real = recorder.log.store.open_store

    async def spy(url: str, **kwargs: Any) -> EventStore:
        opened.append(kwargs.get("options"))
        return await real(url, **kwargs)

    monkeypatch.setattr(recorder.log.store, "open_store", spy)
    runner = CliRunner()
    for args in (
        ["reclassify", "--db", sqlite_url],
        ["export", "--db", sqlite_url, "--out", str(tmp_path / "s.jsonl")],
        ["stats", "--db", sqlite_url],
        ["show", "--db", sqlite_url, "--session", "mem-0"],
    ):
        result = runner.invoke(main, args)
        assert result.exit_code == 0, result.output
    assert opened == [StoreOptions.streaming()] * 3 + [None]
