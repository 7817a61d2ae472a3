"""Resident memory of this process or a child: current, peak (VmHWM), anonymous.

Read from /proc (Linux), as the numbers the benchmarks print are Linux's own.
"""

from __future__ import annotations

import psutil

MB = 1024 * 1024


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A `/proc/PID/status` memory field (`VmRSS`, `VmHWM`, `RssAnon`) in bytes.

    VmHWM is the process's own peak since its exec; RUSAGE_SELF is not, as
    Linux carries ru_maxrss across fork + exec.
    """
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


class ProcessMemory:
    """RSS of another process (a server under test), sampled while it runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def rss(self) -> int:
        return int(psutil.Process(self.pid).memory_info().rss)

    def anon(self) -> int:
        """Anonymous resident memory (RSS without mapped files such as SQLite's WAL index)."""
        try:
            return status_bytes("RssAnon", self.pid)
        except RuntimeError:
            return self.rss()
