"""Process limits for `recorder serve`: open files, and the log of running out of them.

A recorder holds one socket per agent connection (plus engine and store
connections), and a training run opens many at once. The soft
`RLIMIT_NOFILE` of a shell is often 1024 while the hard limit is far higher;
at the soft limit asyncio's accept loop logs `socket.accept() out of system
resource` with a full traceback every time it retries, which fills the disk
while the server cannot take new connections anyway.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("recorder.server")

ACCEPT_EXHAUSTED = "socket.accept() out of system resource"


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
