"""Copy one store into another, row for row (`recorder db copy`).

Events keep their positions, seqs, ids, timestamps, versions and payload
bytes (no decode/re-encode), so both stores read back identical sequences and
projections' `covers_position` stay valid. Arrays and projections are copied
too, each piece as stored (basis-coded pieces keep their basis, which is
copied with them). The target must hold no events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import sqlalchemy as sa

from recorder.log.store.arrays import join_blob
from recorder.log.store.base import StoreError
from recorder.log.store.sql import SqlEventStore
from recorder.log.store.tables import arrays, events, projection_names, projections

EVENT_PAGE = 5_000
ARRAY_PAGE = 200


class CopyStats(msgspec.Struct, frozen=True):
    events: int
    arrays: int
    projections: int


async def copy_store(src: SqlEventStore, dst: SqlEventStore) -> CopyStats:
    if await dst.last_position() != 0:
        raise StoreError(
            f"{dst.url} already holds events; copy into an empty database "
            "(create one and run `recorder db upgrade --db URL` first if needed)"
        )
    n_events = await _copy_table(src, dst, events, [events.c.position], EVENT_PAGE)
    n_arrays = await _copy_table(
        src, dst, arrays, [arrays.c.digest], ARRAY_PAGE, ignore=True, convert=_array_row(dst)
    )
    await _copy_table(src, dst, projection_names, [projection_names.c.ordinal], EVENT_PAGE)
    keys = [projections.c.name, projections.c.session_id]
    n_proj = await _copy_table(src, dst, projections, keys, EVENT_PAGE)
    async with dst.write_engine.begin() as conn:
        await dst._after_bulk_copy(conn)
    return CopyStats(events=n_events, arrays=n_arrays, projections=n_proj)


def _array_row(dst: SqlEventStore) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Re-split each piece's bytes the way the target backend stores them."""

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        tail = row["data_tail"]
        blob = join_blob(bytes(row["data"]), None if tail is None else bytes(tail))
        return dst.array_row(
            row["digest"],
            row["parent"],
            row["dtype"],
            row["total_length"],
            row["codec"],
            blob,
            basis=row["basis"],
            basis_depth=row["basis_depth"],
        )

    return convert


async def _copy_table(
    src: SqlEventStore,
    dst: SqlEventStore,
    table: sa.Table,
    keys: list[sa.Column[Any]],
    page: int,
    *,
    ignore: bool = False,
    convert: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> int:
    """Keyset-page `table` from src to dst; one dst transaction per page."""
    copied = 0
    last: tuple[Any, ...] | None = None
    while True:
        stmt = sa.select(table).order_by(*keys).limit(page)
        if last is not None:
            stmt = stmt.where(sa.tuple_(*keys) > sa.tuple_(*last))
        async with src.read_engine.connect() as conn:
            rows = [dict(r._mapping) for r in await conn.execute(stmt)]
        if not rows:
            return copied
        last = tuple(rows[-1][k.name] for k in keys)
        insert = type(dst).dialect_insert(table)
        if ignore:
            insert = insert.on_conflict_do_nothing()
        async with dst.write_engine.begin() as conn:
            await dst._lock_writers(conn)
            await conn.execute(insert, [convert(r) for r in rows] if convert else rows)
        copied += len(rows)
