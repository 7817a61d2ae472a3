"""Arrays compressed against a basis array (`put_array(..., basis=)`, revision 0003)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from recorder.log.events import ArrayRef
from recorder.log.store import (
    ArrayNotFound,
    CorruptArray,
    StoreOptions,
    migrations,
    open_store,
    sql,
)
from recorder.log.store import arrays as codec
from recorder.log.store.copy import copy_store
from recorder.log.store.pieces import chain
from recorder.log.store.sql import SqlEventStore
from tests.store.conftest import assert_downgrade_refused

RawExecute = Callable[..., Awaitable[list[tuple[object, ...]]]]


def conversation_bodies(turns: int, words_per_turn: int = 300, seed: int = 0) -> list[bytes]:
    """Request bodies like an agent's: every turn re-sends the whole conversation,
    then a system prompt and tools that never change."""
    rng = np.random.default_rng(seed)
    vocab = ["".join(rng.choice(list("abcdefghij"), int(rng.integers(2, 9)))) for _ in range(2000)]
    tools = [{"name": f"tool{i}", "description": " ".join(rng.choice(vocab, 80))} for i in range(8)]
    messages: list[dict[str, str]] = []
    bodies = []
    for t in range(turns):
        role = "user" if t % 2 == 0 else "assistant"
        messages.append({"role": role, "content": " ".join(rng.choice(vocab, words_per_turn))})
        body = {"model": "m", "messages": messages, "system": "be brief", "tools": tools}
        bodies.append(json.dumps(body).encode())
    return bodies


def as_array(body: bytes) -> np.ndarray:
    return np.frombuffer(body, np.uint8)


async def stored_bytes(url: str, raw_execute: RawExecute) -> int:
    ((n,),) = await raw_execute(
        url, "SELECT COALESCE(SUM(LENGTH(data) + COALESCE(LENGTH(data_tail), 0)), 0) FROM arrays"
    )
    assert isinstance(n, int)
    return n


async def test_whole_bodies_on_a_basis_round_trip_and_store_what_changed(
    store_url: str, raw_execute: RawExecute
) -> None:
    bodies = conversation_bodies(12)
    async with await open_store(store_url, create=True) as w:
        refs: list[ArrayRef] = []
        for body in bodies:
            refs.append(await w.put_array(as_array(body), basis=refs[-1] if refs else None))
    with_basis = await stored_bytes(store_url, raw_execute)
    codecs = await raw_execute(store_url, "SELECT codec FROM arrays")
    assert sum(c == codec.CODEC_ZSTD_BASIS for (c,) in codecs) == len(bodies) - 1
    # A cold store (empty piece cache) resolves every basis from the database.
    async with await open_store(store_url, options=StoreOptions(piece_cache_bytes=0)) as r:
        got = await r.get_arrays(list(reversed(refs)))
    for body, arr in zip(reversed(bodies), got, strict=True):
        assert arr.dtype == np.uint8 and arr.tobytes() == body
    plain = sum(len(codec.encode_piece(as_array(b), "uint8", None).data) for b in bodies)
    assert with_basis * 4 < plain


async def test_suffixes_on_a_basis_round_trip(store_url: str) -> None:
    """The server's shape: a shared prefix extended, the new tail on the previous body."""
    bodies = conversation_bodies(10, seed=1)
    async with await open_store(store_url, create=True) as w:
        refs: list[ArrayRef] = []
        for body in bodies:
            prev = refs[-1] if refs else None
            data = as_array(body)
            cut = len(data) * 2 // 3
            head = await w.put_array(data[:cut], basis=prev)
            refs.append(await w.put_array(data[cut:], extends=head, basis=prev))
    async with await open_store(store_url) as r:
        for body, ref in zip(bodies, refs, strict=True):
            assert (await r.get_array(ref)).tobytes() == body


