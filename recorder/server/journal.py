"""Appending one session's events in batches, with its sequence numbers.

Every append names the seq it expects (optimistic concurrency): the session
locks serialise writers (in this process and, on Postgres, across replicas),
so a conflict means another process wrote to the stream anyway (its database
lock was lost with its connection, or it takes none). What happens then
depends on whether the unit of work under the lock (a turn, a close, a
rollout event; `begin`) has appended yet:

- Its first append claims the head it planned from. A conflict there raises
  `ConcurrencyConflict` and nothing of the unit is in the log, so the caller
  catches up and does the whole unit again (`SessionRegistry.locked`).
- A later append (a turn whose engine already answered) follows the other
  process's events: its events carry their own turn number and request id,
  which the head claimed, so the reducer and a restore group them right
  whatever lies between. The state is then `rebased` (its chains miss the
  other turns): the caller rebuilds it from the log. If the other process
  closed or reopened the session, the rest would land in an attempt that is
  over (the close's samples are already out): `SessionMovedOn` is raised and
  the half-written turn stays unanswered, as after a crash.

Events of one pipeline step are buffered and appended together; the
store's group commit then makes durability cheap across sessions.

Steps that need stored arrays first (a turn's request body and engine input,
each attempt's output) run as ordered background steps (`then`), so their
store round trips overlap the engine call instead of preceding it; `flush`
and `write` wait for every queued step, so the log order never changes.

While the journal is held (`hold`), `background` work waits until `release`:
a turn holds it until the engine has its request, so compressing and
storing the request body never competes with sending 100k tokens to the
engine. Draining releases it, so nothing can wait for work that never starts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import msgspec

from recorder.log.events import AnyEvent, ArrayRef, NewEvent, SessionClosed, SessionOpened
from recorder.log.ids import uuid7
from recorder.log.store.arrays import EncodedArray, encode_array
from recorder.log.store.base import ConcurrencyConflict

if TYPE_CHECKING:
    import numpy as np

    from recorder.log.store.base import EventStore

T = TypeVar("T")

# How many times the rest of a claimed unit follows other processes' appends
# before giving up (each time one of them wrote between two of its appends).
MAX_FOLLOWS = 8


class SessionMovedOn(Exception):
    """The rest of a half-appended unit of work cannot be appended: another process
    closed or reopened the session meanwhile (or kept writing). What was appended
    stays in the log (a turn without its answer counts as unanswered)."""


async def finish_even_if_cancelled(awaitable: Awaitable[T]) -> T:
    """Await to completion; a cancel arriving meanwhile is re-raised afterwards.

    Used for writes that must not be cut in half: an append handed to the
    store either lands (and the seq advances) or fails, never "unknown".
    """
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                if task.cancelled():
                    raise
                result = task.result()
                break
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


def _nothing() -> None:
    return None


class Journal:
    """A buffer of events for one session, the seq the next one gets, and queued steps."""

    def __init__(self, store: EventStore, session_id: str, next_seq: int) -> None:
        self._store = store
        self.session_id = session_id
        self.next_seq = next_seq
        self._pending: list[NewEvent] = []
        self._arrays: list[EncodedArray] = []
        self._tail: asyncio.Task[None] | None = None
        self._gate: asyncio.Event | None = None
        self.begin()

    def begin(self) -> None:
        """A new unit of work at the head its caller just caught up with (see module doc)."""
        # Has the unit appended yet (its head is claimed)?
        self.claimed = False
        # Did a later append follow another process's events?
        self.rebased = False
        # The conflict that lost the claim, once it happened (`on_lost` callbacks run).
        self.lost: ConcurrencyConflict | None = None
        self._on_lost: list[Callable[[], None]] = []

    def on_lost(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` once the unit's claiming append loses to another process's
        (at once if it has); returns what removes it.

        A callback, not an awaitable: the turn watches for this during every
        engine call, and a waiting task per turn costs loop iterations.
        """
        if self.lost is not None:
            callback()
            return _nothing
        self._on_lost.append(callback)
        return lambda: self._on_lost.remove(callback) if callback in self._on_lost else None

    @property
    def pending(self) -> Sequence[NewEvent]:
        return self._pending

    def add(self, *events: AnyEvent) -> None:
        """Buffer events (call with no step queued, or from inside a step)."""
        now = time.time()
        self._pending.extend(NewEvent(event=e, ts=now, event_id=uuid7()) for e in events)

    def add_array(
        self, array: np.ndarray, *, extends: ArrayRef | None = None, cache: bool = True
    ) -> ArrayRef:
        """Buffer an array (with `extends`: its suffix after that stored array) to be
        written in the same transaction as the buffered events.

        Saves a commit per array on the turn's critical path (the engine's
        output ids and logprobs), and no array is ever stored without the
        event that names it. `cache=False`: kept out of the store's piece cache.
        """
        encoded = encode_array(array, extends=extends)
        if not cache:
            encoded = msgspec.structs.replace(encoded, cache=False)
        self._arrays.append(encoded)
        return encoded.ref

    def hold(self) -> None:
        """Make `background` work started from now on wait for `release`."""
        if self._gate is None:
            self._gate = asyncio.Event()

    def release(self) -> None:
        """Let held background work start (idempotent)."""
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.set()

    def background(self, work: Callable[[], Awaitable[T]]) -> asyncio.Future[T]:
        """Run `work` as a task, once the journal is not held."""
        gate = self._gate

        async def run() -> T:
            if gate is not None:
                await gate.wait()
            return await work()

        return asyncio.ensure_future(run())

    def then(self, step: Callable[[], Awaitable[None]]) -> None:
        """Run `step` in the background after every step queued before it.

        A failing step fails every later one; `drain` re-raises the failure.
        """
        previous = self._tail

        async def run() -> None:
            if previous is not None:
                await previous
            await step()

        self._tail = asyncio.get_running_loop().create_task(run())

    async def drain(self) -> None:
        """Wait for the queued steps (not cancelled with the caller); re-raise a failure."""
        self.release()
        tail = self._tail
        if tail is None:
            return
        try:
            await asyncio.shield(tail)
        finally:
            if tail.done() and self._tail is tail:
                self._tail = None

    async def settle(self) -> None:
        """End of a turn: let queued steps finish (ignoring their errors), drop the buffer."""
        self.release()
        tail, self._tail = self._tail, None
        if tail is not None:
            await asyncio.wait([tail])
            if not tail.cancelled():
                tail.exception()  # retrieved: the turn already reported it
        self._pending.clear()
        self._arrays.clear()

    async def flush(self) -> None:
        """After the queued steps, append the buffer as one batch; return once durable."""
        await self.drain()
        await self.flush_buffer()

    async def flush_buffer(self, *, durable: bool = True) -> None:
        """Append the buffer now (from inside a step: `flush` would wait for that step).

        `durable=False`: see `EventStore.append` (nothing may be acknowledged on
        these events before a later durable append).
        """
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        arrays, self._arrays = self._arrays, []
        try:
            await finish_even_if_cancelled(self._append(batch, arrays, durable))
        except asyncio.CancelledError:
            raise
        except BaseException:
            # No event was written (appends are atomic): the caller decides.
            self._pending = batch + self._pending
            self._arrays = arrays + self._arrays
            raise

    async def _append(
        self, batch: list[NewEvent], arrays: list[EncodedArray], durable: bool
    ) -> None:
        """Append at the expected seq; a claimed unit follows other processes' appends."""
        # Named only when False: stores that flush every append need not know it.
        flush: dict[str, bool] = {} if durable else {"durable": False}
        for _ in range(MAX_FOLLOWS):
            try:
                await self._store.append(
                    self.session_id, batch, expected_seq=self.next_seq, arrays=arrays, **flush
                )
            except ConcurrencyConflict as exc:
                if not self.claimed:
                    self.lost = exc
                    callbacks, self._on_lost = self._on_lost, []
                    for callback in callbacks:
                        callback()
                    raise
                await self._follow(exc)
                continue
            self.next_seq += len(batch)
            self.claimed = True
            return
        raise SessionMovedOn(
            f"other processes kept writing session {self.session_id!r} while this request's "
            "events were being appended"
        )

    async def _follow(self, conflict: ConcurrencyConflict) -> None:
        """Move the expected seq past the events another process appended meanwhile."""
        events = await self._store.read_session(self.session_id, from_seq=self.next_seq)
        for r in events:
            if isinstance(r.event, SessionClosed | SessionOpened):
                done = "closed" if isinstance(r.event, SessionClosed) else "reopened"
                raise SessionMovedOn(
                    f"session {self.session_id!r} was {done} by another process while this "
                    "request ran"
                ) from conflict
        if events:
            self.next_seq = events[-1].seq + 1
            self.rebased = True

    async def write(self, *events: AnyEvent) -> None:
        """After the queued steps, append `events` (and anything buffered) durably."""
        await self.drain()
        self.add(*events)
        await self.flush()
