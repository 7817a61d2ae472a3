"""Re-derive every session's samples under some rules and store them as a projection.

Two projections are written per run, both named after the rules version and
the log position the run covers (so re-running on the same log with the same
rules rewrites identical rows: idempotent):
- `samples/<rules version>@<position>`: per session, the canonical bytes of
  its `SessionResult`, zstd-compressed (`replay.samples.stored_result`; read
  them with `decode_result` or `result_bytes`); the row's digest is
  `replay.samples.digest_bytes` of the canonical bytes;
- `summary/<rules version>@<position>`: a small per-session `SessionSummary`
  used to report what changed against an earlier run without loading every
  sample into memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import msgspec
import numpy as np

from recorder.log.store.base import EventStore, SessionRange
from replay.load import iter_session_logs
from replay.packed import encode_array, unpacked
from replay.partitions import PartStat
from replay.reducer import reduce_session
from replay.rules import Rules
from replay.samples import Sample, SessionResult, digest_bytes, encode_result, stored_result

SAMPLES_PREFIX = "samples/"
# Projection payload (as encoded, before compression) gathered before a write:
# bounds memory whatever the sample sizes. Counted compressed, a batch held ~3x
# the sessions and a worker's peak RSS grew by a third (127 -> 163 MB).
FLUSH_BYTES = 8 * 1024 * 1024
SUMMARY_PREFIX = "summary/"


class SessionSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What `reclassify` compares between runs for one session.

    Its content digests cover what a trainer sees of the samples (tokens,
    masks, logprobs, rewards, statuses, kinds) but not the rules version
    stamped into them, so a new rules version changes only the sessions
    whose samples really change. `content_xxh3` is that digest by
    `digest_bytes`; `content_digest` is the BLAKE2b that summaries held before
    it, written only by a run that compares against such summaries (BLAKE2b
    cost ~5% of a run). Both are empty in summaries written before either.
    """

    digest: str
    status: str
    segmentation: list[tuple[str, list[int], str | None]]
    sample_kinds: list[str]
    sample_statuses: list[str]
    trainable_tokens: int
    placeholder: bool
    content_digest: str = ""
    content_xxh3: str = ""


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
    # Parallel runs: per worker, where it ran and its peak memory.
    partitions: list[PartStat] = []


# (session_id, covers_position, digest, payload): one projection row.
_Row = tuple[str, int, str, bytes]

_summary_encoder = msgspec.msgpack.Encoder(order="deterministic")
_summary_decoder = msgspec.msgpack.Decoder(SessionSummary)


def summarize(
    result: SessionResult, digest: str, content: bytes | None = None, *, blake2b: bool = False
) -> SessionSummary:
    """`content`: the result's `content_bytes` if already encoded (`encode_with_content`);
    `blake2b`: also the BLAKE2b content digest, for comparing with older summaries."""
    if content is None:
        content = content_bytes(result)
    return SessionSummary(
        digest=digest,
        status=result.status,
        segmentation=[(s.kind, s.turns, s.dropped) for s in result.segments],
        sample_kinds=[_kind(s.metadata) for s in result.samples],
        sample_statuses=[s.status for s in result.samples],
        trainable_tokens=sum(_trainable(s) for s in result.samples),
        placeholder=result.placeholder,
        content_digest=_blake2b(content) if blake2b else "",
        content_xxh3=digest_bytes(content),
    )


def _trainable(sample: Sample) -> int:
    mask = sample.loss_mask
    return int(mask.sum()) if isinstance(mask, np.ndarray) else sum(mask)


def content_digest(result: SessionResult) -> str:
    """The BLAKE2b content digest of older summaries (see `SessionSummary`)."""
    return _blake2b(content_bytes(result))


def _blake2b(content: bytes) -> str:
    return hashlib.blake2b(content, digest_size=16).hexdigest()


def content_bytes(result: SessionResult) -> bytes:
    """The bytes the content digests hash: the samples' training content."""
    return _content_bytes(result.samples, [_encoded_lists(s) for s in result.samples])


def _content_bytes(samples: list[Sample], lists: list[tuple[Any, Any, Any]]) -> bytes:
    """`content_bytes` with each sample's (tokens, loss_mask, rollout_logprobs)
    given as they are to be encoded (the lists, or their bytes as `msgspec.Raw`)."""
    content = [
        (
            tokens,
            s.prompt_len,
            mask,
            logprobs,
            s.reward,
            s.status,
            _kind(s.metadata),
            s.routed_experts,
        )
        for s, (tokens, mask, logprobs) in zip(samples, lists, strict=True)
    ]
    return _summary_encoder.encode(content)


