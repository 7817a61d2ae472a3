"""SQLite backend (aiosqlite): WAL, one writer connection, BEGIN IMMEDIATE.

- WAL lets readers run beside the writer and see committed snapshots only.
- Writes start with BEGIN IMMEDIATE, taking the write lock up front: a
  deferred transaction that reads and then writes can fail with "database is
  locked" without waiting, whereas BEGIN IMMEDIATE waits on `busy_timeout`.
  Holding the lock from position allocation to COMMIT also means positions
  commit in order, so `read_all` paging by position never skips an event.
- synchronous=FULL: with WAL, NORMAL already survives kill -9 of the process
  (committed frames sit in the OS page cache), but loses the last commits on
  power loss or a kernel crash. We acknowledge an append as durable, so we
  fsync the WAL on every commit; group commit amortises that fsync over every
  append gathered into the transaction.
- A small WAL: SQLite checkpoints it every `wal_autocheckpoint` pages (1,000
  by default, ~4 MiB) and then reuses the file from its start, so a live log
  carried a ~4 MiB WAL on top of its data (more than the data itself for a
  few 100k sessions). Checkpointing every `WAL_CHECKPOINT_PAGES` (~1 MiB)
  keeps it at that; the checkpoints' extra page writes are a few per turn.
  `journal_size_limit` truncates the file back after a burst made it bigger
  (a bulk copy, a huge batch); set as low as the checkpoint size, it made
  SQLite truncate and regrow the file every cycle, which cost batched appends
  ~15% of their rate.
- A group that needs no flush (array pieces alone: a turn's request body
  and engine input; appends made with `durable=False`: its request events,
  recorded while the engine works) commits with synchronous=NORMAL: no fsync,
  ~0.3 ms of CPU less. It survives kill -9 at once (its WAL frames are in the
  OS page cache) and power loss with the next durable commit, whose fsync
  makes every earlier WAL frame durable too. Nothing is acknowledged on those
  writes before such a commit; every other append keeps its fsync.
- One thread hop per group: the plain group (no conflict, no re-sent id, no
  unknown array parent) is written by one synchronous function on a writer
  thread with its own sqlite3 connection (`OneHopWriter`). A small group that
  needs no flush (a turn's request and first attempt, written while its engine
  works) is written by that function on the event loop's thread instead: its
  commit costs ~0.1 ms of CPU without an fsync, less than the hop's two
  cross-CPU wake-ups (the writer's, then the loop's). It never waits there:
  a busy database or a WAL checkpoint (two fsyncs) is left to the writer
  thread (busy_timeout 0 and no autocheckpoint for that commit);
  `TR_SQLITE_INLINE_WRITES=0` turns that off. The writer thread is a plain
  thread fed by a queue (`WriterThread`), the cheapest hop there is. Through SQLAlchemy
  and aiosqlite the same transaction takes ~6 hops to aiosqlite's thread, and
  each is a GIL handoff that can wait out the 5 ms switch interval while the
  event loop is busy. Anything else rolls back and is redone by the generic
  path (`SqlEventStore._commit_generic`), where every edge case is handled.
- Projection rows (`save_projection`: `replay reclassify`'s samples and
  summaries, ~140 kB a session) go to the writer thread too, one transaction
  per batch on a sqlite3 connection of their own, not through SQLAlchemy and
  aiosqlite. A store opened read-only (the viewer's, `read_only=True`) has no
  such connection: every write of it goes through its engine, which refuses it.
- Reads of a one-pass reader (`StoreOptions.inline_reads`: `replay
  reclassify/export/stats` and their workers) run on the event loop's thread
  on a plain sqlite3 connection of their own (`InlineReader`), each call in
  one read transaction as through the engine. Such a reader has nothing else
  for the loop to do while it waits, and it makes thousands of reads (a page
  of events, a round of array pieces): through aiosqlite each costs a few
  thread hops and GIL handoffs, more than the query.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import queue
import sqlite3
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import IO, Any

import msgspec
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool

from recorder.log.store import arrays as arr
from recorder.log.store.base import SessionRange, StoreError
from recorder.log.store.pieces import IN_CHUNK, chunks
from recorder.log.store.sql import (
    READER_PAGE_CACHE_BYTES,
    WRITER_PAGE_CACHE_BYTES,
    SqlEventStore,
    StoreOptions,
)
from recorder.log.store.write_requests import (
    AppendRequest,
    EventRow,
    GroupRequest,
    NewRow,
    PlainGroup,
    needs_flush,
)

log = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 60_000
# WAL frames (pages) between automatic checkpoints, and the size the WAL file
# is truncated back to when a burst made it bigger (see the module docstring).
WAL_CHECKPOINT_PAGES = 256
WAL_SIZE_LIMIT_BYTES = 4 * 1024 * 1024
# Default page cache per connection, in KiB (SQLite's default is 2 MiB): the
# event_id index takes random inserts, and a warm cache keeps a write group's
# dirty pages few. Readers get less since there are several of them.
# `StoreOptions` sets other sizes per store.
WRITER_CACHE_KIB = WRITER_PAGE_CACHE_BYTES // 1024
READER_CACHE_KIB = READER_PAGE_CACHE_BYTES // 1024


def database_path(url: str) -> Path | None:
    """The file a sqlite URL points at (None for in-memory)."""
    db = sa.make_url(url).database
    return None if not db or db == ":memory:" else Path(db)


def create_private(path: Path) -> None:
    """Create an empty database file 0600 (it holds every prompt).

    SQLite gives the -wal and -shm files the mode of the database file, so they are
    owner-only too. An existing file keeps the mode its owner chose.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def claim_sole_server(url: str) -> IO[bytes] | None:
    """Refuse a second `recorder serve` on one SQLite file; hold the claim while open.

    A server's session states are caches of the log that only it writes;
    two servers on one file would each plan turns from a stale state (the
    log refuses the append, the client sees a 500). Postgres has per-session
    locks for replicas; SQLite gets one server per file, checked here. The
    OS drops the claim when the process ends, however it ends.
    """
    path = database_path(url)
    if path is None:
        return None
    claim = (path.parent / f"{path.name}.serve-lock").open("a+b")
    try:
        fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        claim.close()
        raise StoreError(
            f"another `recorder serve` already serves {path}: SQLite allows one server per "
            "file. Stop it first, or run several replicas on Postgres "
            "(--db postgresql+asyncpg://...)"
        ) from None
    return claim


