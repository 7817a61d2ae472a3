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

from recorder.log.store.migrations import refuse_downgrade_past_codec

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

CODEC_CONCAT = 6


def upgrade() -> None:
    """Nothing to change in the tables (see the module docstring)."""


def downgrade() -> None:
    refuse_downgrade_past_codec(CODEC_CONCAT, "join other pieces by digest", "0005", "0006")
