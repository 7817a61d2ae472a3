"""How a log's sessions are split between workers (pure: no I/O, no clock).

Sessions are cut into contiguous id ranges with equal numbers of sessions: a
worker is handed two ids, not a list, and the store filters its pages by them
(`EventStore.read_all(sessions=...)`). Ids compare as code points, as Python
compares str and as both stores are told to (SQLite's BINARY collation,
PostgreSQL's "C").
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import msgspec

from recorder.log.store.base import SessionRange

# A worker started for fewer sessions than this costs more than it saves
# (a process imports the package and opens the store in ~1 s).
MIN_SESSIONS_PER_WORKER = 64


class PartStat(msgspec.Struct, frozen=True, kw_only=True):
    """Where one partition ran, the most memory its worker process held, its CPU time."""

    node: str
    sessions: int
    peak_rss: int
    # CPU seconds the worker process spent (its wall time on an idle core).
    cpu_seconds: float = 0.0


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def auto_workers(sessions: int, cores: int | None = None) -> int:
    """Workers for a log of `sessions`: every core, but none for fewer than
    `MIN_SESSIONS_PER_WORKER` sessions each (a small log runs in this process)."""
    cores = default_workers() if cores is None else cores
    return max(1, min(cores, sessions // MIN_SESSIONS_PER_WORKER))


def plan_ranges(session_ids: Iterable[str], parts: int) -> list[SessionRange]:
    """Cut the sorted ids into `parts` contiguous ranges of (nearly) equal counts.

    The first range is open below and the last open above, so every id,
    including one that appears after the plan (a live log), is in exactly one.
    """
    ids = sorted(set(session_ids))
    parts = max(1, min(parts, len(ids)))
    bounds: list[str | None] = [None]
    bounds += [ids[(k * len(ids)) // parts] for k in range(1, parts)]
    bounds.append(None)
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]
