"""Appending one session's events in batches, with its sequence numbers.

Every append names the seq it expects (optimistic concurrency): the session
lock already serialises writers inside this process, so a conflict means
someone else wrote to the stream and the in-memory state can no longer be
trusted. Events of one pipeline step are buffered and appended together; the
store's group commit then makes durability cheap across sessions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, TypeVar

from recorder.events import AnyEvent, NewEvent

if TYPE_CHECKING:
    from recorder.store.base import EventStore

T = TypeVar("T")


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


class Journal:
    """A buffer of events for one session plus the seq the next one gets."""

    def __init__(self, store: EventStore, session_id: str, next_seq: int) -> None:
        self._store = store
        self.session_id = session_id
        self.next_seq = next_seq
        self._pending: list[NewEvent] = []

    @property
    def pending(self) -> Sequence[NewEvent]:
        return self._pending

    def add(self, *events: AnyEvent) -> None:
        now = time.time()
        self._pending.extend(NewEvent(event=e, ts=now) for e in events)

    def discard(self) -> None:
        self._pending.clear()

    async def flush(self) -> None:
        """Append the buffered events as one batch; return once they are durable."""
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        append = self._store.append(self.session_id, batch, expected_seq=self.next_seq)
        try:
            await finish_even_if_cancelled(self._advance_after(append, len(batch)))
        except asyncio.CancelledError:
            raise
        except BaseException:
            # Nothing was written (appends are atomic): the caller decides.
            self._pending = batch + self._pending
            raise

    async def _advance_after(self, append: Awaitable[list[int]], n: int) -> None:
        await append
        self.next_seq += n

    async def write(self, *events: AnyEvent) -> None:
        self.add(*events)
        await self.flush()
