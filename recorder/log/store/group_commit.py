"""Group commit: one writer task turns many concurrent writes into one transaction.

Each `submit` enqueues a request and awaits its future; the writer takes
everything queued at that moment (up to a size cap), hands the group to the
store's `commit` callback, which runs one transaction and resolves every
future only after COMMIT returned, i.e. after the data is durable. Durability
cost (fsync / WAL flush) is paid once per group instead of once per caller.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)


class WriteRequest:
    """Base of requests the committer carries; `weight` bounds group size."""

    __slots__ = ("future", "weight")

    def __init__(self, weight: int) -> None:
        self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.weight = weight

    def resolve(self, result: Any) -> None:
        if not self.future.done():
            self.future.set_result(result)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


R = TypeVar("R", bound=WriteRequest)


class GroupCommitter(Generic[R]):
    # `max_weight` caps a group's total request weight; 1 disables grouping
    # (one transaction per request), which benchmarks use as the baseline.
    def __init__(self, commit: Callable[[list[R]], Awaitable[None]], *, max_weight: int) -> None:
        self._commit = commit
        self.max_weight = max_weight
        self._queue: asyncio.Queue[R | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    async def submit(self, request: R) -> Any:
        if self._closed:
            raise RuntimeError("the store is closed; open a new one to write")
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="recorder-store-group-commit"
            )
        self._queue.put_nowait(request)
        return await request.future

    async def close(self) -> None:
        """Commit everything already submitted, then stop the writer."""
        self._closed = True
        if self._task is not None:
            self._queue.put_nowait(None)
            await self._task
            self._task = None

    def _take_group(self, first: R) -> tuple[list[R], bool]:
        group, weight, stop = [first], first.weight, False
        while weight < self.max_weight and not self._queue.empty():
            item = self._queue.get_nowait()
            if item is None:
                stop = True
                break
            group.append(item)
            weight += item.weight
        return [r for r in group if not r.future.done()], stop

    async def _run(self) -> None:
        while True:
            first = await self._queue.get()
            if first is None:
                return
            group, stop = self._take_group(first)
            if group:
                try:
                    await self._commit(group)
                except BaseException as e:  # never leave a caller waiting forever
                    log.exception("group commit failed")
                    for r in group:
                        r.fail(e)
                    if not isinstance(e, Exception):
                        raise
            if stop:
                return
