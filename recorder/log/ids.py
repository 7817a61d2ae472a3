"""Time-ordered event ids (UUID version 7, RFC 9562); Python 3.11 has no `uuid.uuid7`.

Why: the store keeps a unique index on `event_id`. Random (v4) ids land all
over that B-tree, so every write transaction dirties a page per event and
the database writes (and fsyncs) far more than the rows themselves. v7 ids
start with the millisecond timestamp, so new ids go to the right-hand edge
of the index like an autoincrement key.

Layout: 48-bit Unix milliseconds, version 7, 12 bits of sub-millisecond
clock (RFC 9562 method 3), variant 0b10, 62 random bits. Ids from one
process strictly increase: when the clock has not advanced (or stepped
back), the 60-bit timestamp field is bumped by one tick instead.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from typing import Final

_VERSION: Final = 0x7 << 76
_VARIANT: Final = 0b10 << 62
_TICKS_PER_MS: Final = 4096  # the 12-bit sub-millisecond field

_lock = threading.Lock()
_last_tick = 0


def _next_tick() -> int:
    """Clock ticks (1/4096 ms since the epoch), strictly increasing per process."""
    global _last_tick
    ms, ns = divmod(time.time_ns(), 1_000_000)
    tick = ms * _TICKS_PER_MS + ns * _TICKS_PER_MS // 1_000_000
    with _lock:
        if tick <= _last_tick:
            tick = _last_tick + 1
        _last_tick = tick
    return tick


def uuid7() -> uuid.UUID:
    """A new version-7 UUID, greater than every earlier one from this process.

    The random bits come from `random` (reseeded after fork), not
    `os.urandom`: ids need uniqueness, not secrecy, and this avoids a syscall
    per event.
    """
    tick = _next_tick()
    ms, sub = divmod(tick, _TICKS_PER_MS)
    value = (ms << 80) | _VERSION | (sub << 64) | _VARIANT | random.getrandbits(62)
    return uuid.UUID(int=value)


def uuid7_time(u: uuid.UUID) -> float:
    """The Unix time (seconds) a version-7 UUID was made at, to the millisecond."""
    if u.version != 7:
        raise ValueError(f"{u} is a version-{u.version} UUID; only version 7 carries a time")
    return (u.int >> 80) / 1000
