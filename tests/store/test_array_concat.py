"""Concatenated pieces (codec 6, revision 0006): a piece that names stored pieces
by digest instead of repeating their bytes (a chain's spine, `server.snapshot`)."""

from __future__ import annotations

import numpy as np
import pytest

from recorder.log import events as ev
from recorder.log.events import ArrayRef
from recorder.log.store import ArrayNotFound, CorruptArray, StoreOptions, open_store
from recorder.log.store import arrays as codec
from tests.store.conftest import RawExecute, assert_downgrade_refused

A = np.arange(1000, 1300, dtype=np.int32)
B = np.arange(7, 57, dtype=np.int32)
C = np.arange(90, 190, dtype=np.int32)
COLD = StoreOptions(piece_cache_bytes=0)


async def _append(store_url: str, arrays: list[codec.EncodedArray]) -> None:
    async with await open_store(store_url) as w:
        event = ev.NewEvent(event=ev.SandboxEvent(kind="k"))
        await w.append("s", [event], arrays=arrays)


async def _three_pieces(store_url: str) -> tuple[ArrayRef, ArrayRef, ArrayRef]:
    """A stored chain A | B | C, piece by piece: (ref of A, of A+B, of A+B+C)."""
    async with await open_store(store_url, create=True) as w:
        a = await w.put_array(A)
        ab = await w.put_array(B, extends=a)
        abc = await w.put_array(C, extends=ab)
    return a, ab, abc


async def test_a_spine_names_stored_pieces_and_reads_back_cold(
    store_url: str, raw_execute: RawExecute
) -> None:
    """B and C after A, stored again as one piece that names theirs: the same tokens,
    a different digest (a different piece chain), 32 bytes of data."""
    a, ab, abc = await _three_pieces(store_url)
    raw = np.concatenate([B, C]).tobytes()
    spine = codec.encode_concat_array(raw, "int32", a, [ab.digest, abc.digest])
    await _append(store_url, [spine])
    assert spine.ref.digest != abc.digest and spine.ref.length == abc.length
    ((data, tail),) = await raw_execute(
        store_url, "SELECT data, data_tail FROM arrays WHERE codec = 6"
    )
    assert codec.join_blob(bytes(data), tail and bytes(tail)) == ab.digest + abc.digest
    # A piece extending the spine, read on a store with nothing cached, cold and not.
    async with await open_store(store_url) as w:
        tail = await w.put_array(np.array([5, 6], np.int32), extends=spine.ref)
    want = np.concatenate([A, B, C, [5, 6]])
    for cold in (False, True):
        async with await open_store(store_url, options=COLD) as r:
            (got,) = await r.get_arrays([tail], cold=cold)
            assert np.array_equal(got, want)
            assert np.array_equal(await r.get_array(spine.ref), want[:-2])


async def test_a_spine_whose_parts_lie_is_caught(store_url: str) -> None:
    """Parts whose bytes are not the piece's (listed out of order): a read reports
    the piece as corrupt rather than returning other tokens."""
    a, ab, abc = await _three_pieces(store_url)
    raw = np.concatenate([B, C]).tobytes()
    good = codec.encode_concat_piece(raw, "int32", a, [ab.digest, abc.digest])
    lying = codec.Piece(**{**codec_fields(good), "data": abc.digest + ab.digest})
    ref = ArrayRef(good.digest, good.total_length, "int32")
    await _append(store_url, [codec.EncodedArray(ref, (lying,), (codec.decode_piece(good, raw),))])
    for cold in (False, True):
        async with await open_store(store_url, options=COLD) as r:
            with pytest.raises(CorruptArray, match=good.digest.hex()):
                await r.get_arrays([ref], cold=cold)


def codec_fields(piece: codec.Piece) -> dict[str, object]:
    return {f: getattr(piece, f) for f in piece.__struct_fields__}


async def test_a_spine_naming_an_unknown_piece_is_refused(store_url: str) -> None:
    a, ab, _ = await _three_pieces(store_url)
    unknown = codec.encode_piece(C + 1, "int32", ab)  # never stored
    raw = np.concatenate([B, C + 1]).tobytes()
    spine = codec.encode_concat_array(raw, "int32", a, [ab.digest, unknown.digest])
    with pytest.raises(ArrayNotFound, match=unknown.digest.hex()):
        await _append(store_url, [spine])


def test_a_concatenation_of_nothing_or_of_itself_is_refused() -> None:
    one = codec.encode_piece(B, "int32", None)
    with pytest.raises(ValueError, match="one or more"):
        codec.encode_concat_piece(B.tobytes(), "int32", None, [])
    with pytest.raises(ValueError, match="itself"):
        codec.encode_concat_piece(B.tobytes(), "int32", None, [one.digest])


async def test_one_part_names_the_same_tokens_after_another_parent(store_url: str) -> None:
    """A turn's output ids, stored whole, then named as its chain's tokens after its input."""
    a, _, _ = await _three_pieces(store_url)
    async with await open_store(store_url) as w:
        out = await w.put_array(C)
    after = codec.encode_concat_array(C.tobytes(), "int32", a, [out.digest])
    await _append(store_url, [after])
    for cold in (False, True):
        async with await open_store(store_url, options=COLD) as r:
            (got,) = await r.get_arrays([after.ref], cold=cold)
            assert np.array_equal(got, np.concatenate([A, C]))


async def test_downgrading_below_0006_refuses_once_a_spine_names_pieces(
    store_url: str,
) -> None:
    a, ab, abc = await _three_pieces(store_url)
    raw = np.concatenate([B, C]).tobytes()
    await _append(store_url, [codec.encode_concat_array(raw, "int32", a, [ab.digest, abc.digest])])
    await assert_downgrade_refused(store_url, "0005", "stay at revision 0006")
