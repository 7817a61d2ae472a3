"""Event log, content-addressed arrays, projections; events are append-only.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from recorder.log.store.tables import EventId, Position

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_SQLITE_GUARDS = [
    f"""
    CREATE TRIGGER events_no_{op_name.lower()} BEFORE {op_name} ON events
    BEGIN SELECT RAISE(ABORT, 'events are append-only: {op_name} is not allowed'); END
    """
    for op_name in ("UPDATE", "DELETE")
]

_POSTGRES_GUARDS = [
    """
    CREATE FUNCTION events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        RAISE EXCEPTION 'events are append-only: % is not allowed', TG_OP
            USING ERRCODE = 'insufficient_privilege';
    END
    $$
    """,
    """
    CREATE TRIGGER events_no_update_delete BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION events_append_only()
    """,
    """
    CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION events_append_only()
    """,
]


def upgrade() -> None:
    op.create_table(
        "events",
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
    op.create_table(
        "arrays",
        sa.Column("digest", sa.LargeBinary(16), primary_key=True),
        sa.Column("parent", sa.LargeBinary(16), nullable=True),
        sa.Column("dtype", sa.String(8), nullable=False),
        sa.Column("total_length", sa.BigInteger, nullable=False),
        sa.Column("codec", sa.SmallInteger, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "projection_names",
        sa.Column("ordinal", Position, sa.Identity(), primary_key=True),
        sa.Column("name", sa.Text, nullable=False, unique=True),
    )
    op.create_table(
        "projections",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("session_id", sa.Text, primary_key=True),
        sa.Column("covers_position", sa.BigInteger, nullable=False),
        sa.Column("digest", sa.Text, nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
    )
    guards = _SQLITE_GUARDS if op.get_bind().dialect.name == "sqlite" else _POSTGRES_GUARDS
    for sql in guards:
        op.execute(sql)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS events_no_truncate ON events")
        op.execute("DROP TRIGGER IF EXISTS events_no_update_delete ON events")
        op.execute("DROP FUNCTION IF EXISTS events_append_only()")
    for table in ("projections", "projection_names", "arrays", "events"):
        op.drop_table(table)
