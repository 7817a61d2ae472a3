"""Arrays: a piece may be a copy of a byte range of its basis array (codec 4).

No column changes: a copy piece uses the `basis` and `basis_depth` columns of
revision 0003, its `data` holding the range (offset, length). The revision
exists so that code which cannot read codec 4 refuses a database written with
it ("a newer one wrote it") instead of failing on the first body it reads.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""

from __future__ import annotations

from recorder.log.store.migrations import refuse_downgrade_past_codec

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

CODEC_COPY_BASIS = 4


def upgrade() -> None:
    """Nothing to change in the tables (see the module docstring)."""


def downgrade() -> None:
    refuse_downgrade_past_codec(CODEC_COPY_BASIS, "are copies of a basis range", "0003", "0004")
