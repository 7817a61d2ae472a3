"""Re-derive every session's samples under some rules and store them as a projection.

Two projections are written per run, both named after the rules version and
the log position the run covers (so re-running on the same log with the same
rules rewrites identical rows: idempotent):
- `samples/<rules version>@<position>`: per session, the canonical bytes of
  its `SessionResult` (digest = blake2b of those bytes);
- `summary/<rules version>@<position>`: a small per-session `SessionSummary`
  used to report what changed against an earlier run without loading every
  sample into memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import msgspec

from recorder.log.store.base import EventStore
from replay.load import iter_session_logs
from replay.reducer import reduce_session
from replay.rules import Rules
from replay.samples import SessionResult, digest_bytes, encode_result

SAMPLES_PREFIX = "samples/"
# Projection payload gathered before a write (bounds memory whatever the sample sizes).
FLUSH_BYTES = 8 * 1024 * 1024
SUMMARY_PREFIX = "summary/"


class SessionSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What `reclassify` compares between runs for one session.

    `content_digest` covers what a trainer sees of the samples (tokens,
    masks, logprobs, rewards, statuses, kinds) but not the rules version
    stamped into them, so a new rules version changes only the sessions
    whose samples really change. Empty in summaries written before it.
    """

    digest: str
    status: str
    segmentation: list[tuple[str, list[int], str | None]]
    sample_kinds: list[str]
    sample_statuses: list[str]
    trainable_tokens: int
    placeholder: bool
    content_digest: str = ""


class ReclassifyReport(msgspec.Struct, kw_only=True):
    projection: str
    summary_projection: str
    previous: str | None
    covers_position: int
    dry_run: bool
    sessions: int = 0
    samples: int = 0
    changed_samples: list[str] = []
    changed_segmentation: list[str] = []
    new_sessions: int = 0
    kinds_before: dict[str, int] = {}
    kinds_after: dict[str, int] = {}
    status_before: dict[str, int] = {}
    status_after: dict[str, int] = {}
    trainable_before: int = 0
    trainable_after: int = 0


# (session_id, covers_position, digest, payload): one projection row.
_Row = tuple[str, int, str, bytes]

_summary_encoder = msgspec.msgpack.Encoder(order="deterministic")
_summary_decoder = msgspec.msgpack.Decoder(SessionSummary)


def summarize(result: SessionResult, digest: str) -> SessionSummary:
    return SessionSummary(
        digest=digest,
        status=result.status,
        segmentation=[(s.kind, s.turns, s.dropped) for s in result.segments],
        sample_kinds=[_kind(s.metadata) for s in result.samples],
        sample_statuses=[s.status for s in result.samples],
        trainable_tokens=sum(sum(s.loss_mask) for s in result.samples),
        placeholder=result.placeholder,
        content_digest=content_digest(result),
    )


def content_digest(result: SessionResult) -> str:
    """Digest of the samples' training content (see `SessionSummary`)."""
    content = [
        (
            s.tokens,
            s.prompt_len,
            s.loss_mask,
            s.rollout_logprobs,
            s.reward,
            s.status,
            _kind(s.metadata),
            s.routed_experts,
        )
        for s in result.samples
    ]
    return digest_bytes(_summary_encoder.encode(content))


def _samples_changed(before: SessionSummary, after: SessionSummary) -> bool:
    if before.content_digest and after.content_digest:
        return before.content_digest != after.content_digest
    return before.digest != after.digest


def _kind(metadata: dict[str, object]) -> str:
    if "placeholder" in metadata:
        return "placeholder"
    return str(metadata.get("segment_kind", "unknown"))


def projection_names_for(rules: Rules, covers_position: int) -> tuple[str, str]:
    tag = f"{rules.version}@{covers_position}"
    return SAMPLES_PREFIX + tag, SUMMARY_PREFIX + tag


async def previous_summary_name(store: EventStore, current: str) -> str | None:
    """The same projection if it exists (a re-run), else the latest other summary."""
    names = [n for n in await store.projection_names() if n.startswith(SUMMARY_PREFIX)]
    if current in names:
        return current
    return names[-1] if names else None


