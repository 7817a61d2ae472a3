"""Numbers from samples: medians and percentiles in ms, interleaved repeats, time intervals.

Pure functions, no I/O. Times go in as seconds (`time.perf_counter()`
differences) and come out in milliseconds where the name says `_ms`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile of seconds, in ms (NaN when there are none)."""
    return float(np.percentile(np.asarray(values) * 1000, q)) if len(values) else float("nan")


def rank_ms(values: Sequence[float], q: float) -> float:
    """The sample at rank floor(q * (n - 1)) of seconds, in ms: a quantile that is
    always a measured value (no interpolation)."""
    ms = sorted(v * 1000 for v in values)
    return ms[int(q * (len(ms) - 1))]


def median(values: Sequence[float]) -> float:
    """The median, NaN for no values (a column that was not measured)."""
    return statistics.median(values) if values else float("nan")


def fmean_ms(values: Iterable[float]) -> float:
    return statistics.fmean(values) * 1000


def median_ms(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median wall time of each function, interleaved so machine load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm caches the same way for every side
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs (NaN under two points)."""
    if len(xs) < 2:
        return float("nan")
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


@dataclass(frozen=True)
class Span:
    """A timed interval of perf_counter seconds (system-wide monotonic, comparable
    across processes); `cpu_s` is the work inside it that counts (e.g. engine time)."""

    start: float
    end: float
    cpu_s: float = 0.0


def inside(spans: Iterable[Span], start: float, end: float) -> list[Span]:
    """The spans wholly inside [start, end]."""
    return [s for s in spans if s.start >= start and s.end <= end]


def engine_seconds(spans: Sequence[Span], start: float, end: float, what: str) -> float:
    """The engine time of one turn: the `cpu_s` of the engine spans inside its wall interval."""
    found = inside(spans, start, end)
    if not found:
        raise RuntimeError(
            f"no engine /generate span inside {what}: the engine's timing did not reach the bench"
        )
    return sum(s.cpu_s for s in found)


def overlap(a0: float, a1: float, spans: Iterable[Span]) -> list[tuple[float, float]]:
    """The parts of `spans` that fall inside [a0, a1]."""
    return [(max(a0, s.start), min(a1, s.end)) for s in spans if s.end > a0 and s.start < a1]


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def ints(text: str) -> list[int]:
    """`"1000,10000"` -> [1000, 10000]: the benchmarks' comma-separated options."""
    return [int(x) for x in text.split(",") if x.strip()]
