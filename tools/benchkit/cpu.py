"""CPU time of a process from `/proc` counters: every thread, nanosecond resolution.

`/proc/PID/stat`'s utime + stime tick at 10 ms, far coarser than one turn's
CPU (a few ms), so a turn is measured with the scheduler's own counter, the
first field of `/proc/PID/task/TID/schedstat` (nanoseconds on a CPU), summed
over the process's threads. A thread that exits takes its count with it;
the server's threads (event loop, store writer, thread pool) live as long as
it does, and `stat` ticks over a whole run are printed beside as a check.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path


def cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of all of `pid`'s live threads."""
    total = 0
    for task in os.scandir(f"/proc/{pid}/task"):
        try:
            total += int(Path(task.path, "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended between the listing and the read
    return total


def cpu_ticks_s(pid: int) -> float:
    """utime + stime of `pid` (all threads, ended ones too) in seconds, from `/proc/PID/stat`."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_average() -> str:
    """`/proc/loadavg`'s three averages, as the table titles print them."""
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return f"load average {one} {five} {fifteen} ({os.cpu_count()} cores)"


# Iterations of `_probe_work`: 55-110 ms a round on this 2-core box.
PROBE_LOOPS = 2_000_000


def _probe_work(n: int) -> int:
    """A fixed interpreter-bound loop (small-int arithmetic, no allocation that
    grows, no I/O, no C library): the host's speed at running Python bytecode."""
    total = 0
    for i in range(n):
        total += i
    return total


def speed_probe_ms(rounds: int = 5) -> float:
    """This process's CPU ms for a fixed pure-Python workload, median of `rounds`:
    how fast the host runs our interpreter right now (lower is faster).

    The load average does not show it: this machine is a guest whose cores
    ran it in 96-108 ms in one hour and 54-58 ms in another, with the load
    average below 1.5 in both (a 2-worker `replay reclassify` of the same
    log took ~7.5 s and ~4.8 s). A table that prints the probe next to
    its figures says which kind of hour they were measured in, so runs at
    different times can be compared (same-run columns need no such help).
    """
    times = []
    for _ in range(rounds):
        t0 = time.process_time()
        _probe_work(PROBE_LOOPS)
        times.append(time.process_time() - t0)
    return statistics.median(times) * 1e3


def probe_span(before_ms: float) -> str:
    """The probe read before a run (`before_ms`) and now, as a table's footer says it."""
    return (
        f"speed probe {before_ms:.0f} ms before, {speed_probe_ms():.0f} ms after "
        "(tools/benchkit/cpu.py, lower is faster)"
    )


def machine_state() -> str:
    """The load average and the speed probe, as the benchmarks' titles print them."""
    return f"{load_average()}; speed probe {speed_probe_ms():.0f} ms"