async def reduce_partition(
    store: EventStore,
    rules: Rules,
    *,
    covers: int,
    names: tuple[str, str] | None,
    session_ids: Iterable[str] | None = None,
    partition: tuple[int, int] | None = None,
    page_size: int = 1000,
    batch: int = 256,
    on_session: Callable[[SessionResult], None] | None = None,
) -> dict[str, SessionSummary]:
    """Reduce (a partition of) the log up to `covers`; write projection rows
    unless `names` is None (dry run). Returns each session's summary.

    Rows are written in batches of `batch` sessions or `FLUSH_BYTES` of
    payload, whichever comes first. A batch is written in the background while
    the next one is reduced (the database works in its own thread), one batch
    in flight at a time, so batches land in order and at most two are held.
    """
    seen: dict[str, SessionSummary] = {}
    # Keyed by session: a session yielded twice in one batch is written once.
    rows: dict[str, _Row] = {}
    summary_rows: dict[str, _Row] = {}
    pending_bytes = 0
    writing: asyncio.Task[None] | None = None

    async def write(samples: list[_Row], summaries: list[_Row]) -> None:
        assert names is not None
        await store.save_projection(names[0], samples)
        await store.save_projection(names[1], summaries)

    async def flush(*, wait: bool) -> None:
        nonlocal writing, pending_bytes
        if writing is not None:
            task, writing = writing, None
            await task
        if names is not None and rows:
            writing = asyncio.create_task(write(list(rows.values()), list(summary_rows.values())))
        rows.clear()
        summary_rows.clear()
        pending_bytes = 0
        if wait and writing is not None:
            task, writing = writing, None
            await task

    try:
        async for log in iter_session_logs(
            store,
            page_size=page_size,
            until=covers,
            session_ids=session_ids,
            partition=partition,
            routed_experts=rules.routed_experts is not None,
        ):
            result = reduce_session(log.events, log.arrays, rules)
            payload = encode_result(result)
            digest = digest_bytes(payload)
            summary = summarize(result, digest)
            sid = log.session_id
            seen[sid] = summary  # a later yield of a session supersedes
            rows[sid] = (sid, log.last_position, digest, payload)
            summary_rows[sid] = (sid, log.last_position, digest, _summary_encoder.encode(summary))
            pending_bytes += len(payload)
            if on_session is not None:
                on_session(result)
            if len(rows) >= batch or pending_bytes >= FLUSH_BYTES:
                await flush(wait=False)
        await flush(wait=True)
    finally:
        if writing is not None:  # an error while reducing: don't leave the write orphaned
            with contextlib.suppress(Exception):
                await writing
    return seen


# Set in worker processes: a shared counter of reduced sessions, for progress.
_worker_counter: Any = None


def _init_worker(counter: Any) -> None:
    global _worker_counter
    _worker_counter = counter


def _count_one(_result: SessionResult) -> None:
    with _worker_counter.get_lock():
        _worker_counter.value += 1


def _worker(
    url: str,
    rules: Rules,
    covers: int,
    names: tuple[str, str] | None,
    session_ids: list[str] | None,
    partition: tuple[int, int],
    page_size: int,
    batch: int,
) -> bytes:
    async def run() -> dict[str, SessionSummary]:
        from recorder.log.store import StoreOptions, open_store

        store = await open_store(url, options=StoreOptions.streaming())
        try:
            return await reduce_partition(
                store,
                rules,
                covers=covers,
                names=names,
                session_ids=session_ids,
                partition=partition,
                page_size=page_size,
                batch=batch,
                on_session=_count_one if _worker_counter is not None else None,
            )
        finally:
            await store.close()

    return _summary_encoder.encode(asyncio.run(run()))


