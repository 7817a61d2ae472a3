"""Content-addressed arrays: bit-exact round trips, prefix sharing, corruption."""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import sqlalchemy as sa
import zstandard

from recorder.log.events import ArrayRef
from recorder.log.store import ArrayNotFound, CorruptArray, EventStore, StoreOptions, open_store
from recorder.log.store import arrays as codec
from recorder.log.store.sql import SqlEventStore

RawExecute = Callable[..., Awaitable[list[tuple[object, ...]]]]


def _tokens(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(np.iinfo(np.int32).min, np.iinfo(np.int32).max, n, dtype=np.int32)


def _logprobs(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lp = np.log(rng.random(n, dtype=np.float32))
    lp[:5] = [np.nan, -np.inf, -0.0, np.finfo(np.float32).tiny, -np.finfo(np.float32).max]
    return lp


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


async def test_float64_logprobs_round_trip_bit_for_bit_next_to_float32(store_url: str) -> None:
    """Engines send logprobs as JSON doubles: stored as float64; float32 logs stay readable."""
    exact = _logprobs(5000, 3).astype(np.float64) - 1e-12
    old = _logprobs(5000, 4)
    async with await open_store(store_url, create=True) as w:
        refs = [await w.put_array(exact), await w.put_array(old)]
        assert [r.dtype for r in refs] == ["float64", "float32"]
        grown = await w.put_array(exact[:10], extends=refs[0])
    async with await open_store(store_url) as r:
        got = await r.get_arrays([*refs, grown])
    assert _same_bits(exact, got[0]) and _same_bits(old, got[1])
    assert _same_bits(np.concatenate([exact, exact[:10]]), got[2])


async def test_large_arrays_round_trip_bit_for_bit(store_url: str) -> None:
    tokens, logprobs = _tokens(100_000, 1), _logprobs(100_000, 2)
    body = np.frombuffer(b'{"model": "m", "messages": []}' * 10, np.uint8)
    async with await open_store(store_url, create=True) as w:
        refs = [await w.put_array(tokens), await w.put_array(logprobs), await w.put_array(body)]
        assert [r.dtype for r in refs] == ["int32", "float32", "uint8"]
        assert [r.length for r in refs] == [100_000, 100_000, len(body)]
    # A fresh store reads from the database, not from the writer's cache.
    async with await open_store(store_url) as r:
        got = await r.get_arrays(refs)
    for want, have in zip([tokens, logprobs, body], got, strict=True):
        assert _same_bits(want, have)


async def test_extends_chain_stores_only_suffixes(store_url: str, raw_execute: RawExecute) -> None:
    full = _tokens(30_000, 3)
    cuts = [0, 10_000, 10_001, 25_000, 30_000]
    async with await open_store(store_url, create=True) as w:
        refs: list[ArrayRef] = []
        prev: ArrayRef | None = None
        for a, b in itertools.pairwise(cuts):
            prev = await w.put_array(full[a:b], extends=prev)
            refs.append(prev)
        assert await w.put_array(full[:0], extends=prev) == prev
        again = await w.put_array(full[:10_000])  # same content, same root piece
        assert again == refs[0]
    (n_pieces,) = (await raw_execute(store_url, "SELECT COUNT(*) FROM arrays"))[0]
    assert n_pieces == 4
    async with await open_store(store_url) as r:
        got = await r.get_arrays(list(reversed(refs)))
        for ref, arr in zip(reversed(refs), got, strict=True):
            assert _same_bits(arr, full[: ref.length])
        assert _same_bits(await r.get_array(refs[-1]), full)


async def test_identical_content_stored_once(
    store: EventStore, store_url: str, raw_execute: RawExecute
) -> None:
    a = np.arange(1000, dtype=np.int32)
    refs = [await store.put_array(a.copy()) for _ in range(3)]
    assert len(set(refs)) == 1
    (n,) = (await raw_execute(store_url, "SELECT COUNT(*) FROM arrays"))[0]
    assert n == 1


async def test_equal_prefix_different_suffix_are_different_arrays(store: EventStore) -> None:
    base = await store.put_array(np.arange(10, dtype=np.int32))
    a = await store.put_array(np.array([1], np.int32), extends=base)
    b = await store.put_array(np.array([2], np.int32), extends=base)
    assert a != b
    assert (await store.get_array(a))[-1] == 1 and (await store.get_array(b))[-1] == 2


async def _corrupt_first_piece(url: str, raw_execute: RawExecute, data: bytes) -> None:
    (digest,) = (await raw_execute(url, "SELECT digest FROM arrays"))[0]
    await raw_execute(url, "UPDATE arrays SET data = $1 WHERE digest = $2", data, digest)


@pytest.mark.parametrize("how", ["flipped bytes", "valid frame, other content"])
async def test_corrupted_blob_detected(store_url: str, raw_execute: RawExecute, how: str) -> None:
    tokens = _tokens(5000, 4)
    async with await open_store(store_url, create=True) as w:
        ref = await w.put_array(tokens)
    ((data,),) = await raw_execute(store_url, "SELECT data FROM arrays")
    if how == "flipped bytes":
        raw = bytearray(bytes(data))  # type: ignore[arg-type]
        for i in range(len(raw) // 2, len(raw) // 2 + 8):
            raw[i] ^= 0xFF
        bad = bytes(raw)
    else:
        other = tokens.copy()
        other[123] += 1
        bad = codec.encode_piece(other, "int32", None).data
        assert bad != data and zstandard.ZstdDecompressor().decompress(bad)
    await _corrupt_first_piece(store_url, raw_execute, bad)
    async with await open_store(store_url) as r:
        with pytest.raises(CorruptArray, match=ref.digest.hex()) as info:
            await r.get_array(ref)
    assert "recorder db copy" in str(info.value)


async def test_missing_piece_and_unknown_parent(store: EventStore) -> None:
    ghost = ArrayRef(b"\x01" * 16, 3, "int32")
    with pytest.raises(ArrayNotFound, match=ghost.digest.hex()):
        await store.get_array(ghost)
    with pytest.raises(ArrayNotFound, match="extends"):
        await store.put_array(np.arange(3, dtype=np.int32), extends=ghost)


async def test_ref_from_other_dtype_rejected(store: EventStore) -> None:
    ref = await store.put_array(np.arange(4, dtype=np.int32))
    with pytest.raises(CorruptArray, match="int32"):
        await store.get_array(ArrayRef(ref.digest, ref.length, "float32"))
    with pytest.raises(ValueError, match="without loss"):
        await store.put_array(np.array([0.5], np.float32), extends=ref)


def test_codec_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="1-D"):
        codec.as_suffix(np.zeros((2, 2), np.int32), None)
    with pytest.raises(ValueError, match="without loss"):
        codec.as_suffix(np.array([2**40]), "int32")
    arr, dtype = codec.as_suffix(np.array([1, 2, 3]), None)  # int64 that fits
    assert dtype == "int32" and arr.dtype == np.int32


def test_shuffled_tokens_compress_near_entropy() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49_152, 100_000, dtype=np.int32)
    piece = codec.encode_piece(tokens, "int32", None)
    # log2(49152) = 15.6 bits: ~1.95 bytes/token is the floor for uniform ids.
    assert len(piece.data) / len(tokens) < 2.2
    assert _same_bits(codec.decode_piece(piece).suffix, tokens)


async def test_reading_turns_in_order_fetches_one_piece_per_turn(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    turns = [_tokens(500, 10 + t) for t in range(8)]
    async with await open_store(store_url, create=True) as w:
        refs: list[ArrayRef] = []
        prev: ArrayRef | None = None
        for new in turns:
            prev = await w.put_array(new, extends=prev)
            refs.append(prev)
    async with await open_store(store_url) as r:
        assert isinstance(r, SqlEventStore)
        fetched: list[int] = []
        real = r._reader._fetch

        async def counting(conn: object, digests: list[bytes]) -> list[codec.DecodedPiece]:
            fetched.append(len(digests))
            return await real(conn, digests)  # type: ignore[arg-type]

        monkeypatch.setattr(r._reader, "_fetch", counting)
        for t, ref in enumerate(refs):
            got = await r.get_array(ref)
            assert _same_bits(got, np.concatenate(turns[: t + 1]))
        assert fetched == [1] * len(turns)
    # A cold store resolves chains round by round, one IN query per level.
    async with await open_store(store_url) as cold:
        assert isinstance(cold, SqlEventStore)
        rounds: list[int] = []
        real_cold = cold._reader._fetch

        async def counting_cold(conn: object, digests: list[bytes]) -> list[codec.DecodedPiece]:
            rounds.append(len(digests))
            return await real_cold(conn, digests)  # type: ignore[arg-type]

        monkeypatch.setattr(cold._reader, "_fetch", counting_cold)
        await cold.get_arrays([refs[-1], refs[3]])
        # Both chains walk down together; the shorter one's pieces end the walk.
        assert rounds == [2, 2, 2, 2]


# -- cache sizing (StoreOptions) and streaming reads ----------------------------


async def _turn_chain(store: EventStore, turns: int, n: int = 300) -> list[ArrayRef]:
    refs: list[ArrayRef] = []
    prev: ArrayRef | None = None
    for t in range(turns):
        prev = await store.put_array(_tokens(n, 100 + t), extends=prev)
        refs.append(prev)
    return refs


def _cache(store: EventStore) -> codec.PieceCache:
    assert isinstance(store, SqlEventStore)
    return store.piece_cache


async def test_piece_cache_stays_within_its_configured_bound(store_url: str) -> None:
    bound = 8 * (300 * 4 + codec.PieceCache.ENTRY_OVERHEAD)  # room for 8 pieces
    options = StoreOptions(piece_cache_bytes=bound)
    async with await open_store(store_url, create=True, options=options) as s:
        refs = await _turn_chain(s, 20)
        assert len(_cache(s)) == 8 and _cache(s).nbytes <= bound
        got = await s.get_arrays(refs)
        assert _cache(s).nbytes <= bound
    for t, arr in enumerate(got):
        assert _same_bits(arr, np.concatenate([_tokens(300, 100 + k) for k in range(t + 1)]))


async def test_zero_piece_cache_keeps_nothing_and_still_reads(store_url: str) -> None:
    async with await open_store(
        store_url, create=True, options=StoreOptions(piece_cache_bytes=0)
    ) as s:
        refs = await _turn_chain(s, 5)
        assert len(_cache(s)) == 0
        got = await s.get_array(refs[-1])
        assert len(_cache(s)) == 0
    assert _same_bits(got, np.concatenate([_tokens(300, 100 + k) for k in range(5)]))


async def test_uncached_read_leaves_the_cache_as_it_was(store_url: str) -> None:
    async with await open_store(store_url, create=True) as w:
        refs = await _turn_chain(w, 6)
    async with await open_store(store_url) as r:  # default options: a 256 MiB cache
        first = await r.get_arrays(refs[:2])
        held = len(_cache(r))
        assert held == 2
        streamed = await r.get_arrays(refs, cache=False)
        assert len(_cache(r)) == held  # used what was cached, kept nothing new
        assert all(_same_bits(a, b) for a, b in zip(first, streamed[:2], strict=True))
        again = await r.get_arrays(refs)  # the default read caches as before
        assert len(_cache(r)) == len(refs)
    assert all(_same_bits(a, b) for a, b in zip(streamed, again, strict=True))


async def test_page_cache_sizes_reach_sqlite(sqlite_url: str) -> None:
    options = StoreOptions(writer_page_cache_bytes=3 * 2**20, reader_page_cache_bytes=5 * 2**20)
    for opts, writer_kib, reader_kib in (
        (None, 4 * 1024, 16 * 1024),
        (options, 3 * 1024, 5 * 1024),
    ):
        async with await open_store(sqlite_url, create=True, options=opts) as s:
            assert isinstance(s, SqlEventStore)
            async with s.write_engine.connect() as conn:
                assert await conn.scalar(sa.text("PRAGMA cache_size")) == -writer_kib
            async with s.read_engine.connect() as conn:
                assert await conn.scalar(sa.text("PRAGMA cache_size")) == -reader_kib


def test_store_options_reject_negative_sizes_and_offer_a_streaming_preset() -> None:
    with pytest.raises(ValueError, match="piece_cache_bytes"):
        StoreOptions(piece_cache_bytes=-1)
    lean = StoreOptions.streaming()
    assert lean.piece_cache_bytes == 0
    assert lean.writer_page_cache_bytes < StoreOptions().writer_page_cache_bytes
    assert lean.reader_page_cache_bytes < StoreOptions().reader_page_cache_bytes


def test_piece_cache_charges_overhead_and_evicts_least_recent() -> None:
    pieces = [
        codec.decode_piece(codec.encode_piece(_tokens(10, s), "int32", None)) for s in range(4)
    ]
    entry = 40 + codec.PieceCache.ENTRY_OVERHEAD
    cache = codec.PieceCache(3 * entry)
    for p in pieces[:3]:
        cache.put(p)
    assert cache.nbytes == 3 * entry
    assert cache.get(pieces[0].digest) is pieces[0]  # now most recent
    cache.put(pieces[3])
    assert len(cache) == 3 and cache.get(pieces[1].digest) is None
    disabled = codec.PieceCache(0)
    disabled.put(pieces[0])
    assert len(disabled) == 0 and disabled.nbytes == 0


def test_decoding_from_many_threads_at_once() -> None:
    pieces = [codec.encode_piece(_tokens(2000, s), "int32", None) for s in range(64)]
    with ThreadPoolExecutor(8) as pool:
        decoded = list(pool.map(codec.decode_piece, pieces * 4))
    for i, d in enumerate(decoded):
        assert _same_bits(d.suffix, _tokens(2000, i % 64))


async def test_prefixes_read_together_share_one_buffer(store: EventStore) -> None:
    """A session's inputs (each extending the last) come back as views of one copy."""
    rng = np.random.default_rng(7)
    parts = [rng.integers(0, 50_000, n, dtype=np.int32) for n in (500, 30, 70, 400)]
    refs: list[ArrayRef] = []
    parent: ArrayRef | None = None
    for part in parts:
        parent = await store.put_array(part, extends=parent)
        refs.append(parent)
    other = await store.put_array(parts[0][:100])  # an unrelated array in the same read
    wanted = [refs[1], other, refs[3], refs[0], refs[1]]
    got = await store.get_arrays(wanted, cache=False)

    for ref, array in zip(wanted, got, strict=True):
        n = ref.length
        expected = np.concatenate(parts)[:n] if ref is not other else parts[0][:100]
        assert array.dtype == np.int32 and np.array_equal(array, expected)
        assert not array.flags.writeable
    longest = got[2]
    for prefix in (got[0], got[3], got[4]):
        assert np.shares_memory(prefix, longest)
    assert not np.shares_memory(got[1], longest)
    assert sum(a.nbytes for a in got if a.base is None) == longest.nbytes + got[1].nbytes
