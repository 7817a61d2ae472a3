"""Time-ordered event ids (UUIDv7)."""

from __future__ import annotations

import time
import uuid

import pytest

from recorder.log import ids
from recorder.log.ids import uuid7, uuid7_time


def test_uuid7_layout_and_time() -> None:
    before = time.time()
    u = uuid7()
    after = time.time()
    assert u.version == 7 and u.variant == uuid.RFC_4122
    assert int(before * 1000) / 1000 <= uuid7_time(u) <= after + 0.001


def test_uuid7_strictly_increasing_even_within_one_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    made = [uuid7() for _ in range(20_000)]
    # Byte order is what the event_id index sorts by; it must match creation order.
    assert [u.bytes for u in made] == sorted(u.bytes for u in made)
    assert len({u.bytes for u in made}) == len(made)
    # A clock that stands still (or steps back) still yields increasing ids.
    frozen = time.time_ns() - 5_000_000
    monkeypatch.setattr(ids.time, "time_ns", lambda: frozen)
    stuck = [uuid7() for _ in range(5_000)]  # more than 4096 ticks: borrows into later ms
    assert made[-1].bytes < stuck[0].bytes
    assert [u.bytes for u in stuck] == sorted(u.bytes for u in stuck)
    assert all(u.version == 7 and u.variant == uuid.RFC_4122 for u in stuck)


def test_uuid7_time_rejects_other_versions() -> None:
    with pytest.raises(ValueError, match="version-4"):
        uuid7_time(uuid.uuid4())
