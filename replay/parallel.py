"""Replay on many cores: sessions split into id ranges, one worker per range.

`reclassify` and `export` run here when given more than one worker (local
processes) or a Ray cluster (`replay.cluster`). The work is split so that
nothing but the database URL, the rules and two session ids travels to a
worker, and a worker's memory is bounded by the largest session, not the log:

- the driver lists the session ids with their numbers of events, sorts the
  ids (code point order) and cuts them into contiguous ranges of equal weight
  (`replay.partitions.plan_ranges`: equal counts of sessions are not equal work);
- a worker opens the store by URL and streams its range with
  `iter_session_logs(sessions=range)`: the store filters the event pages, so a
  worker decodes only its own sessions' events and reads only their arrays;
- it reduces each session with the same pure reducer as the one-process run.

What comes back:
- reclassify: each worker writes its sessions' projection rows itself (rows
  are keyed by session, so the tables hold exactly what one process writes)
  and returns the small per-session summaries the change report needs;
- export: each worker encodes its sessions' samples (JSONL lines, or msgpack
  for Parquet) into chunks of at most `FLUSH_BYTES`, each entry tagged with the
  session's `YieldKey`. The driver spills chunks to a part file per worker,
  then writes the output in yield-key order keeping each session's last yield:
  the order and content of the one-process export, byte for byte (Parquet is
  re-encoded by the driver with the same row groups);
- stats: each worker returns its sessions' `replay.stats.SessionStats`, which
  the driver combines as one process does.

Ray is never imported here: `replay.cluster` runs the same `worker_chunks`
as Ray tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import multiprocessing
import pickle
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Literal

import msgspec

from recorder.log.store.base import EventStore, SessionRange
from replay.export import (
    ExportCounts,
    Format,
    ParquetWriter,
    Tally,
    counted,
    part_blob,
    samples_from_blob,
    tally,
)
from replay.gcpass import pass_gc
from replay.load import SessionLog, iter_session_logs
from replay.partitions import PartStat, auto_workers, plan_ranges
from replay.reclassify import FLUSH_BYTES, SessionSummary, reduce_batches
from replay.reducer import reduce_session
from replay.rules import Rules
from replay.stats import SessionStats, session_stats

Kind = Literal["reclassify", "export", "stats"]


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one worker needs: where the log is and which sessions are its own."""

    kind: Kind
    url: str
    rules: Rules
    covers: int
    sessions: SessionRange
    session_ids: list[str] | None = None
    names: tuple[str, str] | None = None  # reclassify: projection names, None = dry run
    fmt: Format = "jsonl"  # export
    page_size: int = 1000
    batch: int = 256
    blake2b: bool = False  # reclassify: `replay.reclassify.needs_blake2b`


# (yield phase, yield position, session id, offset in the chunk's data, length,
# then the session's `replay.export.Tally`: samples, placeholders, trainable tokens)
Entry = tuple[int, int, str, int, int, int, int, int]


class Chunk(msgspec.Struct, kw_only=True):
    """One batch of a worker's output (the unit a Ray task streams back)."""

    sessions: int
    summaries: dict[str, SessionSummary] = {}
    stats: dict[str, SessionStats] = {}
    entries: list[Entry] = []
    data: bytes = b""
    # Set on a worker's last chunk: where it ran, its process's peak RSS and
    # the CPU time the job took in it.
    node: str = ""
    peak_rss: int = 0
    cpu_seconds: float = 0.0


class PartResult(msgspec.Struct, kw_only=True):
    """A worker's output gathered: summaries, or the index of its part file."""

    sessions: int = 0
    summaries: dict[str, SessionSummary] = {}
    stats: dict[str, SessionStats] = {}
    entries: list[Entry] = []
    part: str = ""
    node: str = ""
    peak_rss: int = 0
    cpu_seconds: float = 0.0


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM), 0 where /proc is absent."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class WorkerFailed(RuntimeError):
    """A worker's error that could not travel to the driver as itself."""


def portable(exc: Exception) -> Exception:
    """`exc` if it pickles (it reaches the driver as it is), else a `WorkerFailed`
    with its type and message.

    A worker's exception travels to the driver pickled. One that does not
    pickle (a database driver's error holding its statement's parameters as
    memoryviews) arrived as "cannot pickle 'memoryview' object", hiding what
    went wrong, e.g. "database disk image is malformed".
    """
    try:
        pickle.dumps(exc)
    except Exception:
        return WorkerFailed(f"a replay worker failed: {type(exc).__name__}: {exc}")
    return exc


