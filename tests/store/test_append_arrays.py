"""Arrays written in the same transaction as the events that name them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from recorder.log.events import ArrayRef, NewEvent, SandboxEvent
from recorder.log.store import ArrayNotFound, ConcurrencyConflict, EventStore, open_store
from recorder.log.store import arrays as codec
from recorder.log.store.sql import SqlEventStore

MakeEvents = Callable[..., list[NewEvent]]
RawExecute = Callable[..., Awaitable[list[tuple[object, ...]]]]
GHOST = ArrayRef(b"\x07" * 16, 4, "int32")


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int32)


def naming(ref: ArrayRef, kind: str = "turn") -> list[NewEvent]:
    """Events that carry an array's digest (what a real turn event would hold)."""
    return [NewEvent(event=SandboxEvent(kind=kind, detail={"ref": ref.digest.hex()}))]


async def count_pieces(url: str, raw_execute: RawExecute) -> int:
    ((n,),) = await raw_execute(url, "SELECT COUNT(*) FROM arrays")
    return int(n)  # type: ignore[call-overload]


def test_encode_array_is_pure_and_matches_its_content() -> None:
    data = tokens(50, 1)
    first = codec.encode_array(data)
    again = codec.encode_array(data.astype(np.int64))  # same values, another dtype
    assert first.ref == again.ref and first.pieces == again.pieces
    assert first.ref.length == 50 and first.ref.dtype == "int32"
    data[0] += 1  # the encoded copy does not alias the caller's array
    assert first.decoded[0].suffix[0] == data[0] - 1
    assert not first.decoded[0].suffix.flags.writeable
    grown = codec.encode_array(tokens(10, 2), extends=first.ref)
    assert grown.ref.length == 60 and grown.pieces[0].parent == first.ref.digest
    same = codec.encode_array(np.zeros(0, np.int32), extends=first.ref)
    assert same.ref == first.ref and same.pieces == ()


async def test_append_with_arrays_round_trips(store_url: str) -> None:
    prompt = codec.encode_array(tokens(300, 3))
    output = codec.encode_array(np.linspace(-3, 0, 40, dtype=np.float32))
    async with await open_store(store_url, create=True) as store:
        await store.append("s", naming(prompt.ref), arrays=[prompt, output])
        nxt = codec.encode_array(tokens(25, 4), extends=prompt.ref)  # extends a stored array
        await store.append("s", naming(nxt.ref), arrays=[nxt])
    async with await open_store(store_url) as cold:  # nothing cached: read from the database
        got = await cold.get_arrays([prompt.ref, output.ref, nxt.ref])
        assert [e.seq for e in await cold.read_session("s")] == [0, 1]
    assert got[0].tobytes() == tokens(300, 3).tobytes()
    assert got[1].tobytes() == np.linspace(-3, 0, 40, dtype=np.float32).tobytes()
    assert got[2].tobytes() == np.concatenate([tokens(300, 3), tokens(25, 4)]).tobytes()


async def test_unknown_extends_writes_nothing(
    store: EventStore, store_url: str, raw_execute: RawExecute
) -> None:
    fine = codec.encode_array(tokens(5, 5))
    orphan = codec.encode_array(tokens(5, 6), extends=GHOST)
    with pytest.raises(ArrayNotFound, match=GHOST.digest.hex()) as info:
        await store.append("s", naming(orphan.ref), arrays=[fine, orphan])
    assert "extends" in str(info.value)
    assert await store.read_all() == []
    assert await count_pieces(store_url, raw_execute) == 0
    # The session is untouched: the next append starts at seq 0.
    await store.append("s", naming(fine.ref), expected_seq=0, arrays=[fine])
    assert await count_pieces(store_url, raw_execute) == 1


async def test_refused_append_still_writes_its_arrays(
    store: EventStore, make_events: MakeEvents
) -> None:
    """Documented choice: pieces are content-addressed, so a refused append keeps them."""
    await store.append("s", make_events(2))
    late = codec.encode_array(tokens(30, 7))
    with pytest.raises(ConcurrencyConflict):
        await store.append("s", naming(late.ref), expected_seq=0, arrays=[late])
    assert len(await store.read_all()) == 2
    async with await open_store(store.url) as other:
        assert (await other.get_array(late.ref)).tobytes() == tokens(30, 7).tobytes()


