"""A one-pass reader's store (`StoreOptions.streaming()`, `inline_reads`) reads what
the default store reads: SQLite on its own connection on the loop's thread,
PostgreSQL through its engine as always."""

from __future__ import annotations

import numpy as np
import pytest

from recorder.log.events import (
    ArrayRef,
    NewEvent,
    SandboxEvent,
    SessionClosed,
    SessionOpened,
)
from recorder.log.store import ArrayNotFound, CorruptArray, EventStore, StoreOptions, open_store
from recorder.log.store import arrays as codec
from tests.store.conftest import RawExecute


async def _write(url: str) -> list[ArrayRef]:
    """Three interleaved sessions and a few array chains (one float array)."""
    async with await open_store(url, create=True) as w:
        for sid in ("a", "b", "c"):
            await w.append(sid, [NewEvent(event=SessionOpened(session_id=sid))])
        for k in range(4):
            for sid in ("c", "a", "b"):
                await w.append(sid, [NewEvent(event=SandboxEvent(kind=f"{sid}{k}"))])
        for sid in ("b", "a"):
            await w.append(sid, [NewEvent(event=SessionClosed())])
        refs: list[ArrayRef] = []
        ref = None
        for k in range(5):
            ref = await w.put_array(np.arange(k * 50, k * 50 + 50, dtype=np.int32), extends=ref)
            refs.append(ref)
        refs.append(await w.put_array(-np.linspace(0.0, 3.0, 40)))
    return refs


async def _reads(s: EventStore, refs: list[ArrayRef]) -> list[object]:
    got: list[object] = [
        await s.read_all(after=0, limit=1000),
        await s.read_all(after=3, limit=4),
        await s.read_all(after=0, limit=1000, sessions=("b", None)),
        await s.read_all(after=0, limit=1000, sessions=("a", "c")),
        await s.read_session("a"),
        await s.read_session("c", from_seq=2),
        await s.read_session_from_last("b", ("session_closed",)),
        await s.last_position(),
        await s.session_ids(),
    ]
    for cold in (False, True):
        arrays = await s.get_arrays(refs, cache=False, cold=cold)
        got.append([(a.dtype.str, a.tobytes()) for a in arrays])
    return got


async def test_streaming_reads_equal_the_default_stores(store_url: str) -> None:
    refs = await _write(store_url)
    async with await open_store(store_url) as plain:
        expected = await _reads(plain, refs)
    async with await open_store(store_url, options=StoreOptions.streaming()) as lean:
        assert await _reads(lean, refs) == expected
        # Again on the same (inline) connection: each call ended its read transaction.
        assert await _reads(lean, refs) == expected
    assert len(expected[0]) == 17  # type: ignore[arg-type]


async def test_streaming_reads_see_later_commits(store_url: str) -> None:
    """Each read is its own snapshot: a reader left open sees what was written since."""
    refs = await _write(store_url)
    async with await open_store(store_url, options=StoreOptions.streaming()) as lean:
        before = await lean.last_position()
        async with await open_store(store_url) as w:
            await w.append("c", [NewEvent(event=SessionClosed(reason="late"))])
            more = await w.put_array(np.arange(7, dtype=np.int32), extends=refs[0])
        assert await lean.last_position() == before + 1
        assert (await lean.read_session("c"))[-1].event == SessionClosed(reason="late")
        (got,) = await lean.get_arrays([more], cache=False)
        assert got.tolist() == [*range(50), *range(7)]


async def test_streaming_reads_report_missing_and_corrupt_pieces(
    store_url: str, raw_execute: RawExecute
) -> None:
    refs = await _write(store_url)
    ghost = ArrayRef(b"\x01" * 16, 3, "int32")
    async with await open_store(store_url, options=StoreOptions.streaming()) as lean:
        for cold in (False, True):
            with pytest.raises(ArrayNotFound, match=ghost.digest.hex()):
                await lean.get_arrays([refs[0], ghost], cold=cold)
    other = codec.encode_piece(np.arange(1, 51, dtype=np.int32), "int32", None).data
    await raw_execute(
        store_url, "UPDATE arrays SET data = $1 WHERE digest = $2", other, refs[0].digest
    )
    async with await open_store(store_url, options=StoreOptions.streaming()) as lean:
        with pytest.raises(CorruptArray, match=refs[0].digest.hex()):
            await lean.get_arrays([refs[2]], cache=False)
