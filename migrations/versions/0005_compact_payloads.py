"""Events as msgpack arrays, maybe packed; float64 pieces as exact float32s (codec 5).

No column changes. From this revision on, an event's payload is a msgpack
array (its fields in `events.ARRAY_LAYOUTS` order) rather than a map with
every field's name, possibly compressed against a fixed dictionary
(`recorder.log.packing`: a 0xC1 byte first), and a float64 piece whose values are all
float32 values (engine logprobs) may be stored as those float32s
(`arrays.CODEC_F32_SHUFFLED`). Code at revision 0004 reads neither, so the
revision exists to make it refuse a database written with them ("a newer one
wrote it") instead of failing on the first event it reads. Rows written
before keep their maps and codecs and read back unchanged.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

CODEC_F32_SHUFFLED = 5
# msgpack's array markers: fixarray (0x90-0x9f), array 16 (0xdc), array 32 (0xdd);
# 0xc1: a packed payload.
_ARRAY_PAYLOAD = {
    "sqlite": "(substr(hex(payload), 1, 1) = '9' OR substr(hex(payload), 1, 2) IN ('DC', 'DD', 'C1'))",
    "postgresql": "(get_byte(payload, 0) BETWEEN 144 AND 159 OR get_byte(payload, 0) IN (220, 221, 193))",
}


def upgrade() -> None:
    """Nothing to change in the tables (see the module docstring)."""


def downgrade() -> None:
    bind = op.get_bind()
    pieces = bind.scalar(
        sa.text("SELECT COUNT(*) FROM arrays WHERE codec = :c"), {"c": CODEC_F32_SHUFFLED}
    )
    events = bind.scalar(
        sa.text(f"SELECT COUNT(*) FROM events WHERE {_ARRAY_PAYLOAD[bind.dialect.name]}")
    )
    if pieces or events:
        raise RuntimeError(
            f"{events} events are stored as arrays and {pieces} array pieces as float32s, "
            "which code at revision 0004 cannot read; stay at revision 0005 or newer"
        )
