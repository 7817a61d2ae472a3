"""Closes served by other replicas: learnt from the log, dropped from this one's cache.

Replicas on one Postgres each cache the sessions they served. A session
served here and closed on another replica (every admin close lands on one
replica under the README's sticky recipe) would otherwise stay cached here
as open, with its token chains, for as long as the process lives. Each
replica polls the log for `session_closed` events past the head it last saw
(one indexed range query) and drops those sessions; a request naming one
again rebuilds it from the log.
"""

from __future__ import annotations

import asyncio
import logging

from recorder.log.store.base import EventStore
from recorder.server.sessions import SessionRegistry

log = logging.getLogger("recorder.server")


class CloseWatch:
    """The log's head as last polled, and the closed sessions still in use here."""

    def __init__(self, store: EventStore, registry: SessionRegistry) -> None:
        self.store = store
        self.registry = registry
        self.after: int | None = None
        self.busy: list[str] = []

    async def poll(self) -> int:
        """One look at the log; how many sessions were dropped."""
        before = self.registry.closed_elsewhere
        if self.after is None:
            # Closes before this process started concern sessions it never held.
            self.after = await self.store.last_position()
            return 0
        self.after, closed = await self.store.closes_after(self.after)
        self.busy = self.registry.forget_closed([*self.busy, *closed])
        return self.registry.closed_elsewhere - before

    async def run(self, interval_s: float) -> None:
        """Poll every `interval_s` until cancelled; a failed poll is tried again later."""
        while True:
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("could not read the log for closes made elsewhere: %s", exc)
            await asyncio.sleep(interval_s)
