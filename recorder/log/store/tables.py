"""Table definitions shared by both backends and by the initial migration.

Changing a table means a new Alembic revision under `migrations/versions/`;
these objects describe the head revision for the query code.
"""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa


class UuidBytes(sa.TypeDecorator[uuid.UUID]):
    """A UUID as 16 raw bytes (SQLite has no UUID type; text would take 32)."""

    impl = sa.LargeBinary(16)
    cache_ok = True

    def process_bind_param(self, value: uuid.UUID | None, dialect: Any) -> bytes | None:
        return None if value is None else value.bytes

    def process_result_value(self, value: bytes | None, dialect: Any) -> uuid.UUID | None:
        return None if value is None else uuid.UUID(bytes=value)


EventId = sa.Uuid(as_uuid=True).with_variant(UuidBytes(), "sqlite")

metadata = sa.MetaData()

# SQLite only treats "INTEGER PRIMARY KEY" as the rowid alias, so the BIGINT
# position becomes INTEGER there (still 64-bit).
Position = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

events = sa.Table(
    "events",
    metadata,
    sa.Column("position", Position, sa.Identity(), primary_key=True),
    sa.Column("session_id", sa.Text, nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("event_id", EventId, nullable=False),
    sa.Column("type", sa.String(64), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("ts", sa.Double, nullable=False),
    sa.Column("payload", sa.LargeBinary, nullable=False),
    sa.UniqueConstraint("session_id", "seq", name="uq_events_session_seq"),
    sa.UniqueConstraint("event_id", name="uq_events_event_id"),
)

arrays = sa.Table(
    "arrays",
    metadata,
    sa.Column("digest", sa.LargeBinary(16), primary_key=True),
    sa.Column("parent", sa.LargeBinary(16), nullable=True),
    sa.Column("dtype", sa.String(8), nullable=False),
    sa.Column("total_length", sa.BigInteger, nullable=False),
    sa.Column("codec", sa.SmallInteger, nullable=False),
    # A piece's compressed bytes are `data || data_tail` (revision 0002): see
    # `SqlEventStore.array_chunk_bytes` for why a backend splits them.
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Column("data_tail", sa.LargeBinary, nullable=True),
    # Revision 0003: the array whose bytes are this piece's zstd dictionary
    # (codec 3), and the basis hops a cold read of the piece may take.
    sa.Column("basis", sa.LargeBinary(16), nullable=True),
    sa.Column("basis_depth", sa.SmallInteger, nullable=False, server_default="0"),
)

projection_names = sa.Table(
    "projection_names",
    metadata,
    sa.Column("ordinal", Position, sa.Identity(), primary_key=True),
    sa.Column("name", sa.Text, nullable=False, unique=True),
)

projections = sa.Table(
    "projections",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("session_id", sa.Text, primary_key=True),
    sa.Column("covers_position", sa.BigInteger, nullable=False),
    sa.Column("digest", sa.Text, nullable=False),
    sa.Column("payload", sa.LargeBinary, nullable=False),
)
