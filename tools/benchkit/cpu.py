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