async def test_digest_names_content_not_encoding(sqlite_url: str) -> None:
    bodies = conversation_bodies(3, seed=2)
    other_url = sqlite_url.replace(".db", "-other.db")
    async with await open_store(sqlite_url, create=True) as a:
        first = await a.put_array(as_array(bodies[0]))
        on_basis = await a.put_array(as_array(bodies[1]), basis=first)
        again = await a.put_array(as_array(bodies[1]))  # same content: the same (one) row
        assert again == on_basis
        assert isinstance(a, SqlEventStore)
    async with await open_store(other_url, create=True) as b:
        plain = await b.put_array(as_array(bodies[1]))
    assert plain == on_basis
    piece = codec.encode_piece_on_basis(
        as_array(bodies[1]), "uint8", None, first, bodies[0], basis_depth=0
    )
    assert piece.codec == codec.CODEC_ZSTD_BASIS and piece.digest == plain.digest


def test_basis_that_does_not_help_is_not_used() -> None:
    rng = np.random.default_rng(4)
    data, unrelated = rng.integers(0, 256, 20_000, dtype=np.uint8), rng.bytes(20_000)
    basis = ArrayRef(b"\x02" * 16, 20_000, "uint8")
    piece = codec.encode_piece_on_basis(data, "uint8", None, basis, unrelated, basis_depth=0)
    assert piece.basis is None and piece.codec == codec.CODEC_ZSTD and piece.depth == 0
    with pytest.raises(CorruptArray, match="cannot be decoded"):
        codec.decode_piece(codec.Piece(piece.digest, None, "uint8", 1, 3, piece.data, basis.digest))


async def test_corrupt_basis_detected_reading_a_dependent(
    store_url: str, raw_execute: RawExecute
) -> None:
    bodies = conversation_bodies(3, seed=3)
    async with await open_store(store_url, create=True) as w:
        first = await w.put_array(as_array(bodies[0]))
        second = await w.put_array(as_array(bodies[1]), basis=first)
        third = await w.put_array(as_array(bodies[2]), basis=second)
    ((n,),) = await raw_execute(
        store_url, "SELECT COUNT(*) FROM arrays WHERE basis = $1", second.digest
    )
    assert n == 1
    # Another valid frame: decodes fine but to other bytes, so only the hash can tell.
    other = codec.encode_piece(as_array(bodies[0][:-1] + b"!"), "uint8", None).data
    await raw_execute(
        store_url,
        "UPDATE arrays SET data = $1, data_tail = NULL WHERE digest = $2",
        other,
        first.digest,
    )
    async with await open_store(store_url) as r:
        with pytest.raises(CorruptArray, match=first.digest.hex()):
            await r.get_array(third)


async def test_unknown_basis_rejected(store: SqlEventStore) -> None:
    ghost = ArrayRef(b"\x03" * 16, 10, "uint8")
    with pytest.raises(ArrayNotFound, match=ghost.digest.hex()):
        await store.put_array(np.arange(10, dtype=np.uint8), basis=ghost)


async def test_basis_chains_stay_bounded(sqlite_url: str, raw_execute: RawExecute) -> None:
    bodies = conversation_bodies(2 * sql.MAX_BASIS_DEPTH + 6, words_per_turn=60, seed=5)
    async with await open_store(sqlite_url, create=True) as w:
        assert isinstance(w, SqlEventStore)
        whole: list[ArrayRef] = []
        grown: list[ArrayRef] = []
        for body in bodies:
            data = as_array(body)
            whole.append(await w.put_array(data, basis=whole[-1] if whole else None))
            # Each body extends the previous one's first half, on the previous body.
            prev = grown[-1] if grown else None
            cut = len(data) // 2
            head = await w.put_array(data[:cut], basis=prev)
            grown.append(await w.put_array(data[cut:], extends=head, basis=prev))
        pieces = await w._reader.load([r.digest for r in whole + grown], cache=False)
        for ref in whole + grown:
            assert codec.chain_depth(chain(pieces, ref.digest)) <= sql.MAX_BASIS_DEPTH
    ((deepest,),) = await raw_execute(sqlite_url, "SELECT MAX(basis_depth) FROM arrays")
    assert deepest == sql.MAX_BASIS_DEPTH
    async with await open_store(sqlite_url) as r:
        got = await r.get_arrays(whole + grown)
    assert [a.tobytes() for a in got] == bodies + bodies


