"""Arrays: a piece may join stored pieces by digest (codec 6).

No column changes: a concatenated piece lists the digests of the pieces
whose suffixes, joined, are its bytes in `data` (`arrays.CODEC_CONCAT`); a
chain's spine names its per-turn pieces instead of repeating their tokens.
Code at revision 0005 cannot read codec 6, so the revision exists to make
it refuse a database written with it ("a newer one wrote it") instead of
failing on the first restore that reads a spine. Rows written before read
back unchanged.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

CODEC_CONCAT = 6


def upgrade() -> None:
    """Nothing to change in the tables (see the module docstring)."""


def downgrade() -> None:
    n = op.get_bind().scalar(
        sa.text("SELECT COUNT(*) FROM arrays WHERE codec = :c"), {"c": CODEC_CONCAT}
    )
    if n:
        raise RuntimeError(
            f"{n} array pieces join other pieces by digest, which code at revision 0005 "
            "cannot read; stay at revision 0006 or newer"
        )