async def worker_chunks(job: Job, node: str = "") -> AsyncIterator[Chunk]:
    """Run `job` against the store at its URL; yield its output in chunks."""
    from recorder.log.store import StoreOptions, open_store

    cpu = time.process_time()
    try:
        store = await open_store(job.url, options=StoreOptions.streaming())
        try:
            chunks = {
                "reclassify": _reclassify_chunks,
                "export": _export_chunks,
                "stats": _stats_chunks,
            }[job.kind](store, job)
            with pass_gc():  # a spawned worker or a Ray task; a forked worker has it already
                async for chunk in chunks:
                    yield chunk
        finally:
            await store.close()
    except Exception as exc:
        raise portable(exc) from None
    yield Chunk(
        sessions=0,
        node=node or socket.gethostname(),
        peak_rss=peak_rss_bytes(),
        cpu_seconds=time.process_time() - cpu,
    )


async def _reclassify_chunks(store: EventStore, job: Job) -> AsyncIterator[Chunk]:
    async for done in reduce_batches(
        store,
        job.rules,
        covers=job.covers,
        names=job.names,
        session_ids=job.session_ids,
        sessions=job.sessions,
        page_size=job.page_size,
        batch=job.batch,
        blake2b=job.blake2b,
    ):
        yield Chunk(sessions=len(done), summaries=done)


async def _export_chunks(store: EventStore, job: Job) -> AsyncIterator[Chunk]:
    entries: list[Entry] = []
    data = bytearray()
    async for log in _logs(store, job, routed_experts=job.rules.routed_experts is not None):
        result = reduce_session(log.events, log.arrays, job.rules)
        blob = part_blob(result.samples, job.fmt)
        entries.append((*log.order, log.session_id, len(data), len(blob), *tally(result.samples)))
        data += blob
        if len(entries) >= job.batch or len(data) >= FLUSH_BYTES:
            yield Chunk(sessions=len(entries), entries=entries, data=bytes(data))
            entries, data = [], bytearray()
    if entries:
        yield Chunk(sessions=len(entries), entries=entries, data=bytes(data))


def _logs(store: EventStore, job: Job, *, routed_experts: bool) -> AsyncIterator[SessionLog]:
    """The sessions of `job`'s range, streamed up to the position it covers."""
    return iter_session_logs(
        store,
        page_size=job.page_size,
        until=job.covers,
        session_ids=job.session_ids,
        sessions=job.sessions,
        routed_experts=routed_experts,
    )


async def _stats_chunks(store: EventStore, job: Job) -> AsyncIterator[Chunk]:
    stats: dict[str, SessionStats] = {}
    async for log in _logs(store, job, routed_experts=False):
        result = reduce_session(log.events, log.arrays, job.rules)
        stats[log.session_id] = session_stats(log, result)  # a later yield supersedes
        if len(stats) >= job.batch:
            yield Chunk(sessions=len(stats), stats=stats)
            stats = {}
    if stats:
        yield Chunk(sessions=len(stats), stats=stats)


class PartSink:
    """Gathers one worker's chunks: summaries in memory, export data in a part file."""

    def __init__(self, part: Path | None) -> None:
        self.result = PartResult(part=str(part) if part is not None else "")
        self._fh = part.open("wb") if part is not None else None
        self._size = 0

    def add(self, chunk: Chunk) -> None:
        self.result.sessions += chunk.sessions
        self.result.summaries.update(chunk.summaries)
        self.result.stats.update(chunk.stats)
        if chunk.entries:
            assert self._fh is not None, "an export chunk needs a part file"
            self._fh.write(chunk.data)
            base = self._size
            self.result.entries += [(*e[:3], base + e[3], *e[4:]) for e in chunk.entries]
            self._size += len(chunk.data)
        if chunk.node:
            self.result.node, self.result.peak_rss = chunk.node, chunk.peak_rss
            self.result.cpu_seconds = chunk.cpu_seconds

    def close(self) -> PartResult:
        if self._fh is not None:
            self._fh.close()
        return self.result


# -------------------------------------------------------------- local processes

# Set in worker processes: a shared counter of reduced sessions, for progress.
_worker_counter: Any = None


def _init_worker(counter: Any) -> None:
    global _worker_counter
    _worker_counter = counter


def _process_worker(job_bytes: bytes, part: str | None) -> bytes:
    """One partition in a worker process (top level: the pool pickles it by name)."""
    job = msgspec.msgpack.decode(job_bytes, type=Job)
    sink = PartSink(Path(part) if part else None)

    async def run() -> None:
        async for chunk in worker_chunks(job):
            sink.add(chunk)
            if _worker_counter is not None and chunk.sessions:
                with _worker_counter.get_lock():
                    _worker_counter.value += chunk.sessions

    try:
        asyncio.run(run())
    finally:
        result = sink.close()
    result.cpu_seconds = time.process_time()  # a fresh process: its start-up counts too
    return msgspec.msgpack.encode(result)


