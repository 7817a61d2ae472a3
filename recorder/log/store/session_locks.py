"""Per-session locks shared by every process on one database (Postgres advisory locks).

Many `recorder serve` replicas may serve one session: a turn holds the
session's lock from before it reads the session's head until its last event
is durable, so two replicas never plan a turn from the same head (which the
log would refuse with a ConcurrencyConflict). Session-level advisory locks
live on one connection per process: a connection holds any number of them,
taking one never blocks (`pg_try_advisory_lock`, retried with backoff), and
Postgres frees them all if the process dies, so a killed replica's sessions
continue elsewhere at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import asyncpg

from recorder.log.store.base import SessionLocks

log = logging.getLogger("recorder.log.store")

# Class id of the two-key advisory lock space (disjoint from single-key locks
# such as the writers' lock); the second key is the session id's hash. Two
# sessions whose hashes collide only wait for each other.
SESSION_LOCK_CLASS = 0x7265
TRY_LOCK_SQL = "SELECT pg_try_advisory_lock($1::int, hashtext($2))"
UNLOCK_SQL = "SELECT pg_advisory_unlock($1::int, hashtext($2))"
FIRST_WAIT_S = 0.002
MAX_WAIT_S = 0.05


class AdvisorySessionLocks(SessionLocks):
    """Postgres session-level advisory locks on one dedicated connection."""

    def __init__(self, params: Callable[[], dict[str, Any]]) -> None:
        self._params = params
        self._conn: asyncpg.Connection | None = None
        self._busy = asyncio.Lock()  # one query at a time on the connection
        self._pending: set[asyncio.Task[None]] = set()

    async def lock(self, session_id: str) -> None:
        wait = FIRST_WAIT_S
        while True:
            attempt = asyncio.ensure_future(self._try(session_id))
            try:
                held = await asyncio.shield(attempt)
            except asyncio.CancelledError:
                # The query may still take the lock: let go of it if it does.
                attempt.add_done_callback(lambda t: self._unlock_if_taken(t, session_id))
                raise
            if held:
                return
            await asyncio.sleep(wait)
            wait = min(wait * 2, MAX_WAIT_S)

    def _unlock_if_taken(self, attempt: asyncio.Future[bool], session_id: str) -> None:
        if not attempt.cancelled() and attempt.exception() is None and attempt.result():
            self.unlock(session_id)

    def unlock(self, session_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._unlock(session_id))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def close(self) -> None:
        if self._pending:
            await asyncio.wait(list(self._pending))
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            await conn.close()

    async def _try(self, session_id: str) -> bool:
        """One `pg_try_advisory_lock`, on a fresh connection if the held one broke.

        A connection the server closed (a restart, `pg_terminate_backend`)
        may not look closed until used, and then fails in any of asyncpg's
        ways (a Postgres error, an interface error, an internal state error).
        Its locks are gone with it, so it is dropped and the query asked once
        more on a new connection; if that fails too, the error (a connect
        error: an outage) goes to the caller.
        """
        async with self._busy:
            reused = self._conn is not None and not self._conn.is_closed()
            conn = await self._connection()
            try:
                return bool(await conn.fetchval(TRY_LOCK_SQL, SESSION_LOCK_CLASS, session_id))
            except Exception as exc:
                self._drop(conn)
                if not reused:
                    raise
                log.warning("session lock connection broke (%s); reconnecting", type(exc).__name__)
            conn = await self._connection()
            return bool(await conn.fetchval(TRY_LOCK_SQL, SESSION_LOCK_CLASS, session_id))

    def _drop(self, conn: asyncpg.Connection) -> None:
        """Forget a broken connection; the server frees whatever locks it held."""
        if self._conn is conn:
            self._conn = None
        conn.terminate()

    async def _unlock(self, session_id: str) -> None:
        async with self._busy:
            conn = self._conn
            if conn is None or conn.is_closed():
                return  # the connection's locks went with it
            try:
                await conn.fetchval(UNLOCK_SQL, SESSION_LOCK_CLASS, session_id)
            except Exception as exc:
                log.warning("could not release session %s's lock: %s", session_id, exc)
                self._drop(conn)  # a broken connection: its locks are freed with it

    async def _connection(self) -> asyncpg.Connection:
        if self._conn is None or self._conn.is_closed():
            self._conn = await asyncpg.connect(**self._params())
        return self._conn