def encode_with_content(result: SessionResult) -> tuple[bytes, bytes]:
    """(`encode_result(result)`, `content_bytes(result)`), the samples' long
    lists encoded once for both.

    The lists are most of the bytes and most of the encoding time; a list's
    msgpack is the same wherever it sits, so each is encoded alone and placed
    as `msgspec.Raw` in both documents, which come out byte for byte as
    `encode_result` and `content_bytes` make them. A packed result
    (`reduce_session(packed=True)`) has numpy arrays there, encoded straight
    to the same bytes (`replay.packed.encode_array`).
    """
    lists = [_encoded_lists(s) for s in result.samples]
    shadow = msgspec.structs.replace(
        result,
        samples=[
            msgspec.structs.replace(s, tokens=t, loss_mask=m, rollout_logprobs=lp)
            for s, (t, m, lp) in zip(result.samples, lists, strict=True)
        ],
    )
    return encode_result(shadow), _content_bytes(result.samples, lists)


def _encoded_lists(s: Sample) -> tuple[msgspec.Raw, msgspec.Raw, msgspec.Raw]:
    """A sample's tokens, loss mask and logprobs as msgpack (lists or packed arrays)."""
    return (
        msgspec.Raw(encode_array(s.tokens)),
        msgspec.Raw(encode_array(s.loss_mask)),
        msgspec.Raw(encode_array(s.rollout_logprobs)),
    )


def _samples_changed(before: SessionSummary, after: SessionSummary) -> bool:
    """By the newest digest both summaries hold."""
    if before.content_xxh3 and after.content_xxh3:
        return before.content_xxh3 != after.content_xxh3
    if before.content_digest and after.content_digest:
        return before.content_digest != after.content_digest
    return before.digest != after.digest


def needs_blake2b(previous: Mapping[str, SessionSummary]) -> bool:
    """Do summaries to compare with hold BLAKE2b content digests only (older runs)?
    Then this run writes both, and the next one needs BLAKE2b no more."""
    return any(s.content_digest and not s.content_xxh3 for s in previous.values())


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


async def reduce_batches(
    store: EventStore,
    rules: Rules,
    *,
    covers: int,
    names: tuple[str, str] | None,
    session_ids: Iterable[str] | None = None,
    sessions: SessionRange | None = None,
    page_size: int = 1000,
    batch: int = 256,
    on_session: Callable[[SessionResult], None] | None = None,
    on_reduced: Callable[[], None] | None = None,
    blake2b: bool = False,
) -> AsyncIterator[dict[str, SessionSummary]]:
    """Reduce (a range of) the log up to `covers`; write projection rows
    unless `names` is None (dry run). Yields each batch's summaries once its
    rows are written (a session yielded twice by the stream: the later wins).

    Rows are written in batches of `batch` sessions or `FLUSH_BYTES` of
    payload, whichever comes first. A batch is written in the background while
    the next one is reduced (the database works in its own thread), one batch
    in flight at a time, so batches land in order and at most two are held.

    Sessions are reduced packed (`reduce_session(packed=True)`: the samples'
    long lists are only encoded here); `on_session` gets each result with
    lists, as `reduce_session` returns it, and `on_reduced` is called once per
    session (a counter needs no result). `blake2b`: summaries carry the
    BLAKE2b content digest too (`needs_blake2b`).
    """
    # Keyed by session: a session yielded twice in one batch is written once.
    rows: dict[str, _Row] = {}
    summary_rows: dict[str, _Row] = {}
    summaries: dict[str, SessionSummary] = {}
    pending_bytes = 0
    writing: asyncio.Task[None] | None = None
    written: dict[str, SessionSummary] = {}

    async def write(samples: list[_Row], summary_list: list[_Row]) -> None:
        assert names is not None
        await store.save_projection(names[0], samples)
        await store.save_projection(names[1], summary_list)

    async def flush() -> dict[str, SessionSummary]:
        """Start writing the gathered batch; return the summaries of the one before."""
        nonlocal writing, pending_bytes, summaries, written
        if writing is not None:
            task, writing = writing, None
            await task
        done, written = written, summaries
        if names is not None and rows:
            writing = asyncio.create_task(write(list(rows.values()), list(summary_rows.values())))
        rows.clear()
        summary_rows.clear()
        summaries = {}
        pending_bytes = 0
        return done

    try:
        async for log in iter_session_logs(
            store,
            page_size=page_size,
            until=covers,
            session_ids=session_ids,
            sessions=sessions,
            routed_experts=rules.routed_experts is not None,
        ):
            result = reduce_session(log.events, log.arrays, rules, packed=True)
            payload, content = encode_with_content(result)
            digest = digest_bytes(payload)
            summary = summarize(result, digest, content, blake2b=blake2b)
            sid, last = log.session_id, log.last_position
            summaries[sid] = summary
            stored = payload if names is None else stored_result(payload)  # a dry run writes none
            rows[sid] = (sid, last, digest, stored)
            summary_rows[sid] = (sid, last, digest, _summary_encoder.encode(summary))
            pending_bytes += len(payload)  # as encoded: a batch's size in sessions as before
            if on_session is not None:
                on_session(unpacked(result))
            if on_reduced is not None:
                on_reduced()
            if len(rows) >= batch or pending_bytes >= FLUSH_BYTES:
                done = await flush()
                if done:
                    yield done
        for _ in range(2):  # the batch in flight, then the last one
            done = await flush()
            if done:
                yield done
    finally:
        if writing is not None:  # an error while reducing: don't leave the write orphaned
            with contextlib.suppress(Exception):
                await writing