# What a worker imports to open a store and reduce, imported once before forking
# so that no forked worker imports it again: per backend, so that a run on a
# SQLite file does not import the Postgres driver (~0.07 s of the driver's CPU
# before any worker starts).
_PRELOAD: dict[str, tuple[str, ...]] = {
    "sqlite": ("recorder.log.store.sqlite", "sqlalchemy.dialects.sqlite.aiosqlite"),
    "postgresql": ("recorder.log.store.postgres", "sqlalchemy.dialects.postgresql.asyncpg"),
}


def _preload(url: str | None) -> None:
    """Import what a worker needs for the store at `url` (None or unknown: every backend)."""
    backend = _backend(url)
    names = _PRELOAD[backend] if backend in _PRELOAD else sum(_PRELOAD.values(), ())
    for name in ("recorder.log.store", *names):
        with contextlib.suppress(ImportError):  # a backend's driver may not be installed
            importlib.import_module(name)


def _backend(url: str | None) -> str | None:
    """The backend name of a store URL or SQLite path, None if it cannot be told."""
    if url is None:
        return None
    import sqlalchemy as sa

    from recorder.log.store import normalize_url

    try:
        return sa.make_url(normalize_url(url)).get_backend_name()
    except (ValueError, sa.exc.ArgumentError):
        return None


class _Forked:
    """Worker processes forked ahead of a run (see `forked_workers`)."""

    def __init__(self, workers: int, url: str | None = None) -> None:
        _preload(url)
        ctx = multiprocessing.get_context("fork")
        self.workers = workers
        self.counter = ctx.Value("q", 0)
        self.pool = ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=_init_worker, initargs=(self.counter,)
        )
        # With "fork" the pool starts all its processes at the first submit,
        # before its manager thread: they are forked from this one thread.
        self.pool.submit(int).result()


_forked: _Forked | None = None


def can_fork() -> bool:
    """Is forking this process safe: one thread, no running event loop, and a
    platform where "fork" is the real thing (Linux)?"""
    if not sys.platform.startswith("linux") or threading.active_count() != 1:
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return "fork" in multiprocessing.get_all_start_methods()
    return False


@contextlib.contextmanager
def forked_workers(workers: int, url: str | None = None) -> Iterator[None]:
    """Fork `workers` worker processes now, for the parallel runs inside this block
    (on the store at `url`: what they import for it is imported first).

    A spawned worker imports the package afresh (~1.3 s of CPU each, longer
    than the reduction of a few hundred sessions); a forked one has it already.
    Forking is safe only before this process opens a database connection or
    starts a thread or an event loop (SQLite's locks and any lock another
    thread holds would be copied into the child), so the command line calls
    this first thing; where that does not hold (`can_fork`), or a run wants
    more workers than were forked, runs spawn their workers as before.
    """
    global _forked
    if workers < 2 or _forked is not None or not can_fork():
        yield
        return
    _forked = _Forked(workers, url)
    try:
        yield
    finally:
        forked, _forked = _forked, None
        forked.pool.shutdown(wait=True, cancel_futures=True)


async def run_in_processes(
    jobs: Sequence[Job], parts: Sequence[Path | None], on_progress: Callable[[int], None] | None
) -> list[PartResult]:
    """Each job in its own process, all at once: the processes `forked_workers`
    started if there are enough of them, else spawned ones."""
    forked = _forked
    if forked is not None and forked.workers >= len(jobs):
        with forked.counter.get_lock():
            forked.counter.value = 0
        return await _run_on_pool(forked.pool, forked.counter, jobs, parts, on_progress)
    ctx = multiprocessing.get_context("spawn")
    counter = ctx.Value("q", 0)
    with ProcessPoolExecutor(
        len(jobs), mp_context=ctx, initializer=_init_worker, initargs=(counter,)
    ) as pool:
        return await _run_on_pool(pool, counter, jobs, parts, on_progress)


async def _run_on_pool(
    pool: ProcessPoolExecutor,
    counter: Any,
    jobs: Sequence[Job],
    parts: Sequence[Path | None],
    on_progress: Callable[[int], None] | None,
) -> list[PartResult]:
    loop = asyncio.get_running_loop()
    futures = [
        loop.run_in_executor(
            pool,
            _process_worker,
            msgspec.msgpack.encode(job),
            str(part) if part is not None else None,
        )
        for job, part in zip(jobs, parts, strict=True)
    ]
    done = asyncio.gather(*futures)
    while not done.done():
        await asyncio.wait([done], timeout=0.2)
        if on_progress is not None:
            on_progress(counter.value)
    results = await done
    return [msgspec.msgpack.decode(r, type=PartResult) for r in results]


# -------------------------------------------------------------- driver


async def wanted_sizes(store: EventStore, session_ids: Iterable[str] | None) -> dict[str, int]:
    """The log's sessions (or those of `session_ids` it holds) -> their number of events."""
    sizes = await store.session_sizes()
    if session_ids is not None:
        wanted = set(session_ids)
        sizes = {s: n for s, n in sizes.items() if s in wanted}
    return sizes


