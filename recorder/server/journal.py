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

Steps that record a turn while its engine works (the request body and
engine input, each attempt and its output) run as ordered background steps
(`then`), so their store round trips overlap the engine call instead of
preceding it; `flush` and `write` wait for every queued step, so the log
order never changes. The queued steps share one task (a task per step cost
loop iterations on every turn), and a step that only buffers runs at once
when nothing is queued (`now_or_then`).

Arrays are buffered like events: `add_array`, or `arrays.put_array` (what
`EventStore.put_array` takes, for code written against a store) encode them
now and write them with the next append, in its transaction. A turn's request
body, engine input, request events and first attempt thus cost one store
write, not three (each a thread hop and a commit). Nothing names an array
before the append that stores it, and state that must only point at stored
arrays is updated once they are (`after_append`).

While the journal is held (`hold`), `background` work and `unheld` wait until
`release`: a turn holds it until the engine has its request, so compressing
the request body never competes with sending 100k tokens to the engine.
Draining releases it, so nothing can wait for work that never starts.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

import msgspec

from recorder.log.events import AnyEvent, ArrayRef, NewEvent, SessionClosed, SessionOpened
from recorder.log.ids import uuid7
from recorder.log.store.arrays import EncodedArray, encode_array
from recorder.log.store.base import ConcurrencyConflict

if TYPE_CHECKING:
    import numpy as np

    from recorder.log.store.base import EventStore

Step = Callable[[], Awaitable[None]]

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

    The work runs as its own task, which wakes the caller itself when it ends:
    the caller waits on a plain future that a cancel may cut (then it waits
    on a new one), never on the task. `asyncio.shield` would cost a loop
    iteration more per call (its inner and outer futures' callbacks).
    """
    loop = asyncio.get_running_loop()
    outcome: list[tuple[T | None, BaseException | None]] = []
    wake = [loop.create_future()]

    async def run() -> None:
        try:
            outcome.append((await awaitable, None))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # handed to the caller, below
            outcome.append((None, exc))
        if not wake[0].done():
            wake[0].set_result(None)

    task = loop.create_task(run())
    cancelled = False
    while not outcome:
        try:
            await wake[0]
        except asyncio.CancelledError:
            if task.done() and not outcome:
                raise  # the work itself ended without an outcome: nothing to wait for
            cancelled = True
            wake[0] = loop.create_future()
    result, error = outcome[0]
    if error is not None:
        raise error
    if cancelled:
        raise asyncio.CancelledError
    return cast(T, result)


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
        # Called once the buffer they were registered with is appended.
        self._after_append: list[Callable[[], None]] = []
        # Queued steps, the task that runs them (None when idle), and the failure
        # of one (it drops every later step) until `drain` reports it.
        self._steps: deque[Step] = deque()
        self._runner: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
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

    def buffers_piece(self, digest: bytes) -> bool:
        """Whether a piece with this digest goes with the next append (this batch)."""
        return any(p.digest == digest for a in self._arrays for p in a.pieces)

    def add_encoded(self, encoded: EncodedArray) -> None:
        """Buffer an array encoded already (as `add_array` does once it has encoded one)."""
        self._arrays.append(encoded)

    @property
    def arrays(self) -> BufferedArrays:
        """`put_array` whose pieces go with the next append (see the module doc)."""
        return BufferedArrays(self)

    def after_append(self, callback: Callable[[], None]) -> None:
        """Call `callback` once what is buffered now is appended (never if it is dropped)."""
        self._after_append.append(callback)

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

    async def unheld(self) -> None:
        """Return once the journal is not held (at once if it is not)."""
        gate = self._gate
        if gate is not None:
            await gate.wait()

    def then(self, step: Step) -> None:
        """Run `step` in the background after every step queued before it.

        A failing step fails every later one; `drain` re-raises the failure.
        """
        if self._failure is not None:
            return  # failed with the step before it (drain reports that one)
        self._steps.append(step)
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run_steps())

    def now_or_then(self, work: Callable[[], None]) -> None:
        """`work` (which only buffers) now if no step is queued, else as the next step.

        The engine's answer usually comes back long after the request's steps
        ran: buffering it then needs no task.
        """
        if self._runner is None and self._failure is None:
            work()
            return

        async def step() -> None:
            work()

        self.then(step)

    async def _run_steps(self) -> None:
        """Run queued steps until none is left; a failure is kept for `drain`."""
        try:
            while self._steps:
                await self._steps.popleft()()
        except BaseException as exc:  # reported by drain, or dropped by settle
            self._steps.clear()
            self._failure = exc
        finally:
            self._runner = None

    @property
    def busy(self) -> bool:
        """Are steps queued or running (or a failure not yet reported)?"""
        return self._runner is not None or self._failure is not None

    async def drain(self) -> None:
        """Wait for the queued steps (not cancelled with the caller); re-raise a failure."""
        self.release()
        while self._runner is not None:
            await asyncio.shield(self._runner)
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    async def settle(self) -> None:
        """End of a turn: let queued steps finish (ignoring their errors), drop the buffer."""
        self.release()
        while self._runner is not None:
            await asyncio.wait([self._runner])
        self.drop()

    def drop(self) -> None:
        """End of a turn with no step queued (see `busy`): drop the buffer, at once."""
        self._failure = None  # retrieved: the turn already reported it
        self._steps.clear()
        self._pending.clear()
        self._arrays.clear()
        self._after_append.clear()

    async def flush(self) -> None:
        """After the queued steps, append the buffer as one batch; return once durable."""
        await self.drain()
        await self.flush_buffer()

    async def flush_buffer(self, *, durable: bool = True) -> None:
        """Append the buffer now (from inside a step: `flush` would wait for that step),
        not cut in half by a cancel of the caller.

        `durable=False`: see `EventStore.append` (nothing may be acknowledged on
        these events before a later durable append).
        """
        if self._pending:
            await finish_even_if_cancelled(self.append_buffer(durable=durable))

    async def append_buffer(self, *, durable: bool = True) -> None:
        """`flush_buffer` for callers a cancel cannot reach: a step (its task is the
        journal's), or one already inside `finish_even_if_cancelled`."""
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        arrays, self._arrays = self._arrays, []
        callbacks, self._after_append = self._after_append, []
        try:
            await self._append(batch, arrays, durable)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                # No event was written (appends are atomic): the caller decides.
                self._pending = batch + self._pending
                self._arrays = arrays + self._arrays
                self._after_append = callbacks + self._after_append
            raise
        for callback in callbacks:
            callback()

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


class BufferedArrays:
    """`EventStore.put_array` and `release` for a journal: `put_array` encodes now
    and the pieces go with the journal's next append (`put_array(into=)`; see
    the module doc).

    Lets code written against a store (`recorder.server.deltas`) store a turn's
    arrays without a commit of their own.
    """

    def __init__(self, journal: Journal) -> None:
        self._journal = journal

    async def put_array(
        self,
        array: np.ndarray,
        *,
        extends: ArrayRef | None = None,
        basis: ArrayRef | None = None,
        basis_offset: int | None = None,
        cache: bool = True,
        along: Sequence[EncodedArray] = (),
        prior: np.ndarray | bytes | None = None,
    ) -> ArrayRef:
        encoded: list[EncodedArray] = []
        ref = await self._journal._store.put_array(
            array,
            extends=extends,
            basis=basis,
            basis_offset=basis_offset,
            cache=cache,
            along=along,
            into=encoded,
            prior=prior,
        )
        self._journal._arrays.extend(encoded)
        return ref

    def release(self, old: ArrayRef, keep: Sequence[ArrayRef]) -> None:
        self._journal._store.release(old, keep)
