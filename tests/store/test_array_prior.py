"""Pieces compressed against their parent's last bytes (codec 7, revision 0007):
a turn's new messages and tokens packed with what the turns before them said."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from recorder.log.store import CorruptArray, StoreOptions, open_store
from recorder.log.store import arrays as codec
from tests.store.conftest import RawExecute, assert_downgrade_refused

COLD = StoreOptions(piece_cache_bytes=0)
_WORDS = [b"def ", b"return ", b"session", b"chain ", b"import ", b"self.", b"token", b"\n    "]


def _text(seed: int, n: int) -> np.ndarray:
    """Words drawn from a small vocabulary: what a body's new messages look like."""
    rng = np.random.default_rng(seed)
    return np.frombuffer(b"".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), n)), np.uint8)


def _tokens(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 40, n).astype(np.int32) * 997 + 3


@pytest.mark.parametrize("make", [_text, _tokens], ids=["bytes", "int32"])
async def test_a_suffix_packed_against_its_parent_reads_back_cold(
    store_url: str, raw_execute: RawExecute, make: object
) -> None:
    """Suffixes each packed against the array before it (parents shorter and longer
    than the dictionary): smaller than plainly, same refs, and every prefix reads
    back on a store with nothing cached, cold and not."""
    sizes = ((1, 300), (2, 400), (3, 2000), (4, 400))
    parts = [make(s, n) for s, n in sizes]  # type: ignore[operator]
    whole = np.concatenate(parts)
    assert parts[0].nbytes < codec.PRIOR_BYTES < whole[:-400].nbytes
    async with await open_store(store_url, create=True) as w:
        first = await w.put_array(parts[0])
        refs = [first]
        for i in range(1, len(parts)):
            done = np.concatenate(parts[:i])
            ref = await w.put_array(parts[i], extends=refs[-1], prior=done)
            assert ref == codec.encode_array(parts[i], extends=refs[-1]).ref
            refs.append(ref)
    rows = await raw_execute(store_url, "SELECT digest, basis, parent FROM arrays WHERE codec = 7")
    assert {bytes(d) for d, _, _ in rows} == {r.digest for r in refs[1:]}
    assert all(bytes(b) == bytes(p) for _, b, p in rows)
    plain = codec.encode_piece(parts[3], refs[2].dtype, refs[2]).data
    packed = codec.encode_array(parts[3], extends=refs[2], prior=np.concatenate(parts[:3]))
    assert len(packed.pieces[0].data) < len(plain)
    for cold in (False, True):
        async with await open_store(store_url, options=COLD) as r:
            got = await r.get_arrays(refs, cold=cold)
            for ref, array in zip(refs, got, strict=True):
                assert np.array_equal(array, whole[: ref.length])


def test_a_piece_stored_by_this_format_still_decodes() -> None:
    """Bytes of a stored codec-7 piece, pinned: bytes [-3000, -2000) of its parent, one
    match 3000 bytes back into the dictionary. A reader whose dictionary is shorter
    (or is not the parent's last bytes) fails here, not on users' logs."""
    parent = b"".join(hashlib.blake2b(i.to_bytes(4, "little")).digest() for i in range(200))
    ref = codec.encode_array(np.frombuffer(parent, np.uint8)).ref
    stored = bytes.fromhex("28b52ffd60e802450000000100e577574120")
    suffix = parent[-3000:-2000]
    digest = codec.piece_digest(ref.digest, "uint8", suffix)
    total = ref.length + len(suffix)
    piece = codec.Piece(
        digest, ref.digest, "uint8", total, codec.CODEC_ZSTD_PRIOR, stored, ref.digest
    )
    assert codec.decode_piece(piece, parent).suffix.tobytes() == suffix


def test_a_prior_shorter_than_the_dictionary_is_refused() -> None:
    """The dictionary is the parent's last PRIOR_BYTES (or all of it): a caller that
    passes less would store a piece no read could decode."""
    parent = codec.encode_array(_text(1, 5000)).ref
    with pytest.raises(ValueError, match="last 4096"):
        codec.encode_array(_text(2, 100), extends=parent, prior=_text(1, 5000)[-100:])


async def test_a_piece_packed_against_the_wrong_bytes_is_caught(store_url: str) -> None:
    """A writer that passed other bytes than its parent's: the read reports the piece
    as corrupt rather than returning other bytes."""
    a, b = _text(1, 3000), _text(2, 300)
    async with await open_store(store_url, create=True) as w:
        ref_a = await w.put_array(a)
        lying = await w.put_array(b, extends=ref_a, prior=_text(9, 3000))
    for cold in (False, True):
        async with await open_store(store_url, options=COLD) as r:
            with pytest.raises(CorruptArray, match=lying.digest.hex()):
                await r.get_arrays([lying], cold=cold)


async def test_downgrading_below_0007_refuses_once_a_piece_is_packed_on_its_parent(
    store_url: str,
) -> None:
    a, b = _text(1, 3000), _text(2, 300)
    async with await open_store(store_url, create=True) as w:
        await w.put_array(b, extends=await w.put_array(a), prior=a)
    await assert_downgrade_refused(store_url, "0006", "stay at revision 0007")
