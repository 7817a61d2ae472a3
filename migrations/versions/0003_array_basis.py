"""Arrays: a piece may be zstd-compressed against a basis array (codec 3).

`basis` names the array whose whole content is the piece's raw-content
dictionary (a request body compressed against the previous body stores only
what changed); `basis_depth` counts the basis hops a cold read of the piece
may take, so writers can bound it. Existing rows get NULL / 0: they have no
basis and read back unchanged.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

CODEC_ZSTD_BASIS = 3


def upgrade() -> None:
    with op.batch_alter_table("arrays") as batch:
        batch.add_column(sa.Column("basis", sa.LargeBinary(16), nullable=True))
        batch.add_column(
            sa.Column("basis_depth", sa.SmallInteger, nullable=False, server_default="0")
        )


def downgrade() -> None:
    n = op.get_bind().scalar(
        sa.text("SELECT COUNT(*) FROM arrays WHERE codec = :c"), {"c": CODEC_ZSTD_BASIS}
    )
    if n:
        raise RuntimeError(
            f"{n} array pieces are compressed against a basis, which code at revision "
            "0002 cannot read; stay at revision 0003 or newer"
        )
    with op.batch_alter_table("arrays") as batch:
        batch.drop_column("basis_depth")
        batch.drop_column("basis")
