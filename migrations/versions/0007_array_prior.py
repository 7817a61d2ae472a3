"""Arrays: a piece may be compressed against its parent's last bytes (codec 7).

No column changes: a `CODEC_ZSTD_PRIOR` piece is zstd-compressed with the
last `arrays.PRIOR_BYTES` bytes of the array it extends as dictionary, and
names that array in `basis` too. A turn's new messages and new tokens repeat
what the turns just before them said, so they pack smaller against it.
Code at revision 0006 cannot read codec 7, so the revision exists to make it
refuse a database written with it ("a newer one wrote it") instead of
failing on the first read of a body or an engine input. Rows written before
read back unchanged.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28
"""

from __future__ import annotations

from recorder.log.store.migrations import refuse_downgrade_past_codec

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

CODEC_ZSTD_PRIOR = 7


def upgrade() -> None:
    """Nothing to change in the tables (see the module docstring)."""


def downgrade() -> None:
    refuse_downgrade_past_codec(
        CODEC_ZSTD_PRIOR, "are compressed against their parent's last bytes", "0006", "0007"
    )
