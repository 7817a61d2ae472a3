"""SQLite: small groups that need no flush are committed on the event loop's thread.

A turn's request and first attempt (`append(..., durable=False)`) and small
array pieces cost no thread hop; they never make the loop wait for the
database (a locked one is left to the generic path, which waits off the
loop), and durable or large groups still go to the writer thread.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading

import numpy as np
import pytest

from recorder.log.events import NewEvent, SandboxEvent
from recorder.log.ids import uuid7
from recorder.log.store import open_store
from recorder.log.store.sqlite import (
    INLINE_ENV,
    INLINE_MAX_BYTES,
    INLINE_MAX_STREAK,
    WriterThread,
    database_path,
    inline_writes_enabled,
)


def _events(n: int, kind: str = "e") -> list[NewEvent]:
    return [NewEvent(event=SandboxEvent(kind=f"{kind}{i}"), event_id=uuid7()) for i in range(n)]


def _writer_threads() -> int:
    return sum(t.name.startswith("recorder-sqlite-writer") for t in threading.enumerate())


async def test_small_unflushed_groups_take_no_thread_hop(sqlite_url: str) -> None:
    before = _writer_threads()
    store = await open_store(sqlite_url, create=True)
    try:
        ref = await store.put_array(np.arange(100, dtype=np.int32))
        await store.append("s", _events(4), expected_seq=0, durable=False)
        assert _writer_threads() == before  # written on this thread
        assert store.fast_groups == 2 and store.generic_groups == 0  # type: ignore[attr-defined]
        big = np.random.default_rng(0).integers(0, 2**31, INLINE_MAX_BYTES, dtype=np.int32)
        big_ref = await store.put_array(big)  # too big to write on the loop
        assert _writer_threads() == before + 1
        await store.append("s", _events(1, "answer"), expected_seq=4)  # durable: the thread
        assert [e.seq for e in await store.read_session("s")] == [0, 1, 2, 3, 4]
        assert (await store.get_array(ref)).tolist() == list(range(100))
        assert (await store.get_array(big_ref)).tolist() == big.tolist()
    finally:
        await store.close()


async def test_a_locked_database_is_left_to_the_generic_path(sqlite_url: str) -> None:
    """The inline attempt does not wait for the lock (that would stall every session):
    it fails at once and the generic path, off the loop, waits for it."""
    store = await open_store(sqlite_url, create=True)
    path = database_path(sqlite_url)
    assert path is not None
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        await store.append("s", _events(1), expected_seq=0, durable=False)
        other.execute("BEGIN IMMEDIATE")  # another writer holds the database...
        release = threading.Timer(0.2, other.execute, ["COMMIT"])  # ...for a while
        release.start()
        append = asyncio.ensure_future(
            store.append("s", _events(2, "late"), expected_seq=1, durable=False)
        )
        await asyncio.sleep(0.05)
        assert not append.done()  # the loop runs on while the append waits
        assert await asyncio.wait_for(append, 30) == [2, 3]
        release.join()
        assert (store.fast_groups, store.generic_groups) == (1, 1)  # type: ignore[attr-defined]
        kinds = [r.event.kind for r in await store.read_session("s")]  # type: ignore[union-attr]
        assert kinds == ["e0", "late0", "late1"]
    finally:
        other.close()
        await store.close()


async def test_a_long_run_of_inline_groups_lets_the_thread_checkpoint(sqlite_url: str) -> None:
    before = _writer_threads()
    store = await open_store(sqlite_url, create=True)
    try:
        for k in range(INLINE_MAX_STREAK):
            await store.append("s", _events(1, f"k{k}"), expected_seq=k, durable=False)
        assert _writer_threads() == before
        await store.append("s", _events(1, "next"), expected_seq=INLINE_MAX_STREAK, durable=False)
        assert _writer_threads() == before + 1  # the writer thread took one, and checkpoints
        assert len(await store.read_session("s")) == INLINE_MAX_STREAK + 1
    finally:
        await store.close()


async def test_inline_writes_can_be_switched_off(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`TR_SQLITE_INLINE_WRITES=0`: every group goes to the writer thread (a switch
    for measuring what inline commits cost under load)."""
    monkeypatch.setenv(INLINE_ENV, "0")
    before = _writer_threads()
    store = await open_store(sqlite_url, create=True)
    try:
        await store.append("s", _events(2), expected_seq=0, durable=False)
        assert _writer_threads() == before + 1
        assert [e.seq for e in await store.read_session("s")] == [0, 1]
    finally:
        await store.close()
    monkeypatch.setenv(INLINE_ENV, "sometimes")
    with pytest.raises(ValueError, match=INLINE_ENV):
        inline_writes_enabled()


def test_the_writer_thread_runs_jobs_in_order_and_survives_a_failing_one() -> None:
    worker = WriterThread("recorder-sqlite-writer-test")
    seen: list[int] = []

    def fail() -> None:
        raise RuntimeError("boom")

    try:
        for i in range(5):
            worker.post(seen.append, i)
        worker.post(fail)
        assert worker.submit(lambda: list(seen)).result(timeout=30) == [0, 1, 2, 3, 4]
        with pytest.raises(ZeroDivisionError):
            worker.submit(lambda: 1 / 0).result(timeout=30)
    finally:
        worker.shutdown(wait=True)
    assert not any(t.name == "recorder-sqlite-writer-test" for t in threading.enumerate())
