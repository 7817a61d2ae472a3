"""How a log's sessions are split between workers (pure: no I/O, no clock).

Sessions are cut into contiguous id ranges of equal weight (each session's
number of events, `EventStore.session_sizes`): a worker is handed two ids, not
a list, and the store filters its pages by them (`EventStore.read_all(sessions=...)`).
Equal numbers of sessions are not equal work: the rollout driver names a
session after its task (`ro-<instance id>-g<group>-s<sample>-...`), so sorted
ids put a repository's tasks, and a GRPO group's samples, side by side, and a
range of long tasks kept one worker busy long after the others were done. Ids compare as code points, as Python
compares str and as both stores are told to (SQLite's BINARY collation,
PostgreSQL's "C").
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Iterable, Mapping

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


def plan_ranges(
    session_ids: Iterable[str], parts: int, sizes: Mapping[str, int] | None = None
) -> list[SessionRange]:
    """Cut the sorted ids into `parts` contiguous ranges of (nearly) equal weight:
    each session weighs its `sizes` entry (at least 1; absent: 1), or, without
    `sizes`, the ranges hold equal numbers of sessions.

    The first range is open below and the last open above, so every id,
    including one that appears after the plan (a live log), is in exactly one.
    Every range holds at least one of the ids.
    """
    ids = sorted(set(session_ids))
    parts = max(1, min(parts, len(ids)))
    if sizes is None:
        cuts = [(k * len(ids)) // parts for k in range(1, parts)]
    else:
        cuts = _weighted_cuts([max(1, sizes.get(i, 1)) for i in ids], parts)
    bounds: list[str | None] = [None, *(ids[i] for i in cuts), None]
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]


def _weighted_cuts(weights: list[int], parts: int) -> list[int]:
    """Index of the first id of ranges 1..parts-1: where the running weight is
    nearest k/parts of the total, each range keeping at least one id."""
    prefix = list(itertools.accumulate(weights, initial=0))  # prefix[i]: weight of ids[:i]
    total = prefix[-1]
    cuts: list[int] = []
    lowest = 1
    for k in range(1, parts):
        target = k * total / parts
        i = bisect.bisect_left(prefix, target)
        if i > 0 and target - prefix[i - 1] < prefix[i] - target:
            i -= 1
        i = min(max(i, lowest), len(weights) - (parts - k))
        cuts.append(i)
        lowest = i + 1
    return cuts