async def _reduce_in_workers(
    store: EventStore,
    rules: Rules,
    workers: int,
    *,
    covers: int,
    names: tuple[str, str] | None,
    session_ids: Iterable[str] | None,
    page_size: int,
    batch: int,
    on_progress: Callable[[int], None] | None,
) -> dict[str, SessionSummary]:
    """Sessions split by a stable hash over `workers` processes (each reads the
    event pages, decodes and reduces only its own sessions' arrays)."""
    ctx = multiprocessing.get_context("spawn")
    counter = ctx.Value("q", 0)
    ids = list(session_ids) if session_ids is not None else None
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker, initargs=(counter,)
    ) as pool:
        futures = [
            loop.run_in_executor(
                pool, _worker, store.url, rules, covers, names, ids, (k, workers), page_size, batch
            )
            for k in range(workers)
        ]
        done = asyncio.gather(*futures)
        while not done.done():
            await asyncio.wait([done], timeout=0.2)
            if on_progress is not None:
                on_progress(counter.value)
        parts = await done
    seen: dict[str, SessionSummary] = {}
    for part in parts:
        seen.update(msgspec.msgpack.decode(part, type=dict[str, SessionSummary]))
    return seen


async def reclassify(
    store: EventStore,
    rules: Rules,
    *,
    session_ids: Iterable[str] | None = None,
    page_size: int = 1000,
    dry_run: bool = False,
    batch: int = 256,
    workers: int = 1,
    on_session: Callable[[SessionResult], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> ReclassifyReport:
    """Reduce every session (or `session_ids`) and store the projection.

    `workers` > 1 reduces in that many processes (the store must be reachable
    by URL: a file or a server). `on_session` gets each result (in-process
    only); `on_progress` gets the running count of reduced sessions.
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    covers = await store.last_position()
    name, summary_name = projection_names_for(rules, covers)
    names = None if dry_run else (name, summary_name)
    previous_name = await previous_summary_name(store, summary_name)
    if workers == 1:
        count = 0

        def progress(result: SessionResult) -> None:
            nonlocal count
            count += 1
            if on_session is not None:
                on_session(result)
            if on_progress is not None:
                on_progress(count)

        seen = await reduce_partition(
            store,
            rules,
            covers=covers,
            names=names,
            session_ids=session_ids,
            page_size=page_size,
            batch=batch,
            on_session=progress,
        )
    else:
        seen = await _reduce_in_workers(
            store,
            rules,
            workers,
            covers=covers,
            names=names,
            session_ids=session_ids,
            page_size=page_size,
            batch=batch,
            on_progress=on_progress,
        )
    previous: dict[str, SessionSummary] = {}
    if previous_name is not None:
        for sid, (_pos, _digest, payload) in (await store.load_projection(previous_name)).items():
            previous[sid] = _summary_decoder.decode(payload)
    return _report(seen, previous, name, summary_name, previous_name, covers, dry_run)


def _report(
    seen: dict[str, SessionSummary],
    previous: dict[str, SessionSummary],
    name: str,
    summary_name: str,
    previous_name: str | None,
    covers: int,
    dry_run: bool,
) -> ReclassifyReport:
    report = ReclassifyReport(
        projection=name,
        summary_projection=summary_name,
        previous=previous_name,
        covers_position=covers,
        dry_run=dry_run,
    )
    kinds_after: Counter[str] = Counter()
    status_after: Counter[str] = Counter()
    for sid in sorted(seen):
        summary = seen[sid]
        kinds_after.update(summary.sample_kinds)
        status_after.update(summary.sample_statuses)
        report.trainable_after += summary.trainable_tokens
        report.samples += len(summary.sample_kinds)
        before = previous.get(sid)
        if before is None:
            report.new_sessions += 1
            continue
        if _samples_changed(before, summary):
            report.changed_samples.append(sid)
        if before.segmentation != summary.segmentation:
            report.changed_segmentation.append(sid)
    compared = [previous[sid] for sid in seen if sid in previous]
    report.sessions = len(seen)
    report.kinds_after = dict(sorted(kinds_after.items()))
    report.status_after = dict(sorted(status_after.items()))
    report.kinds_before = dict(sorted(Counter(k for s in compared for k in s.sample_kinds).items()))
    report.status_before = dict(
        sorted(Counter(k for s in compared for k in s.sample_statuses).items())
    )
    report.trainable_before = sum(s.trainable_tokens for s in compared)
    return report
