"""Live sessions: their per-session lock and the state a turn needs.

The log is the truth; a `SessionState` is a cache of it. It is built when a
session opens, or rebuilt from the log the first time a request names a
session this process does not hold (after a restart, or after a failure made
the cached state suspect). One lock per session serialises its turns (a
retried or raced request must not interleave two turns); sessions are
otherwise independent.

Other processes (replicas on one Postgres) may write the same session, so
`acquire` also takes the session's lock in the database (`SessionLocks`)
and then catches the cached state up with the events it has not seen
(`CatchUp`, restore.catch_up): one index read when nothing changed. A
server that is its log's only writer (`ServerConfig.sole_writer`: SQLite
under `serve`'s claim) skips that read: what it holds is the head.

If a database lock is lost (its connection dies and Postgres frees it while
a turn runs) or a process takes none, two processes can still plan from one
head; the log refuses the second claim (`ConcurrencyConflict`, see
journal.py) and `locked` does that unit of work again from the new head,
after taking the lock again, so the client never sees it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from recorder.dialects.parse_cache import ParseCache
from recorder.log.events import ArrayRef
from recorder.log.store.base import ConcurrencyConflict, SessionLocks
from recorder.server.deltas import BodyPrefixes
from recorder.server.journal import Journal, finish_even_if_cancelled
from recorder.server.overrides import SessionOverrides

log = logging.getLogger("recorder.server")

SessionStatus = Literal["open", "closed"]
T = TypeVar("T")

SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,199}$")

# Closed sessions kept in memory, most recently closed first. A training run
# opens and closes sessions for days; older closed ones are dropped and, if a
# request names one again, reloaded from the log (cheap: no tokens).
MAX_CLOSED_CACHED = 1024
# Times a unit of work whose claim lost to another process's append is done
# again before the request is answered with a retryable error. Each retry
# waits for the database lock first, so once the lock is back one suffices.
MAX_CONFLICT_RETRIES = 3


@dataclass
class TurnStop:
    """The stop signal of one in-flight turn: set by an aborting close (admin.py)."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""
    # Called once when the turn is stopped (the turn interrupts its engine call).
    callbacks: list[Callable[[], None]] = field(default_factory=list)

    def stop(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason = reason
            self.event.set()
            callbacks, self.callbacks = self.callbacks, []
            for callback in callbacks:
                callback()


class SessionContended(Exception):
    """Other processes appended to the session first, `MAX_CONFLICT_RETRIES` times over;
    nothing of the request was recorded, so a retry is safe."""


@dataclass
class SessionState:
    session_id: str
    journal: Journal
    status: SessionStatus = "open"
    metadata: dict[str, Any] = field(default_factory=dict)
    engine_url: str = ""
    attempt: int = 0
    opened_ts: float = 0.0
    next_turn: int = 0
    turns_completed: int = 0
    close_status: str = ""
    # Forced sampling and the turn cap from the session's config (overrides.py).
    overrides: SessionOverrides = field(default_factory=SessionOverrides)
    # Token chains (recorder.model.tokens.SessionChains) and, per chain id, the refs
    # of stored prefixes of its tokens (length -> ref), so the next input is
    # stored as a delta (see deltas.remember_refs).
    chains: Any = None
    chain_refs: dict[int, dict[int, ArrayRef]] = field(default_factory=dict)
    # Per (chain id, record kind): the items the last snapshot stored (a copy of
    # the chain's digests or boundaries), their ref and how many deltas deep it
    # is, so the next stores only new items (snapshot._record_ref).
    snapshot_records: dict[tuple[int, str], tuple[Any, ArrayRef, int]] = field(default_factory=dict)
    # What the next body's delta needs of the previous one (its last bytes, digests
    # of its prefixes) and its stored prefixes (see deltas.put_body).
    body_prefixes: BodyPrefixes = field(default_factory=BodyPrefixes)
    # The translated messages of earlier requests (parse_request(..., cache=)),
    # so a turn translates only its new messages; emptied when the session closes.
    parse_cache: ParseCache = field(default_factory=ParseCache)
    # Conversations of earlier /v1/responses answers (previous_response_id), as
    # resolved from the log (server/history.py), so a chain of ids is read once.
    response_conversations: dict[str, Any] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Set when an unexpected error left the cache possibly out of step with
    # the log: the registry rebuilds it before the next use.
    suspect: bool = False

    @property
    def next_seq(self) -> int:
        return self.journal.next_seq


def forget_tokens(state: SessionState) -> None:
    """A closed session keeps no tokens in memory."""
    state.chains = None
    state.chain_refs.clear()
    state.snapshot_records.clear()
    state.body_prefixes = BodyPrefixes()
    state.parse_cache.clear()


def held_bytes(state: SessionState) -> int:
    """The memory a session's state keeps alive, near enough to bound the registry by:
    its token chains (int32), its translated messages and what it keeps of its previous
    body, the bulk of it (tests/server/test_memory.py checks it against a census)."""
    prefixes = state.body_prefixes
    total = len(prefixes.window) + state.parse_cache.nbytes
    chains = getattr(state.chains, "chains", None) or {}
    return total + sum(c.tokens.itemsize * len(c.tokens) for c in chains.values())


Loader = Callable[[str], Awaitable[SessionState | None]]
# The state at the log's head: the same object advanced, or a reloaded one.
CatchUp = Callable[[SessionState], Awaitable[SessionState]]


async def _at_head(state: SessionState) -> SessionState:
    return state


class SessionRegistry:
    """session id -> state, loading from the log on a miss (once, even when raced)."""

    def __init__(
        self,
        loader: Loader,
        *,
        max_closed: int = MAX_CLOSED_CACHED,
        catch_up: CatchUp = _at_head,
        locks: SessionLocks | None = None,
        outage: Callable[[BaseException], Exception | None] = lambda exc: None,
        sole_writer: bool = False,
        max_held_bytes: int | None = None,
    ) -> None:
        self._loader = loader
        self._outage = outage
        self._sole_writer = sole_writer
        self._catch_up = catch_up
        self._locks = locks or SessionLocks()
        self.max_closed = max_closed
        # Memory bound: once the states' `held_bytes` (as of the end of each one's
        # last unit of work) pass it, the least recently used idle ones are dropped,
        # open or closed, and rebuilt from the log if named again (`shed`).
        self.max_held_bytes = max_held_bytes
        self._held: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.held_total = 0
        self.shed = 0
        self._sessions: dict[str, SessionState] = {}
        self._loading: dict[str, asyncio.Future[SessionState | None]] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()  # oldest first
        # Time spent at the log's head check and catch-up, and how many found
        # events another process wrote (`/health` shows both: what routing
        # without stickiness costs a replica).
        self.catch_up_s = 0.0
        self.catch_ups = 0
        # Units of work done again because another process appended first (a
        # lost database lock, or a process that takes none; `/health`).
        self.conflicts_retried = 0
        # Sessions held as open that another process closed, dropped (`forget_closed`).
        self.closed_elsewhere = 0
        # Sessions rebuilt from the log (after a restart, or suspect) and the
        # time their loads took, summed (`/health`: what a restart costs).
        self.loads = 0
        self.load_s = 0.0
        # The stop signal of each session's in-flight turn (at most one: the lock).
        self._turns: dict[str, TurnStop] = {}
        # Rollout events that arrived while a turn held the session (`defer_events`).
        self._deferred: dict[str, list[Any]] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def cached(self, session_id: str) -> SessionState | None:
        return self._sessions.get(session_id)

    def open_count(self) -> int:
        return sum(1 for s in self._sessions.values() if s.status == "open")

    def put(self, state: SessionState) -> None:
        """Cache `state` (again after its status changed, so closed ones stay bounded)."""
        self._sessions[state.session_id] = state
        self._track(state)

    def _track(self, state: SessionState) -> None:
        """Keep at most `max_closed` closed sessions cached; never drop one in use."""
        session_id = state.session_id
        if state.status != "closed":
            self._closed.pop(session_id, None)
            return
        self._closed[session_id] = None
        self._closed.move_to_end(session_id)
        excess = len(self._closed) - self.max_closed
        for old in list(itertools.islice(self._closed, max(0, excess))):
            cached = self._sessions.get(old)
            if cached is not None and cached.lock.locked():
                continue  # in use: dropped by a later close
            del self._closed[old]
            if cached is not None and cached.status == "closed":
                del self._sessions[old]
                self.held_total -= self._held.pop(old, 0)

    def forget_closed(self, session_ids: Iterable[str]) -> list[str]:
        """Drop the sessions another process closed that this one holds as open.

        The log is the truth: a request naming one again rebuilds it from the
        log (closed, or reopened since). A session in use now (its lock held,
        or being loaded) is kept; its ids are returned, for the caller to pass
        again later.
        """
        busy: list[str] = []
        for session_id in dict.fromkeys(session_ids):
            state = self._sessions.get(session_id)
            if state is None or state.status == "closed":
                continue
            if state.lock.locked() or session_id in self._loading:
                busy.append(session_id)
                continue
            del self._sessions[session_id]
            self.held_total -= self._held.pop(session_id, 0)
            self.closed_elsewhere += 1
        return busy

    async def get(self, session_id: str) -> SessionState | None:
        """The session's state, from memory or rebuilt from the log; None if it never existed."""
        while True:
            state = self._sessions.get(session_id)
            if state is not None and not state.suspect:
                return state
            if not SESSION_ID_RE.match(session_id):
                return None
            pending = self._loading.get(session_id)
            if pending is None:
                return await self._load(session_id, state)
            try:
                return await asyncio.shield(pending)
            except asyncio.CancelledError:
                # The request that was loading went away (its client left);
                # this one was not cancelled, so it loads the session itself.
                task = asyncio.current_task()
                if not pending.cancelled() or (task is not None and task.cancelling()):
                    raise

    async def _load(self, session_id: str, state: SessionState | None) -> SessionState | None:
        """Load (or rebuild a suspect `state`) once; racing callers wait for this load."""
        future: asyncio.Future[SessionState | None] = asyncio.get_running_loop().create_future()
        self._loading[session_id] = future
        started = time.perf_counter()
        try:
            if state is not None:
                # Rebuild under the old state's lock (kept by the new state) so
                # no turn of this session runs while its log is re-read.
                async with state.lock:
                    loaded = await self._loader(session_id)
                    if loaded is not None:
                        loaded.lock = state.lock
            else:
                loaded = await self._loader(session_id)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            # Waiters get the same error: an outage as `StorageUnavailable`.
            failure = self._outage(exc) or exc
            future.set_exception(failure)
            future.exception()  # mark retrieved: waiters re-raise it themselves
            if failure is exc:
                raise
            raise failure from exc
        finally:
            self._loading.pop(session_id, None)
        self.loads += 1
        self.load_s += time.perf_counter() - started
        if loaded is not None:
            self.put(loaded)
        else:
            self._sessions.pop(session_id, None)
        future.set_result(loaded)
        return loaded

    async def acquire(self, session_id: str) -> SessionState | None:
        """The session's state at the log's head, locked; the caller calls `release`.

        Re-checks after the wait: a turn that failed meanwhile may have
        marked the state suspect and a rebuilt one replaced it. Then holds
        the session's lock in the database and catches up with what other
        processes appended, so the turn plans from the log's head.
        """
        while True:
            state = await self.get(session_id)
            if state is None:
                return None
            await state.lock.acquire()
            if not state.suspect and self._sessions.get(session_id) is state:
                break
            state.lock.release()
        try:
            await self._locks.lock(session_id)
        except BaseException as exc:
            state.lock.release()
            self._raise_outage(exc)
            raise
        if self._sole_writer:
            state.journal.begin()  # nothing else appends: what this process holds is the head
            return state
        try:
            return await self._to_head(state)
        except BaseException as exc:
            self.release(state)
            self._raise_outage(exc)
            raise

    # -- what must not wait behind a turn ---------------------------------------------------

    def turn_started(self, session_id: str) -> TurnStop:
        """The stop signal of the turn that now runs under the session's lock."""
        stop = self._turns[session_id] = TurnStop()
        return stop

    def turn_ended(self, session_id: str, stop: TurnStop) -> None:
        if self._turns.get(session_id) is stop:
            del self._turns[session_id]

    def stop_turn(self, session_id: str, reason: str) -> bool:
        """Stop the session's in-flight turn, if any (its engine request is aborted)."""
        stop = self._turns.get(session_id)
        if stop is None:
            return False
        stop.stop(reason)
        return True

    def defer_events(self, session_id: str, events: list[Any]) -> int:
        """Keep events for the session's next unit of work (a turn holds it now); how many
        wait. They are written when that turn ends, or with the next events or close."""
        waiting = self._deferred.setdefault(session_id, [])
        waiting.extend(events)
        return len(waiting)

    def take_deferred(self, session_id: str) -> list[Any]:
        """The deferred events, handed over (the caller writes them before its own)."""
        return self._deferred.pop(session_id, [])

    async def _write_deferred(self, state: SessionState) -> SessionState:
        """End of a unit of work: write what waited for it, from the log's head (a unit
        that lost its claim or failed left the state behind it); the state after. Best
        effort: a failure keeps them for the next events or close, which write them first."""
        events = self.take_deferred(state.session_id)
        if not events:
            return state
        try:
            for _ in range(MAX_CONFLICT_RETRIES + 1):
                if state.suspect or state.journal.rebased:
                    state = await self._retake(state)
                if state.status == "closed":
                    log.warning(
                        "session %s: %d rollout events arrived while it was being closed; dropped",
                        state.session_id,
                        len(events),
                    )
                    return state
                try:
                    await state.journal.write(*events)
                    return state
                except ConcurrencyConflict:
                    state = await self._retake(state)
        except Exception:
            pass
        log.warning("session %s: deferred rollout events not written yet", state.session_id)
        self._deferred[state.session_id] = events + self.take_deferred(state.session_id)
        return state

    async def locked(
        self, session_id: str, work: Callable[[SessionState], Awaitable[T]]
    ) -> T | None:
        """`work(state)` under the session's locks at the log's head; None for no such session.

        A `ConcurrencyConflict` escaping `work` means nothing of it was written
        (journal.py): another process appended first. The work is then done
        again from the new head (the database lock taken again, which waits
        for that process if it holds it) up to `MAX_CONFLICT_RETRIES` times;
        then `SessionContended` is raised.
        """
        state = await self.acquire(session_id)
        if state is None:
            return None
        retries = 0
        try:
            while True:
                try:
                    result = await work(state)
                    break
                except ConcurrencyConflict as exc:
                    if retries == MAX_CONFLICT_RETRIES:
                        raise SessionContended(str(exc)) from exc
                    retries += 1
                    self.conflicts_retried += 1
                    state = await self._retake(state)
            return result
        finally:
            # However the unit ended (a conflict, a failed turn): what waited for it is
            # written now, while the session is still held; another replica may close it next.
            if session_id in self._deferred:
                state = await finish_even_if_cancelled(self._write_deferred(state))
            self.release(state)

    async def _retake(self, state: SessionState) -> SessionState:
        """The state at the new head after a lost claim, with the database lock taken again.

        The lock this process thought it held may have gone with its
        connection; let go of it (a no-op then) and take it again.
        """
        await state.journal.settle()  # what the refused append left buffered
        self._locks.unlock(state.session_id)
        try:
            await self._locks.lock(state.session_id)
            return await self._to_head(state)
        except BaseException as exc:
            self._raise_outage(exc)
            raise

    async def _to_head(self, state: SessionState) -> SessionState:
        """Catch the locked `state` up with the log (a new unit of work starts there)."""
        started = time.perf_counter()
        seen = state.next_seq
        try:
            current = await self._catch_up(state)
        except BaseException:
            state.suspect = True  # half caught up: rebuilt before the next use
            raise
        self.catch_up_s += time.perf_counter() - started
        self.catch_ups += current is not state or current.next_seq != seen
        if current is not state:
            current.lock = state.lock
            self.put(current)
        current.journal.begin()
        return current

    def _raise_outage(self, exc: BaseException) -> None:
        """A database that cannot be reached while locking or catching up is an outage
        (529 and `/health` failing), the same as a write that cannot be stored."""
        if isinstance(exc, Exception) and (outage := self._outage(exc)) is not None:
            raise outage from exc

    def release(self, state: SessionState) -> None:
        """Let go of what `acquire` took (in the database first, then in this process)."""
        self._locks.unlock(state.session_id)
        state.lock.release()
        self._charge(state)

    def _charge(self, state: SessionState) -> None:
        """Account `state`'s memory as most recently used; drop idle ones over the bound."""
        session_id = state.session_id
        self.held_total -= self._held.pop(session_id, 0)
        if self._sessions.get(session_id) is state:
            self._held[session_id] = held_bytes(state)
            self.held_total += self._held[session_id]
        if self.max_held_bytes is None:
            return
        for old in list(self._held):
            if self.held_total <= self.max_held_bytes:
                break
            cached = self._sessions.get(old)
            if cached is not None and (cached.lock.locked() or old in self._loading):
                continue  # in use: charged again when it is released
            self.held_total -= self._held.pop(old)
            if cached is not None:
                del self._sessions[old]
                self._closed.pop(old, None)
                self.shed += 1
