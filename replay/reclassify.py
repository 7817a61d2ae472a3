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

from collections import Counter
from collections.abc import Callable, Iterable

import msgspec

from recorder.store.base import EventStore
from replay.load import iter_session_logs
from replay.reducer import reduce_session
from replay.rules import Rules
from replay.samples import SessionResult, digest_bytes, encode_result

SAMPLES_PREFIX = "samples/"
SUMMARY_PREFIX = "summary/"


class SessionSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What `reclassify` compares between runs for one session."""

    digest: str
    status: str
    segmentation: list[tuple[str, list[int], str | None]]
    sample_kinds: list[str]
    sample_statuses: list[str]
    trainable_tokens: int
    placeholder: bool


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
    )


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


async def reclassify(
    store: EventStore,
    rules: Rules,
    *,
    session_ids: Iterable[str] | None = None,
    page_size: int = 1000,
    dry_run: bool = False,
    batch: int = 256,
    on_session: Callable[[SessionResult], None] | None = None,
) -> ReclassifyReport:
    covers = await store.last_position()
    name, summary_name = projection_names_for(rules, covers)
    previous_name = await previous_summary_name(store, summary_name)
    previous: dict[str, SessionSummary] = {}
    if previous_name is not None:
        for sid, (_pos, _digest, payload) in (await store.load_projection(previous_name)).items():
            previous[sid] = _summary_decoder.decode(payload)
    report = ReclassifyReport(
        projection=name,
        summary_projection=summary_name,
        previous=previous_name,
        covers_position=covers,
        dry_run=dry_run,
    )
    kinds_after: Counter[str] = Counter()
    status_after: Counter[str] = Counter()
    seen: dict[str, SessionSummary] = {}
    # Keyed by session: a session yielded twice in one batch is written once.
    rows: dict[str, tuple[str, int, str, bytes]] = {}
    summary_rows: dict[str, tuple[str, int, str, bytes]] = {}

    async def flush() -> None:
        if not dry_run and rows:
            await store.save_projection(name, list(rows.values()))
            await store.save_projection(summary_name, list(summary_rows.values()))
        rows.clear()
        summary_rows.clear()

    async for log in iter_session_logs(
        store,
        page_size=page_size,
        until=covers,
        session_ids=session_ids,
        routed_experts=rules.routed_experts is not None,
    ):
        result = reduce_session(log.events, log.arrays, rules)
        payload = encode_result(result)
        digest = digest_bytes(payload)
        summary = summarize(result, digest)
        seen[log.session_id] = summary  # a later yield of a session supersedes
        sid = log.session_id
        rows[sid] = (sid, log.last_position, digest, payload)
        summary_rows[sid] = (sid, log.last_position, digest, _summary_encoder.encode(summary))
        if on_session is not None:
            on_session(result)
        if len(rows) >= batch:
            await flush()
    await flush()

    for sid, summary in seen.items():
        kinds_after.update(summary.sample_kinds)
        status_after.update(summary.sample_statuses)
        report.trainable_after += summary.trainable_tokens
        report.samples += len(summary.sample_kinds)
        before = previous.get(sid)
        if before is None:
            report.new_sessions += 1
            continue
        if before.digest != summary.digest:
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