def make_jobs(base: Job, sizes: Mapping[str, int], parts: int) -> list[Job]:
    """One job per range of the sessions `sizes` weighs (at most one per session)."""
    return [msgspec.structs.replace(base, sessions=r) for r in plan_ranges(sizes, parts, sizes)]


def part_paths(part_dir: Path | None, n: int) -> list[Path | None]:
    return [part_dir / f"part-{k:05d}" if part_dir else None for k in range(n)]


async def whole_log_job(
    store: EventStore,
    kind: Kind,
    rules: Rules,
    *,
    page_size: int,
    batch: int,
    fmt: Format = "jsonl",
) -> Job:
    """A `kind` job over every session of the log as it stands now (its last position)."""
    return Job(
        kind=kind,
        url=store.url,
        rules=rules,
        covers=await store.last_position(),
        sessions=(None, None),
        fmt=fmt,
        page_size=page_size,
        batch=batch,
    )


async def resolve_workers(
    store: EventStore,
    workers: int | None,
    ray: str | None,
    sizes: Mapping[str, int] | None,
    session_ids: Iterable[str] | None = None,
) -> tuple[int | None, Mapping[str, int] | None]:
    """(`workers`, `sizes`) as a local run uses them: no count (one per core)
    becomes one for this log's size, its sessions listed unless `sizes` has
    them (`replay.partitions.auto_workers`: a small log runs in one process)."""
    if workers is None and ray is None:
        if sizes is None:
            sizes = await wanted_sizes(store, session_ids)
        workers = auto_workers(len(sizes))
    return workers, sizes


async def run_jobs(
    base: Job,
    store: EventStore,
    sizes: Mapping[str, int] | None,
    *,
    workers: int | None,
    ray: str | None,
    part_dir: Path | None,
    on_progress: Callable[[int], None] | None,
) -> list[PartResult]:
    """Split the sessions `sizes` weighs (None: those of `store`, or of
    `base.session_ids`) into ranges and run them in local processes, or as Ray
    tasks when `ray` is set ("" = `ray.init()`'s default cluster). `workers` None:
    one per core (on Ray: per CPU of the cluster), fewer for a small log."""
    if sizes is None:
        sizes = await wanted_sizes(store, base.session_ids)
    if ray is not None:
        from replay.cluster import run_on_ray

        return await run_on_ray(
            base,
            sizes,
            workers=workers,
            part_dir=part_dir,
            address=ray or None,
            on_progress=on_progress,
        )
    jobs = make_jobs(base, sizes, workers or auto_workers(len(sizes)))
    return await run_in_processes(jobs, part_paths(part_dir, len(jobs)), on_progress)


def partition_stats(results: Sequence[PartResult]) -> list[PartStat]:
    return [
        PartStat(node=r.node, sessions=r.sessions, peak_rss=r.peak_rss, cpu_seconds=r.cpu_seconds)
        for r in results
    ]


def merge_summaries(results: Sequence[PartResult]) -> dict[str, SessionSummary]:
    seen: dict[str, SessionSummary] = {}
    for r in results:
        seen.update(r.summaries)
    return seen


def merge_export(results: Sequence[PartResult], out: Path, fmt: Format, batch: int) -> ExportCounts:
    """Write the parts' sessions to `out` in the one-process order; return the
    counts of what was written. A session yielded more than once keeps its last yield."""
    final: dict[str, tuple[int, int, int, int, int]] = {}
    tallies: dict[str, Tally] = {}
    for k, r in enumerate(results):
        for phase, pos, sid, offset, length, *counts in r.entries:
            key = (phase, pos, k, offset, length)
            if sid not in final or final[sid][:2] <= key[:2]:
                final[sid] = key
                tallies[sid] = (counts[0], counts[1], counts[2])
    order = sorted(final.values())
    files = [open(r.part, "rb") if r.entries else None for r in results]  # noqa: SIM115
    try:
        if fmt == "jsonl":
            with out.open("wb") as dst:
                for _phase, _pos, k, offset, length in order:
                    src = files[k]
                    assert src is not None
                    src.seek(offset)
                    dst.write(src.read(length))
        else:
            writer = ParquetWriter(out, batch)
            try:
                for _phase, _pos, k, offset, length in order:
                    src = files[k]
                    assert src is not None
                    src.seek(offset)
                    for sample in samples_from_blob(src.read(length)):
                        writer.write(sample)
            finally:
                writer.close()
    finally:
        for fh in files:
            if fh is not None:
                fh.close()
    return counted(tallies.values())


def part_directory(out: Path) -> Path:
    """A private directory beside `out` for the part files (same filesystem)."""
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.parts-", dir=out.parent))


def remove_parts(part_dir: Path) -> None:
    shutil.rmtree(part_dir, ignore_errors=True)
