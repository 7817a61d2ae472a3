"""Several engines: which one a session uses, which ones are down, where a turn moves.

Each session is pinned to one engine by rendezvous hashing (its prefix cache
lives there; adding an engine moves only the sessions that now prefer it).
An engine is marked down by a failing health check or a refused connection
and skipped until a check passes again; a turn whose engine is gone moves to
a live one, each engine at most once per turn. `EngineClient` is this pool
plus the HTTP calls (`recorder.model.engine`); the checks it runs are
`health(url)`.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import logging
from collections.abc import Collection, Sequence

from recorder.model.engine_wire import EngineError

log = logging.getLogger("recorder.model.engine")

# Seconds a GET /health may take before the engine counts as down. A frozen engine
# (SIGSTOP, a hung node) holds its turns about this long before they move; SGLang
# answers /health from its HTTP process, so a busy engine still answers well within it.
DEFAULT_HEALTH_TIMEOUT_S = 3.0


class EnginePool(abc.ABC):
    """The engines, the ones marked down, and the choices made from them (no HTTP of its own)."""

    def __init__(self, urls: Sequence[str], *, health_interval_s: float = 5.0) -> None:
        if not urls:
            raise ValueError("EngineClient needs at least one engine URL")
        self.urls: tuple[str, ...] = tuple(u.rstrip("/") for u in urls)
        # Engines that failed a health check or a connection; `pick` avoids them until a
        # check passes again. With one engine there is nowhere to move: no checks.
        self.down: set[str] = set()
        # Per engine watched by an attempt: done when it is marked down, so an
        # attempt in flight there stops waiting (a dead node may never reset the
        # connection). Done iff the engine is down; a future, not an Event, so
        # that the attempt watches it with a callback instead of a task.
        self._went_down: dict[str, asyncio.Future[None]] = {}
        self.health_interval_s = health_interval_s if len(self.urls) > 1 else 0.0

    @abc.abstractmethod
    async def health(self, url: str) -> bool:
        """Does the engine at `url` answer its health check? (`EngineClient` asks it.)"""

    async def _check_forever(self) -> None:
        """Until closed, or until `health_interval_s` is set to 0."""
        while self.health_interval_s > 0:
            await self.check_engines()
            await asyncio.sleep(self.health_interval_s)

    async def check_engines(self) -> None:
        """GET /health of every engine; mark each live or down."""
        results = await asyncio.gather(*(self.health(url) for url in self.urls))
        for url, ok in zip(self.urls, results, strict=True):
            self.mark(url, ok)

    def mark(self, url: str, live: bool) -> None:
        if live and url in self.down:
            log.warning("engine %s is back", url)
            self.down.discard(url)
            self._went_down.pop(url, None)
        elif not live and url not in self.down:
            log.warning("engine %s is down: its sessions move to live engines", url)
            self.down.add(url)
            waiter = self._went_down.get(url)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def live(self, url: str) -> bool:
        return url not in self.down

    def went_down(self, url: str) -> asyncio.Future[None]:
        """A future done once `url` is marked down (already done while it is down)."""
        waiter = self._went_down.get(url)
        if waiter is None:
            waiter = self._went_down[url] = asyncio.get_running_loop().create_future()
            if url in self.down:
                waiter.set_result(None)
        return waiter

    def pick(self, session_id: str) -> str:
        """Stable engine choice per session (rendezvous hashing: adding an
        engine moves only the sessions that now prefer it). Engines marked down are
        skipped while another is live."""
        live = [u for u in self.urls if u not in self.down] or self.urls
        return _rendezvous(session_id, live)

    async def gone(self, url: str, exc: EngineError) -> bool:
        """Does `exc` say the engine at `url` is gone, not merely slow or failing?

        A refused connection does (`_request` marked the engine down); a dropped one
        does when the engine's `/health` fails too (its process died). A timeout or
        an HTTP error does not: the engine is there, and another would not help.
        """
        if exc.kind != "unreachable":
            return False
        if not self.live(url):
            return True
        if await self.health(url):
            return False
        self.mark(url, False)
        return True

    async def replacement(
        self, session_id: str, url: str, exc: EngineError, tried: Collection[str]
    ) -> str | None:
        """The engine a turn moves to after its attempt on `url` failed with `exc`.

        None when the engine is not gone, or when every live engine was already
        tried by this turn (the bound: each engine at most once per turn).
        """
        left = [u for u in self.urls if u not in self.down and u not in tried and u != url]
        if not left or not await self.gone(url, exc):
            return None
        return _rendezvous(session_id, left)


def _rendezvous(session_id: str, urls: Sequence[str]) -> str:
    """The engine `session_id` prefers among `urls` (highest hash of the pair)."""
    return max(
        urls, key=lambda u: hashlib.blake2b(f"{session_id}\x00{u}".encode(), digest_size=8).digest()
    )