async def reduce_partition(
    store: EventStore,
    rules: Rules,
    *,
    covers: int,
    names: tuple[str, str] | None,
    session_ids: Iterable[str] | None = None,
    sessions: SessionRange | None = None,
    page_size: int = 1000,
    batch: int = 256,
    on_session: Callable[[SessionResult], None] | None = None,
    on_reduced: Callable[[], None] | None = None,
    blake2b: bool = False,
) -> dict[str, SessionSummary]:
    """`reduce_batches` to the end: every session's summary (the later yield wins)."""
    seen: dict[str, SessionSummary] = {}
    async for done in reduce_batches(
        store,
        rules,
        covers=covers,
        names=names,
        session_ids=session_ids,
        sessions=sessions,
        page_size=page_size,
        batch=batch,
        on_session=on_session,
        on_reduced=on_reduced,
        blake2b=blake2b,
    ):
        seen.update(done)
    return seen


async def reclassify(
    store: EventStore,
    rules: Rules,
    *,
    session_ids: Iterable[str] | None = None,
    page_size: int = 1000,
    dry_run: bool = False,
    batch: int = 256,
    workers: int | None = 1,
    ray: str | None = None,
    on_session: Callable[[SessionResult], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> ReclassifyReport:
    """Reduce every session (or `session_ids`) and store the projection.

    `workers` > 1 reduces in that many local processes (None: one per core,
    fewer for a small log: `replay.partitions.auto_workers`), `ray` (an address, ""
    for Ray's default) in Ray tasks, each over a range of sessions (see
    `replay.parallel`; the store must be reachable by URL from every worker:
    a file on a shared path, or a server); the projection is the same as one
    process writes. `on_session` gets each result (one process only);
    `on_progress` gets the running count of reduced sessions. `sizes`: the
    sessions to reduce and their numbers of events if the caller has listed
    them already (`replay.parallel.wanted_sizes(store, session_ids)`), so the
    log is not scanned for them twice.
    """
    if workers is not None and workers < 1:
        raise ValueError("workers must be >= 1")
    covers = await store.last_position()
    name, summary_name = projection_names_for(rules, covers)
    names = None if dry_run else (name, summary_name)
    previous_name = await previous_summary_name(store, summary_name)
    previous: dict[str, SessionSummary] = {}
    if previous_name is not None:  # read first: a re-run overwrites its rows
        for sid, (_pos, _digest, payload) in (await store.load_projection(previous_name)).items():
            previous[sid] = _summary_decoder.decode(payload)
    blake2b = needs_blake2b(previous)
    partitions: list[PartStat] = []
    from replay.parallel import resolve_workers

    workers, sizes = await resolve_workers(store, workers, ray, sizes, session_ids)
    if workers == 1 and ray is None:
        count = 0

        def progress() -> None:
            nonlocal count
            count += 1
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
            on_session=on_session,
            on_reduced=progress,
            blake2b=blake2b,
        )
    else:
        from replay import parallel

        base = parallel.Job(
            kind="reclassify",
            url=store.url,
            rules=rules,
            covers=covers,
            sessions=(None, None),
            session_ids=list(session_ids) if session_ids is not None else None,
            names=names,
            page_size=page_size,
            batch=batch,
            blake2b=blake2b,
        )
        results = await parallel.run_jobs(
            base, store, sizes, workers=workers, ray=ray, part_dir=None, on_progress=on_progress
        )
        seen = parallel.merge_summaries(results)
        partitions = parallel.partition_stats(results)
    report = _report(seen, previous, name, summary_name, previous_name, covers, dry_run)
    report.partitions = partitions
    return report


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
