"""Arrays: keep a piece's sub-chunk tail inline so TOAST pages pack full (Postgres).

A compressed piece is now `data || data_tail`. On Postgres the writer puts
whole TOAST chunks (1996 bytes each on 8 KiB pages) in `data`, stored
out of line uncompressed (EXTERNAL: zstd output does not compress further,
so trying pglz only costs CPU), and the remainder in `data_tail`, kept in
the row (MAIN). Four whole chunks fill a TOAST page exactly; before, each
piece's short last chunk left gaps that no later full chunk fit into, and
pages ran ~80% full. SQLite leaves `data_tail` NULL. Rows written before
this revision keep everything in `data` and read back unchanged.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("arrays", sa.Column("data_tail", sa.LargeBinary, nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE arrays ALTER COLUMN data SET STORAGE EXTERNAL")
        op.execute("ALTER TABLE arrays ALTER COLUMN data_tail SET STORAGE MAIN")


def downgrade() -> None:
    # Fold tails back into `data` first so no piece loses bytes (SQLite's ||
    # yields TEXT, hence the cast back to BLOB).
    pg = op.get_bind().dialect.name == "postgresql"
    joined = "data || data_tail" if pg else "CAST(data || data_tail AS BLOB)"
    op.execute(f"UPDATE arrays SET data = {joined} WHERE data_tail IS NOT NULL")
    if pg:
        op.execute("ALTER TABLE arrays ALTER COLUMN data SET STORAGE EXTENDED")
    with op.batch_alter_table("arrays") as batch:
        batch.drop_column("data_tail")