def create_engine(url: str, *, writer: bool, cache_kib: int | None = None) -> AsyncEngine:
    """An engine whose transactions begin IMMEDIATE (writer) or DEFERRED (reader).

    `cache_kib`: page cache per connection (default: WRITER/READER_CACHE_KIB).
    """
    engine = create_async_engine(
        url,
        poolclass=AsyncAdaptedQueuePool,
        pool_size=1 if writer else 4,
        max_overflow=0 if writer else 8,
        connect_args={"timeout": BUSY_TIMEOUT_MS / 1000},
        # Every transaction is ended by its Connection (engine.begin() commits
        # or rolls back; Connection.close() rolls back an open one), so the
        # pool's extra ROLLBACK on check-in would only cost a thread hop.
        pool_reset_on_return=None if writer else "rollback",
    )
    begin = "BEGIN IMMEDIATE" if writer else "BEGIN"
    if cache_kib is None:
        cache_kib = WRITER_CACHE_KIB if writer else READER_CACHE_KIB

    @event.listens_for(engine.sync_engine, "connect")
    def _configure(dbapi_conn: Any, _record: Any) -> None:
        configure_connection(dbapi_conn, cache_kib)

    @event.listens_for(engine.sync_engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql(begin)

    return engine


def configure_connection(dbapi_conn: Any, cache_kib: int) -> None:
    """The settings every connection of ours runs with (see the module docstring)."""
    # Take transaction control from the driver so BEGIN is ours.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute(f"PRAGMA cache_size=-{cache_kib}")
    cur.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
    cur.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")
    cur.close()


# -- SQL both write paths share ---------------------------------------------------

INSERT_EVENTS_SQL = (
    "INSERT INTO events (position, session_id, seq, event_id, type, version, ts, payload)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
INSERT_PIECE_SQL = (
    "INSERT INTO arrays (digest, parent, dtype, total_length, codec, data, data_tail, basis,"
    " basis_depth) VALUES (:digest, :parent, :dtype, :total_length, :codec, :data, :data_tail,"
    " :basis, :basis_depth) ON CONFLICT (digest) DO NOTHING"
)

INSERT_PROJECTION_NAME_SQL = (
    "INSERT INTO projection_names (name) VALUES (?) ON CONFLICT (name) DO NOTHING"
)
UPSERT_PROJECTION_SQL = (
    "INSERT INTO projections (name, session_id, covers_position, digest, payload)"
    " VALUES (?, ?, ?, ?, ?) ON CONFLICT (name, session_id) DO UPDATE SET"
    " covers_position = excluded.covers_position, digest = excluded.digest,"
    " payload = excluded.payload"
)

EventTuple = tuple[int, str, int, bytes, str, int, float, bytes]


def event_tuple(session_id: str, seq: int, row: EventRow) -> EventTuple:
    """Parameters of `INSERT_EVENTS_SQL` for one row (its position assigned)."""
    return (
        row.position,
        session_id,
        seq,
        row.event_id.bytes,
        row.type,
        row.version,
        row.ts,
        row.payload,
    )


def run_tuples(runs: Iterable[tuple[str, int, Sequence[EventRow]]]) -> list[EventTuple]:
    """`event_tuple` of every row of each (session_id, first seq, rows) run.

    Inlined rather than a call per row: on a batched append this loop is a
    third of the Python work per event on the writer thread.
    """
    return [
        (r.position, sid, seq + k, r.event_id.bytes, r.type, r.version, r.ts, r.payload)
        for sid, seq, rows in runs
        for k, r in enumerate(rows)
    ]


def head_queries(session_ids: Iterable[str]) -> Iterator[tuple[str, list[str]]]:
    """(sql, params) reading each session's MAX(seq), chunked; the first also
    reads MAX(position) in a row whose session_id is NULL (a NOT NULL column).

    One MAX subquery per session: each is a single step down the (session_id,
    seq) index, where `WHERE session_id IN (...) GROUP BY` would scan every
    event of the session (~0.1 ms per 1,000 events, on every commit)."""
    ordered = sorted(session_ids)
    for i in range(0, max(len(ordered), 1), IN_CHUNK):
        chunk = ordered[i : i + IN_CHUNK]
        sql = (
            "SELECT column1, (SELECT MAX(seq) FROM events WHERE session_id = column1)"
            f" FROM (VALUES {','.join(['(?)'] * len(chunk))})"
            if chunk
            else "SELECT NULL, NULL WHERE 0"
        )
        if i == 0:
            sql += " UNION ALL SELECT NULL, MAX(position) FROM events"
        yield sql, chunk


def fold_heads(
    rows: Iterable[tuple[str | None, int | None]], next_seq: dict[str, int]
) -> int | None:
    """Record each session's next seq from `head_queries` rows; return the last
    position if these rows carry it (0 for an empty log), else None."""
    last_position = None
    for session_id, value in rows:
        if session_id is None:
            last_position = value or 0
        elif value is not None:
            next_seq[session_id] = value + 1
    return last_position


# A group that needs no flush and carries at most this many bytes (array
# pieces and event payloads) is written on the event loop's thread (see the
# module docstring): a turn's request and first attempt are ~1-10 KB.
INLINE_MAX_BYTES = 64 * 1024
# Inline commits leave checkpointing to the writer thread: after this many in a
# row the next group goes to the thread anyway, so a writer that only ever
# appends without a flush (a bulk load of pieces) still checkpoints its WAL.
INLINE_MAX_STREAK = 32

# `TR_SQLITE_INLINE_WRITES=0` in the environment sends every group to the writer
# thread (read once per store): a switch to measure what inline commits cost or
# save under a given load (`tools/bench_server.py --inline both`).
INLINE_ENV = "TR_SQLITE_INLINE_WRITES"


def inline_writes_enabled() -> bool:
    """Whether small unflushed groups commit on the loop's thread (`INLINE_ENV`)."""
    value = os.environ.get(INLINE_ENV, "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{INLINE_ENV}={value!r}: set it to 1 (inline commits, the default) or 0")


# Digests of pieces a one-hop writer has committed or found stored, remembered so
# that a group whose pieces extend them need not look them up (rows are never
# deleted). A turn names ~3 such parents and bases, all recent: ~150 kB.
KNOWN_DIGESTS = 1024

# -- the one-hop writer -------------------------------------------------------------


Job = tuple[Callable[..., None], tuple[Any, ...]]


class WriterThread(Executor):
    """One thread that runs jobs in order, taken from a `queue.SimpleQueue`.

    The writer's hop to its thread was a `ThreadPoolExecutor.submit`: a
    `concurrent.futures.Future` (a Condition, notified on completion) and a
    work item per group, an idle-semaphore round trip, and the pool's
    shutdown lock, all for a result nobody read (the job answers the loop
    itself). `post` is a queue put; `submit` stays for `run_in_executor`.
    A daemon thread: a group still queued when the interpreter exits without
    `close` was never acknowledged, and SQLite rolls back an unfinished one.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the thread after every job posted before; no result."""
        self._jobs.put((fn, args))

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()

        def job() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    future.set_exception(exc)

        self.post(job)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop after the jobs already posted (`cancel_futures` is not supported)."""
        self._jobs.put(None)
        if wait:
            self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args = job
            try:
                fn(*args)
            except BaseException:  # a job answers its caller itself; keep serving the rest
                log.exception("job on %s failed", self._thread.name)


class OneHopWriter:
    """Writes a plain group in one call on its own thread and sqlite3 connection.

    `write` returns each request's result, or None when the group is not plain
    or anything failed: the transaction was rolled back and nothing of the
    group is written, so the caller redoes it on the generic path.
    """

    def __init__(
        self, path: Path, cache_kib: int, piece_row: Callable[[arr.Piece], dict[str, Any]]
    ) -> None:
        self._path = path
        self._cache_kib = cache_kib
        self._piece_row = piece_row
        # Small unflushed groups commit on the loop's thread (see `INLINE_ENV`).
        self.inline = inline_writes_enabled()
        self._executor: WriterThread | None = None
        # Used on the writer thread only:
        self._conn: sqlite3.Connection | None = None
        self._projection_conn: sqlite3.Connection | None = None
        self._synchronous_full = True  # the connection's synchronous setting
        # Pieces committed through this writer, oldest first (bounded by KNOWN_DIGESTS).
        self._known: dict[bytes, None] = {}
        # Groups written inline since the last one on the writer thread.
        self._inline_streak = 0

    async def write(
        self, group: Sequence[GroupRequest], before_commit: Callable[[], Awaitable[None]] | None
    ) -> list[list[int] | None] | None:
        loop = asyncio.get_running_loop()
        if (
            self.inline
            and before_commit is None
            and self._inline_streak < INLINE_MAX_STREAK
            and _inline(group)
        ):
            self._inline_streak += 1
            return self._write_inline(group, loop)
        self._inline_streak = 0
        if self._executor is None:
            self._executor = WriterThread("recorder-sqlite-writer")
        # The job answers through `call_soon_threadsafe` itself: `run_in_executor`'s
        # bridge between a concurrent future and an asyncio one costs two done
        # callbacks and a state copy per group, on the loop.
        done: asyncio.Future[list[list[int] | None] | None] = loop.create_future()
        self._executor.post(self._job, done, group, before_commit, loop)
        return await done

    async def save_projection(self, name: str, rows: Sequence[tuple[str, int, str, bytes]]) -> None:
        """Upsert projection rows in one transaction on the writer thread.

        `replay reclassify` writes ~140 kB of samples per session this way.
        Through SQLAlchemy and aiosqlite each batch took a parameter dict and
        a bind conversion per row and several thread hops, and that thread's
        GIL handoffs took CPU from the reduction running beside it. The rows
        go through a connection of their own: the loop's thread may be
        writing a small group on the other one meanwhile (`_write_inline`).
        """
        if self._executor is None:
            self._executor = WriterThread("recorder-sqlite-writer")
        await asyncio.get_running_loop().run_in_executor(
            self._executor, self._save_projection, name, rows
        )

    async def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.get_running_loop().run_in_executor(executor, self._close_connections)
            executor.shutdown(wait=True)  # the thread is idle: this returns at once
        else:  # opened by inline writes only, if at all
            self._close_connections()

    def _write_inline(
        self, group: Sequence[GroupRequest], loop: asyncio.AbstractEventLoop
    ) -> list[list[int] | None] | None:
        """`_write` on the loop's thread, never waiting: a locked database fails at
        once (the generic path then waits for it), and the WAL is checkpointed
        by a later commit on the writer thread. The group committer runs one
        group at a time, so the writer thread is idle meanwhile."""
        try:
            conn = self._connection()
            conn.execute("PRAGMA busy_timeout=0")
            conn.execute("PRAGMA wal_autocheckpoint=0")
        except sqlite3.Error as e:
            return self._roll_back(f"{type(e).__name__}: {e}")
        try:
            return self._write(group, None, loop)
        finally:
            with contextlib.suppress(sqlite3.Error):  # a broken connection: reopened next time
                conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
                conn.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")

    # -- on the writer thread (or, for `_write_inline`, the loop's) ---------------

    def _job(
        self,
        done: asyncio.Future[list[list[int] | None] | None],
        group: Sequence[GroupRequest],
        before_commit: Callable[[], Awaitable[None]] | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        try:
            result = self._write(group, before_commit, loop)
        except BaseException as exc:  # _write answers None for what it expects
            loop.call_soon_threadsafe(_fail, done, exc)
            return
        loop.call_soon_threadsafe(_resolve, done, result)

    def _write(
        self,
        group: Sequence[GroupRequest],
        before_commit: Callable[[], Awaitable[None]] | None,
        loop: asyncio.AbstractEventLoop,
    ) -> list[list[int] | None] | None:
        pieces = {p.digest: p for r in group for p in r.pieces}
        plan = PlainGroup(group)
        try:
            conn = self._connection()
            self._set_synchronous(conn, full=needs_flush(group))
            conn.execute("BEGIN IMMEDIATE")
            if pieces and not self._bases_present(conn, pieces.values()):
                return self._roll_back("an array names an unknown parent or basis")
            next_seq, first_position = self._heads(conn, plan.sessions)
            results = plan.place(next_seq, first_position)
            if results is None:
                return self._roll_back("an expected_seq does not match")
            if pieces:
                conn.executemany(INSERT_PIECE_SQL, [self._piece_row(p) for p in pieces.values()])
            if plan.n_rows:
                conn.executemany(INSERT_EVENTS_SQL, run_tuples(plan.runs(next_seq)))
            if before_commit is not None:
                asyncio.run_coroutine_threadsafe(_awaited(before_commit), loop).result()
            conn.execute("COMMIT")
        except Exception as e:  # e.g. IntegrityError: a re-sent event id
            return self._roll_back(f"{type(e).__name__}: {e}")
        self._remember(pieces)
        return results

    def _save_projection(self, name: str, rows: Sequence[tuple[str, int, str, bytes]]) -> None:
        conn = self._projection_conn
        if conn is None:
            conn = self._projection_conn = self._open()
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(INSERT_PROJECTION_NAME_SQL, (name,))
            conn.executemany(UPSERT_PROJECTION_SQL, [(name, *row) for row in rows])
            conn.execute("COMMIT")
        except BaseException:
            try:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            except sqlite3.Error:  # a broken connection: open a fresh one next time
                self._projection_conn = None
                conn.close()
            raise

    def _set_synchronous(self, conn: sqlite3.Connection, *, full: bool) -> None:
        """FULL (fsync at commit) for a group that needs its flush, else NORMAL
        (see the module docstring)."""
        if full != self._synchronous_full:
            conn.execute(f"PRAGMA synchronous={'FULL' if full else 'NORMAL'}")
            self._synchronous_full = full

    def _remember(self, digests: Iterable[bytes]) -> None:
        known = self._known
        for d in digests:
            known[d] = None
        for _ in range(len(known) - KNOWN_DIGESTS):
            del known[next(iter(known))]

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            # Used by one thread at a time (the writer's, or the loop's for a
            # small group), never both: the group committer waits for each.
            self._conn = self._open()
        return self._conn

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self._path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False)
        configure_connection(conn, self._cache_kib)
        return conn

    def _heads(
        self, conn: sqlite3.Connection, sessions: Sequence[str]
    ) -> tuple[dict[str, int], int]:
        """(next seq per session, first free position), read under the write lock."""
        next_seq: dict[str, int] = {}
        last_position = 0
        if sessions:
            for sql, params in head_queries(sessions):
                found = fold_heads(conn.execute(sql, params), next_seq)
                last_position = last_position if found is None else found
        return next_seq, last_position + 1

    def _bases_present(self, conn: sqlite3.Connection, pieces: Iterable[arr.Piece]) -> bool:
        """Whether every parent and basis the pieces name outside the group is
        stored; those this writer committed or found are not looked up again."""
        wanted = [d for d in arr.external_bases(pieces) if d not in self._known]
        for i in range(0, len(wanted), IN_CHUNK):
            chunk = wanted[i : i + IN_CHUNK]
            sql = f"SELECT COUNT(*) FROM arrays WHERE digest IN ({','.join('?' * len(chunk))})"
            ((found,),) = conn.execute(sql, chunk).fetchall()
            if found != len(chunk):
                return False
        self._remember(wanted)
        return True

    def _roll_back(self, why: str) -> None:
        log.debug("group redone on the generic write path: %s", why)
        conn = self._conn
        if conn is None or not conn.in_transaction:
            return
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:  # a broken connection: open a fresh one next time
            self._close_connection()

    def _close_connection(self) -> None:
        conn, self._conn = self._conn, None
        self._synchronous_full = True  # a new connection starts as configured
        if conn is not None:
            conn.close()

    def _close_connections(self) -> None:
        self._close_connection()
        projection_conn, self._projection_conn = self._projection_conn, None
        if projection_conn is not None:
            projection_conn.close()


def _inline(group: Sequence[GroupRequest]) -> bool:
    """Is `group` written on the loop's thread (see `INLINE_MAX_BYTES`)?"""
    if needs_flush(group):
        return False
    size = 0
    for r in group:
        size += sum(len(p.data) for p in r.pieces)
        if isinstance(r, AppendRequest):
            size += sum(len(row.payload) for row in r.rows)
        if size > INLINE_MAX_BYTES:
            return False
    return True


def _resolve(done: asyncio.Future[Any], result: Any) -> None:
    if not done.done():
        done.set_result(result)


def _fail(done: asyncio.Future[Any], exc: BaseException) -> None:
    if not done.done():
        done.set_exception(exc)


async def _awaited(hook: Callable[[], Awaitable[None]]) -> None:
    await hook()


class SqliteEventStore(SqlEventStore):
    dialect_insert = staticmethod(sqlite_insert)  # type: ignore[assignment]

    def __init__(
        self,
        url: str,
        write_engine: AsyncEngine,
        read_engine: AsyncEngine,
        options: StoreOptions | None = None,
        *,
        read_only: bool = False,
    ) -> None:
        """`read_only`: the engines cannot write (the viewer's): every write goes
        through them, to be refused, and none through a sqlite3 connection of ours."""
        super().__init__(url, write_engine, read_engine, options)
        self._one_hop = (
            None
            if read_only
            else OneHopWriter(
                _file_path(url), _kib(self.options.writer_page_cache_bytes), self.piece_row
            )
        )
        self._inline = (
            InlineReader(_file_path(url), _kib(self.options.reader_page_cache_bytes))
            if self.options.inline_reads
            else None
        )

    def _reading(self) -> contextlib.AbstractAsyncContextManager[Any]:
        return self._inline.reading() if self._inline is not None else super()._reading()

    @classmethod
    def connect(cls, url: str, options: StoreOptions | None = None) -> SqliteEventStore:
        _file_path(url)
        options = options or StoreOptions()
        return cls(
            url,
            create_engine(url, writer=True, cache_kib=_kib(options.writer_page_cache_bytes)),
            create_engine(url, writer=False, cache_kib=_kib(options.reader_page_cache_bytes)),
            options,
        )

    async def _write_plain_group(self, group: list[GroupRequest]) -> list[list[int] | None] | None:
        if self._one_hop is None:
            return None  # the generic path, where a read-only engine refuses it
        return await self._one_hop.write(group, self.before_commit)

    async def save_projection(self, name: str, rows: Sequence[tuple[str, int, str, bytes]]) -> None:
        if self._one_hop is None:
            await super().save_projection(name, rows)
        else:
            await self._one_hop.save_projection(name, rows)

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            if self._inline is not None:
                self._inline.close()
            if self._one_hop is not None:
                await self._one_hop.close()

    async def _lock_writers(self, conn: AsyncConnection) -> None:
        """BEGIN IMMEDIATE already holds the database write lock."""

    # The hot path talks to the raw aiosqlite connection, inside the same
    # BEGIN IMMEDIATE transaction: through SQLAlchemy each statement costs
    # several hops to aiosqlite's thread (cursor, execute, fetch, close); raw,
    # one. On a loaded machine a hop is ~0.3 ms, a sizeable share of a
    # 1000-event batch.

    async def _read_heads(
        self, conn: AsyncConnection, session_ids: set[str]
    ) -> tuple[dict[str, int], int | None]:
        # One statement for the seqs and the last position: BEGIN IMMEDIATE
        # holds the write lock, so MAX(position)+1 stays free until COMMIT.
        raw = await _driver(conn)
        next_seq: dict[str, int] = {}
        last_position = 0
        for sql, params in head_queries(session_ids):
            found = fold_heads(await raw.execute_fetchall(sql, params), next_seq)
            last_position = last_position if found is None else found
        return next_seq, last_position + 1

    async def _allocate_positions(self, conn: AsyncConnection, n: int) -> int:
        # Rows are never deleted (triggers), so MAX+1 never reuses a position.
        raw = await _driver(conn)
        ((last,),) = await raw.execute_fetchall("SELECT MAX(position) FROM events")
        return int(last or 0) + 1

    async def _raw_events(
        self, conn: AsyncConnection, after: int, limit: int, sessions: SessionRange | None = None
    ) -> Sequence[Any]:
        raw = await _driver(conn)
        where, params = "position > ?", [after]
        if sessions is not None:
            # Unary `+` keeps SQLite off the (session_id, seq) index: it would
            # sort the whole range's events for every page. Its default BINARY
            # collation is code point order, as the range's bounds are.
            lo, hi = sessions
            if lo is not None:
                where, params = where + " AND +session_id >= ?", [*params, lo]
            if hi is not None:
                where, params = where + " AND +session_id < ?", [*params, hi]
        rows = await raw.execute_fetchall(
            f"{_SELECT_EVENTS} WHERE {where} ORDER BY position LIMIT ?", (*params, limit)
        )
        return _with_uuids(rows)

    async def _raw_from_last(
        self, conn: AsyncConnection, session_id: str, types: Sequence[str]
    ) -> Sequence[Any]:
        # The driver directly: a restart runs this once per session it rebuilds,
        # and SQLAlchemy's statement handling cost more than the query.
        raw = await _driver(conn)
        marks = ",".join("?" * len(types))
        rows = await raw.execute_fetchall(
            _SELECT_EVENTS + " WHERE session_id = ? AND seq >= coalesce((SELECT seq FROM events"
            f" WHERE session_id = ? AND type IN ({marks}) ORDER BY seq DESC LIMIT 1), 0)"
            " ORDER BY seq",
            (session_id, session_id, *types),
        )
        return _with_uuids(rows)

    async def _raw_session(
        self, conn: AsyncConnection, session_id: str, from_seq: int
    ) -> Sequence[Any]:
        raw = await _driver(conn)
        rows = await raw.execute_fetchall(
            _SELECT_EVENTS + " WHERE session_id = ? AND seq >= ? ORDER BY seq",
            (session_id, from_seq),
        )
        return _with_uuids(rows)

    async def _piece_rows(self, conn: AsyncConnection, digests: Sequence[bytes]) -> Iterable[Any]:
        raw = await _driver(conn)
        rows: Iterable[Any] = await raw.execute_fetchall(
            _SELECT_PIECES + f" WHERE digest IN ({','.join('?' * len(digests))})", digests
        )
        return rows

    async def _chain_rows(self, conn: AsyncConnection, digests: Sequence[bytes]) -> Iterable[Any]:
        raw = await _driver(conn)
        rows: list[Any] = []
        for chunk in chunks(digests):
            rows += await raw.execute_fetchall(
                _SELECT_PIECES + " WHERE digest IN (WITH RECURSIVE chain(d) AS (SELECT digest"
                f" FROM arrays WHERE digest IN ({','.join('?' * len(chunk))}) UNION SELECT"
                " up.parent FROM arrays AS up, chain WHERE up.digest = chain.d"
                " AND up.parent IS NOT NULL) SELECT d FROM chain)",
                chunk,
            )
        return rows

    async def _insert_events(self, conn: AsyncConnection, rows: list[NewRow]) -> None:
        raw = await _driver(conn)
        await raw.executemany(INSERT_EVENTS_SQL, [event_tuple(sid, seq, r) for sid, seq, r in rows])


def _file_path(url: str) -> Path:
    path = database_path(url)
    if path is None:
        raise ValueError(
            f"{url}: in-memory SQLite cannot be shared by the writer and readers; give a file path"
        )
    return path


def _kib(n_bytes: int) -> int:
    """PRAGMA cache_size=-N takes KiB; 0 would mean "no limit given", so keep >= 1 page."""
    return max(1, n_bytes // 1024)


_SELECT_EVENTS = (
    "SELECT position, session_id, seq, event_id, type, version, ts, payload FROM events"
)
_SELECT_PIECES = (
    "SELECT digest, parent, dtype, total_length, codec, data, data_tail, basis, basis_depth"
    " FROM arrays"
)


def _with_uuids(rows: Iterable[Any]) -> list[tuple[Any, ...]]:
    """Event rows from the driver with their 16-byte event ids as UUIDs.

    Converted by msgspec in one batch, a third of `uuid.UUID(bytes=...)`'s cost
    (a replay reads every event of the log)."""
    rows = list(rows)
    ids = msgspec.convert([r[3] for r in rows], list[uuid.UUID])
    return [
        (p, s, q, e, t, v, ts, b) for (p, s, q, _raw, t, v, ts, b), e in zip(rows, ids, strict=True)
    ]


async def _driver(conn: AsyncConnection | InlineReader) -> Any:
    """The aiosqlite connection under a SQLAlchemy connection (same transaction),
    or an `InlineReader` itself (it has the one method the read hooks use)."""
    if isinstance(conn, InlineReader):
        return conn
    return (await conn.get_raw_connection()).driver_connection


class InlineReader:
    """A read connection used on the caller's thread (`StoreOptions.inline_reads`).

    Opened on first use with the settings of every connection of ours. A
    `reading()` block is one read transaction, as an engine connection's is
    (nested blocks share the outer one); `execute_fetchall` is the aiosqlite
    method of that name, run at once.
    """

    def __init__(self, path: Path, cache_kib: int) -> None:
        self._path = path
        self._cache_kib = cache_kib
        self._conn: sqlite3.Connection | None = None
        self._depth = 0

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[InlineReader]:
        if self._conn is None:
            self._conn = sqlite3.connect(self._path, timeout=BUSY_TIMEOUT_MS / 1000)
            configure_connection(self._conn, self._cache_kib)
        if self._depth == 0:
            self._conn.execute("BEGIN")
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if self._depth == 0 and self._conn.in_transaction:  # an error may have ended it
                self._conn.execute("ROLLBACK")

    async def execute_fetchall(self, sql: str, parameters: Sequence[Any]) -> list[Any]:
        assert self._conn is not None, "execute_fetchall outside reading()"
        return self._conn.execute(sql, parameters).fetchall()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
