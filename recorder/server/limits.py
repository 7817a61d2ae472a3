"""Process limits for `recorder serve`: open files, the log of running out of them, and
big allocations handed back to the kernel when freed.

Big request bodies pass through a few transient copies (the body, its
decoded text, the template's render). glibc serves an allocation of 128 kB
or more with its own mmap, and returns it to the kernel when freed, but
after the first such free it raises that threshold to the freed size (up to
32 MB), so later copies come from the heap, whose freed middle stays
resident: an 8 MB tool description then peaked at 7x the body instead of 4x
(tools/bench_big_body.py). A fixed threshold keeps every big buffer mmapped.

A recorder holds one socket per agent connection (plus engine and store
connections), and a training run opens many at once. The soft
`RLIMIT_NOFILE` of a shell is often 1024 while the hard limit is far higher;
at the soft limit asyncio's accept loop logs `socket.accept() out of system
resource` with a full traceback every time it retries, which fills the disk
while the server cannot take new connections anyway.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("recorder.server")

ACCEPT_EXHAUSTED = "socket.accept() out of system resource"

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
BIG_ALLOCATION_BYTES = 1 << 20


def hand_back_big_allocations(threshold: int = BIG_ALLOCATION_BYTES) -> bool:
    """Make glibc mmap every allocation of `threshold` bytes or more (and unmap it when
    freed), with no dynamic raise of that threshold; False where there is no glibc.

    Buffers of a megabyte and more are request bodies, their texts and renders,
    never the many small objects of the hot path, so the extra mmap per big
    buffer costs nothing measurable while freed copies stop counting in RSS.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit: (soft before, soft after).

    Only the soft limit moves (no privilege needed); if the kernel refuses, the
    limit stays as it was and the server runs with it.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open-files limit from %d to %d: %s", soft, hard, exc)
        return soft, soft
    return soft, hard


class AcceptErrorThrottle:
    """A loop exception handler that reports accept() running out of files at most once
    per `interval_s`, without a traceback, with the count of the reports it held back;
    every other context goes to the loop's default handler unchanged."""

    def __init__(
        self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.held_back = 0
        self._last: float | None = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_EXHAUSTED:
            loop.default_exception_handler(context)
            return
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            self.held_back += 1
            return
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        log.error(
            "cannot accept new connections: %s (open-files limit %d; %d more such errors in "
            "the last %.0fs not logged). Raise the hard limit (ulimit -Hn, LimitNOFILE=) or "
            "spread agents over more replicas.",
            context.get("exception"),
            soft,
            self.held_back,
            self.interval_s,
        )
        self._last = now
        self.held_back = 0


def install_accept_throttle(loop: asyncio.AbstractEventLoop) -> AcceptErrorThrottle:
    """Route the loop's exception reports through an `AcceptErrorThrottle`."""
    throttle = AcceptErrorThrottle()
    loop.set_exception_handler(throttle)
    return throttle
