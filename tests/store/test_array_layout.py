"""How array pieces sit in the `arrays` table (revision 0002's data/data_tail split)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from recorder.log.events import ArrayRef
from recorder.log.store import SchemaOutOfDate, migrations, open_store
from recorder.log.store import arrays as codec
from recorder.log.store.arrays import join_blob, split_blob
from recorder.log.store.postgres import TOAST_CHUNK_BYTES

RawExecute = Callable[..., Awaitable[list[tuple[object, ...]]]]


def test_split_blob_keeps_whole_chunks_first() -> None:
    blob = bytes(range(256)) * 20  # 5120 bytes
    head, tail = split_blob(blob, 1000)
    assert (len(head), tail) == (5000, blob[5000:])
    assert split_blob(blob[:3000], 1000) == (blob[:3000], None)
    assert split_blob(blob[:999], 1000) == (b"", blob[:999])
    assert split_blob(blob, None) == (blob, None)
    assert join_blob(head, tail) == blob and join_blob(blob, None) == blob


async def test_pieces_split_into_whole_toast_chunks_on_postgres_only(
    store_url: str, raw_execute: RawExecute
) -> None:
    rng = np.random.default_rng(9)
    big, small = rng.integers(0, 49_152, 5000, dtype=np.int32), np.arange(50, dtype=np.int32)
    async with await open_store(store_url, create=True) as w:
        refs = [await w.put_array(big), await w.put_array(small)]
    rows = await raw_execute(
        store_url,
        "SELECT total_length, LENGTH(data), LENGTH(data_tail) FROM arrays ORDER BY total_length",
    )
    (small_len, small_data, small_tail), (big_len, big_data, big_tail) = rows
    assert (small_len, big_len) == (50, 5000)
    if store_url.startswith("postgresql"):
        assert big_data % TOAST_CHUNK_BYTES == 0 and big_data >= TOAST_CHUNK_BYTES
        assert 0 < big_tail < TOAST_CHUNK_BYTES  # type: ignore[operator]
        assert small_data == 0 and small_tail
        storage = await raw_execute(
            store_url,
            "SELECT attname, attstorage::text FROM pg_attribute WHERE attrelid = 'arrays'::regclass"
            " AND attname IN ('data', 'data_tail') ORDER BY attname",
        )
        assert storage == [("data", "e"), ("data_tail", "m")]
    else:
        assert small_tail is None and big_tail is None
    async with await open_store(store_url) as r:
        got = await r.get_arrays(refs)
    assert got[0].tobytes() == big.tobytes() and got[1].tobytes() == small.tobytes()


async def test_pieces_written_at_revision_0001_read_after_upgrade(
    store_url: str, raw_execute: RawExecute
) -> None:
    engine = create_async_engine(store_url)
    try:
        await migrations.upgrade(engine, "0001")
    finally:
        await engine.dispose()
    tokens = np.random.default_rng(3).integers(0, 49_152, 4000, dtype=np.int32)
    piece = codec.encode_piece(tokens, "int32", None)
    await raw_execute(
        store_url,
        "INSERT INTO arrays (digest, parent, dtype, total_length, codec, data)"
        " VALUES ($1, NULL, $2, $3, $4, $5)",
        piece.digest,
        piece.dtype,
        piece.total_length,
        piece.codec,
        piece.data,
    )
    with pytest.raises(SchemaOutOfDate, match="recorder db upgrade"):
        await open_store(store_url)
    ref = ArrayRef(piece.digest, piece.total_length, "int32")
    async with await open_store(store_url, create=True) as s:
        assert (await s.get_array(ref)).tobytes() == tokens.tobytes()
        longer = await s.put_array(np.arange(10, dtype=np.int32), extends=ref)
    async with await open_store(store_url) as s:
        assert (await s.get_array(longer)).tobytes() == np.concatenate(
            [tokens, np.arange(10, dtype=np.int32)]
        ).tobytes()