async def test_a_session_leaves_its_old_bodies_out_of_the_cache(sqlite_url: str) -> None:
    """Bodies stored as the server stores them: no body's pieces are cached
    (nothing reads them hot) but those of the body the tails are copied from
    (here the first: the tools never change), read to check each copy."""
    from recorder.server.deltas import BodyPrefixes, put_body

    bodies = conversation_bodies(3 * sql.MAX_BASIS_DEPTH, words_per_turn=60, seed=9)
    async with await open_store(sqlite_url, create=True) as w:
        assert isinstance(w, SqlEventStore)
        prefixes = BodyPrefixes()
        refs = []
        for body in bodies:
            ref, prefixes = await put_body(w, prefixes, body)
            refs.append(ref)
        cached = sum(p.suffix.nbytes for p in w.piece_cache._items.values())
        assert prefixes.tail is not None and prefixes.tail[0] == refs[0]
        assert cached == len(bodies[0])
        got = await w.get_arrays(refs)  # what left the cache reads back from the database
    assert [a.tobytes() for a in got] == bodies


async def test_long_basis_chain_reads_without_deep_recursion(
    sqlite_url: str, raw_execute: RawExecute, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sql, "MAX_BASIS_DEPTH", 10_000)
    n = 1_200  # beyond Python's default recursion limit
    line = b'{"role": "user", "content": "run the tests again and show me the log"}, '
    async with await open_store(sqlite_url, create=True) as w:
        refs: list[ArrayRef] = []
        for i in range(n):
            body = line * 4 + str(i).encode()
            refs.append(await w.put_array(as_array(body), basis=refs[-1] if refs else None))
    ((deepest,),) = await raw_execute(sqlite_url, "SELECT MAX(basis_depth) FROM arrays")
    assert deepest == n - 1
    async with await open_store(sqlite_url, options=StoreOptions(piece_cache_bytes=0)) as r:
        assert (await r.get_array(refs[-1])).tobytes() == line * 4 + str(n - 1).encode()


async def test_basis_cycle_reported_as_corruption(store_url: str, raw_execute: RawExecute) -> None:
    async with await open_store(store_url, create=True):
        pass
    a, b = as_array(b"alpha" * 50), as_array(b"beta" * 50)
    da, db = (
        codec.piece_digest(None, "uint8", a.tobytes()),
        codec.piece_digest(None, "uint8", b.tobytes()),
    )
    for digest, data, basis in ((da, a, db), (db, b, da)):
        await raw_execute(
            store_url,
            "INSERT INTO arrays (digest, parent, dtype, total_length, codec, data, basis,"
            " basis_depth) VALUES ($1, NULL, 'uint8', $2, 3, $3, $4, 1)",
            digest,
            len(data),
            codec.encode_piece(data, "uint8", None).data,
            basis,
        )
    async with await open_store(store_url) as r:
        with pytest.raises(CorruptArray, match="depends on itself"):
            await r.get_array(ArrayRef(da, len(a), "uint8"))


async def test_database_at_0002_upgrades_and_takes_basis_pieces(
    store_url: str, raw_execute: RawExecute
) -> None:
    engine = create_async_engine(store_url)
    try:
        await migrations.upgrade(engine, "0002")
    finally:
        await engine.dispose()
    bodies = conversation_bodies(2, seed=6)
    old = codec.encode_piece(as_array(bodies[0]), "uint8", None)
    await raw_execute(
        store_url,
        "INSERT INTO arrays (digest, parent, dtype, total_length, codec, data)"
        " VALUES ($1, NULL, 'uint8', $2, $3, $4)",
        old.digest,
        old.total_length,
        old.codec,
        old.data,
    )
    old_ref = ArrayRef(old.digest, old.total_length, "uint8")
    async with await open_store(store_url, create=True) as s:
        new_ref = await s.put_array(as_array(bodies[1]), basis=old_ref)
    assert await raw_execute(
        store_url, "SELECT basis, basis_depth FROM arrays WHERE digest = $1", old.digest
    ) == [(None, 0)]
    async with await open_store(store_url) as s:
        got = await s.get_arrays([old_ref, new_ref])
    assert [a.tobytes() for a in got] == bodies