async def test_arrays_dedupe_with_put_array(
    store: EventStore, store_url: str, raw_execute: RawExecute
) -> None:
    data = tokens(64, 8)
    put_first = await store.put_array(data)
    encoded = codec.encode_array(data)
    assert encoded.ref == put_first
    await store.append("s", naming(encoded.ref), arrays=[encoded])
    other = codec.encode_array(tokens(64, 9))
    await store.append("s", naming(other.ref), arrays=[other])
    assert await store.put_array(tokens(64, 9)) == other.ref
    assert await count_pieces(store_url, raw_execute) == 2


async def test_written_pieces_are_cached(store: EventStore) -> None:
    assert isinstance(store, SqlEventStore)
    encoded = codec.encode_array(tokens(12, 10))
    await store.append("s", naming(encoded.ref), arrays=[encoded])
    assert store.piece_cache.get(encoded.ref.digest) is not None
    grown = codec.encode_array(tokens(3, 11), extends=encoded.ref)
    await store.append("s", naming(grown.ref), arrays=[grown])
    got = await store.get_array(grown.ref)
    assert got.tobytes() == np.concatenate([tokens(12, 10), tokens(3, 11)]).tobytes()


async def test_arrays_without_events_are_written(store: EventStore) -> None:
    encoded = codec.encode_array(tokens(9, 12))
    assert await store.append("s", [], arrays=[encoded]) == []
    async with await open_store(store.url) as other:
        assert (await other.get_array(encoded.ref)).tobytes() == tokens(9, 12).tobytes()
    assert await store.read_all() == []


async def test_group_of_appends_building_on_each_others_arrays(
    store: EventStore, store_url: str, raw_execute: RawExecute
) -> None:
    """In one group: an array extending another append's array is fine; one extending an
    array whose own parent is unknown fails with it, and neither writes anything."""
    base = codec.encode_array(tokens(20, 13))
    on_base = codec.encode_array(tokens(5, 14), extends=base.ref)
    orphan = codec.encode_array(tokens(5, 15), extends=GHOST)
    on_orphan = codec.encode_array(tokens(5, 16), extends=orphan.ref)
    results = await asyncio.gather(
        store.append("a", naming(base.ref), arrays=[base]),
        store.append("b", naming(on_base.ref), arrays=[on_base]),
        store.append("c", naming(orphan.ref), arrays=[orphan]),
        store.append("d", naming(on_orphan.ref), arrays=[on_orphan]),
        return_exceptions=True,
    )
    assert isinstance(results[0], list) and isinstance(results[1], list)
    assert isinstance(results[2], ArrayNotFound) and isinstance(results[3], ArrayNotFound)
    assert sorted(e.session_id for e in await store.read_all()) == ["a", "b"]
    assert await count_pieces(store_url, raw_execute) == 2
    async with await open_store(store_url) as cold:
        got = await cold.get_array(on_base.ref)
    assert got.tobytes() == np.concatenate([tokens(20, 13), tokens(5, 14)]).tobytes()


async def test_resent_append_with_arrays_returns_original_positions(
    store: EventStore, store_url: str, raw_execute: RawExecute
) -> None:
    encoded = codec.encode_array(tokens(40, 17))
    batch = naming(encoded.ref) + naming(encoded.ref, "second")
    first = await store.append("s", batch, expected_seq=0, arrays=[encoded])
    assert await store.append("s", batch, expected_seq=0, arrays=[encoded]) == first
    assert len(await store.read_all()) == 2
    assert await count_pieces(store_url, raw_execute) == 1


def test_missing_bases_reaches_a_fixed_point() -> None:
    base = codec.encode_array(tokens(4, 18))
    chain = [codec.encode_array(tokens(2, 19), extends=GHOST)]
    for seed in range(20, 23):
        chain.append(codec.encode_array(tokens(2, seed), extends=chain[-1].ref))
    stored_parent = codec.encode_array(tokens(2, 23), extends=base.ref)
    requests = [(i, e.pieces) for i, e in enumerate([*reversed(chain), stored_parent])]
    pieces = [p for _, ps in requests for p in ps]
    assert codec.external_bases(pieces) == {GHOST.digest, base.ref.digest}
    errors = codec.missing_bases(requests, {base.ref.digest})
    assert sorted(errors) == [0, 1, 2, 3]
    assert codec.missing_bases(requests, {base.ref.digest, GHOST.digest}) == {}