@pytest.mark.postgres
async def test_copy_sqlite_to_postgres_keeps_basis_pieces(
    sqlite_url: str, postgres_url: str, raw_execute: RawExecute
) -> None:
    bodies = conversation_bodies(6, seed=7)
    async with await open_store(sqlite_url, create=True) as src:
        refs: list[ArrayRef] = []
        for body in bodies:
            refs.append(await src.put_array(as_array(body), basis=refs[-1] if refs else None))
        async with await open_store(postgres_url, create=True) as dst:
            assert isinstance(src, SqlEventStore) and isinstance(dst, SqlEventStore)
            stats = await copy_store(src, dst)
    assert stats.arrays == len(bodies)
    query = "SELECT digest, basis, basis_depth, codec FROM arrays ORDER BY digest"
    want = await raw_execute(sqlite_url, query)
    assert [
        tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)
        for row in await raw_execute(postgres_url, query)
    ] == want
    async with await open_store(postgres_url, options=StoreOptions(piece_cache_bytes=0)) as r:
        assert [a.tobytes() for a in await r.get_arrays(refs)] == bodies


async def test_copy_pieces_round_trip_and_check_what_they_claim(
    store_url: str, raw_execute: RawExecute
) -> None:
    """`basis_offset=`: a piece stored as a range of its basis's bytes, 16 bytes of data,
    read back hot and cold; a range whose bytes differ is refused, nothing stored."""
    bodies = conversation_bodies(2, seed=11)
    first, second = bodies
    tail = len(first) - first.index(b'"tools"')
    assert second.endswith(first[-tail:])
    async with await open_store(store_url, create=True) as w:
        source = await w.put_array(as_array(first))
        head = await w.put_array(as_array(second[:-tail]))
        at = len(first) - tail
        ref = await w.put_array(
            as_array(second[-tail:]), extends=head, basis=source, basis_offset=at
        )
        assert (await w.get_array(ref)).tobytes() == second
        with pytest.raises(ValueError, match="differ"):
            await w.put_array(as_array(b"x" * 300), extends=head, basis=source, basis_offset=at)
    rows = await raw_execute(
        store_url,
        "SELECT codec, LENGTH(data) + COALESCE(LENGTH(data_tail), 0), basis_depth "
        "FROM arrays WHERE basis = $1",
        source.digest,
    )
    assert rows == [(codec.CODEC_COPY_BASIS, 16, 1)]
    async with await open_store(store_url, options=StoreOptions(piece_cache_bytes=0)) as r:
        assert (await r.get_array(ref)).tobytes() == second
    # A range past its basis, or onto other bytes: corruption the reader reports.
    for bad in (codec._COPY_RANGE.pack(len(first), tail), codec._COPY_RANGE.pack(0, tail)):
        await raw_execute(
            store_url,
            "UPDATE arrays SET data = $1, data_tail = NULL WHERE digest = $2",
            bad,
            ref.digest,
        )
        async with await open_store(store_url, options=StoreOptions(piece_cache_bytes=0)) as r:
            with pytest.raises(CorruptArray, match=ref.digest.hex()):
                await r.get_array(ref)


async def test_downgrading_below_0004_refuses_once_a_copy_piece_exists(store_url: str) -> None:
    first, second = conversation_bodies(2, seed=13)
    tail = len(first) - first.index(b'"tools"')
    async with await open_store(store_url, create=True) as w:
        source = await w.put_array(as_array(first))
        head = await w.put_array(as_array(second[:-tail]))
        await w.put_array(
            as_array(second[-tail:]), extends=head, basis=source, basis_offset=len(first) - tail
        )
    await assert_downgrade_refused(store_url, "0003", "copies of a basis range")


async def test_copy_pieces_survive_a_copy_to_another_database(
    sqlite_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    bodies = conversation_bodies(2, seed=12)
    first, second = bodies
    tail = len(first) - first.index(b'"tools"')
    async with await open_store(sqlite_url, create=True) as w:
        source = await w.put_array(as_array(first))
        head = await w.put_array(as_array(second[:-tail]))
        ref = await w.put_array(
            as_array(second[-tail:]), extends=head, basis=source, basis_offset=len(first) - tail
        )
        target = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('copy') / 'to.db'}"
        async with await open_store(target, create=True) as dst:
            assert isinstance(w, SqlEventStore) and isinstance(dst, SqlEventStore)
            await copy_store(w, dst)
    async with await open_store(target, options=StoreOptions(piece_cache_bytes=0)) as r:
        assert (await r.get_array(ref)).tobytes() == second
