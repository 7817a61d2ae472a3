"""`replay stats`: what a log holds (sessions, turns, tokens, TITO, aborts, segments)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

import msgspec
from rich.table import Table

from recorder.log.events import (
    ClientDisconnected,
    EngineError,
    GenerateResult,
    RenderedInput,
    RequestRejected,
    SessionClosed,
    TitoVerdict,
    TurnAborted,
    TurnFailed,
)
from recorder.log.store.base import EventStore
from replay.load import SessionLog, iter_session_logs
from replay.partitions import PartStat
from replay.reducer import reduce_session
from replay.rules import Rules
from replay.samples import SessionResult


class SessionStats(msgspec.Struct, kw_only=True):
    turns: int = 0
    input_tokens: int = 0
    new_input_tokens: int = 0
    output_tokens: int = 0
    tito_checked: int = 0
    tito_failed: int = 0
    aborts: int = 0
    turn_failures: int = 0
    engine_errors: int = 0
    disconnects: int = 0
    rejected: int = 0
    close_status: str = "open"
    segment_kinds: list[str] = []
    sample_statuses: list[str] = []
    trainable_tokens: int = 0
    placeholder: bool = False
    fully_masked_samples: int = 0
    token_accounting: dict[str, int] = {}


class LogStats(msgspec.Struct, kw_only=True):
    rules_version: str
    sessions: int = 0
    turns: int = 0
    input_tokens: int = 0
    new_input_tokens: int = 0
    output_tokens: int = 0
    tito_checked: int = 0
    tito_failed: int = 0
    aborts: int = 0
    turn_failures: int = 0
    engine_errors: int = 0
    disconnects: int = 0
    rejected: int = 0
    close_status: dict[str, int] = {}
    segment_kinds: dict[str, int] = {}
    sample_statuses: dict[str, int] = {}
    samples: int = 0
    trainable_tokens: int = 0
    placeholders: int = 0
    fully_masked_samples: int = 0
    token_accounting: dict[str, int] = {}
    # session id -> its accounting (engine output = trained + untrained by reason)
    session_accounting: dict[str, dict[str, int]] = {}
    # Parallel runs: per worker, where it ran and its peak memory.
    partitions: list[PartStat] = []

    @property
    def tito_failure_rate(self) -> float | None:
        return self.tito_failed / self.tito_checked if self.tito_checked else None


def session_stats(log: SessionLog, result: SessionResult) -> SessionStats:
    st = SessionStats()
    turns: set[tuple[int, str]] = set()
    for rec in log.events:
        ev = rec.event
        match ev:
            case RenderedInput():
                turns.add((ev.turn, ev.request_id))
                st.input_tokens += ev.input_ids.length
                st.new_input_tokens += ev.input_ids.length - ev.prefix_len
            case GenerateResult():
                st.output_tokens += ev.output_ids.length
            case TitoVerdict():
                st.tito_checked += 1
                st.tito_failed += int(not ev.ok)
            case TurnAborted():
                st.aborts += 1
            case TurnFailed():
                st.turn_failures += 1
            case EngineError():
                st.engine_errors += 1
            case ClientDisconnected():
                st.disconnects += 1
            case RequestRejected():
                st.rejected += 1
            case SessionClosed():
                st.close_status = ev.status
    st.turns = len(turns)
    st.segment_kinds = [s.kind for s in result.segments if s.dropped is None]
    st.sample_statuses = [s.status for s in result.samples]
    st.trainable_tokens = sum(sum(s.loss_mask) for s in result.samples)
    st.placeholder = result.placeholder
    st.fully_masked_samples = sum(1 for s in result.samples if not any(s.loss_mask))
    st.token_accounting = dict(result.token_accounting)
    return st


def combine(per_session: dict[str, SessionStats], rules: Rules) -> LogStats:
    out = LogStats(rules_version=rules.version, sessions=len(per_session))
    close: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    accounting: Counter[str] = Counter()
    for sid, st in sorted(per_session.items()):  # the same whichever worker read them
        accounting.update(st.token_accounting)
        out.session_accounting[sid] = st.token_accounting
        out.fully_masked_samples += st.fully_masked_samples
        for name in (
            "turns",
            "input_tokens",
            "new_input_tokens",
            "output_tokens",
            "tito_checked",
            "tito_failed",
            "aborts",
            "turn_failures",
            "engine_errors",
            "disconnects",
            "rejected",
            "trainable_tokens",
        ):
            setattr(out, name, getattr(out, name) + getattr(st, name))
        close[st.close_status] += 1
        kinds.update(st.segment_kinds)
        statuses.update(st.sample_statuses)
        out.samples += len(st.sample_statuses)
        out.placeholders += int(st.placeholder)
    out.close_status = dict(sorted(close.items()))
    out.segment_kinds = dict(sorted(kinds.items()))
    out.sample_statuses = dict(sorted(statuses.items()))
    out.token_accounting = dict(sorted(accounting.items()))
    return out


async def log_stats(
    store: EventStore,
    rules: Rules,
    *,
    page_size: int = 1000,
    batch: int = 256,
    workers: int | None = 1,
    ray: str | None = None,
    on_session: Callable[[SessionResult], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> LogStats:
    """Every session reduced under `rules`, its statistics combined.

    `workers` > 1 (None: one per core, fewer for a small log) reduces in that
    many local processes, `ray` (an address, "" for Ray's default) in Ray
    tasks, each over a range of sessions (`replay.parallel`); the statistics
    are the one-process run's. `on_session` gets each result (one process
    only), `on_progress` the count of sessions done; `sizes`: the sessions and
    their numbers of events if the caller has listed them already.
    """
    if workers is not None and workers < 1:
        raise ValueError("workers must be >= 1")
    from replay import parallel

    workers, sizes = await parallel.resolve_workers(store, workers, ray, sizes)
    if workers != 1 or ray is not None:
        base = await parallel.whole_log_job(store, "stats", rules, page_size=page_size, batch=batch)
        results = await parallel.run_jobs(
            base, store, sizes, workers=workers, ray=ray, part_dir=None, on_progress=on_progress
        )
        combined = combine({sid: st for r in results for sid, st in r.stats.items()}, rules)
        combined.partitions = parallel.partition_stats(results)
        return combined
    per_session: dict[str, SessionStats] = {}
    async for log in iter_session_logs(store, page_size=page_size):
        result = reduce_session(log.events, log.arrays, rules)
        per_session[log.session_id] = session_stats(log, result)  # later yields supersede
        if on_session is not None:
            on_session(result)
        if on_progress is not None:
            on_progress(len(per_session))
    return combine(per_session, rules)


def stats_table(st: LogStats) -> Table:
    table = Table(title=f"log statistics (segments under rules {st.rules_version})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rate = st.tito_failure_rate
    rows = [
        ("sessions", st.sessions),
        ("sessions by close status", _fmt(st.close_status)),
        ("turns", st.turns),
        ("input tokens (sum over turns)", st.input_tokens),
        ("new input tokens (not reused)", st.new_input_tokens),
        ("output tokens", st.output_tokens),
        ("TITO checked / failed", f"{st.tito_checked} / {st.tito_failed}"),
        ("TITO failure rate", "n/a" if rate is None else f"{rate:.2%}"),
        ("aborted attempts", st.aborts),
        ("failed turns", st.turn_failures),
        ("engine errors", st.engine_errors),
        ("client disconnects", st.disconnects),
        ("rejected requests", st.rejected),
        ("segments by kind", _fmt(st.segment_kinds)),
        ("samples", st.samples),
        ("samples by status", _fmt(st.sample_statuses)),
        ("placeholder sessions", st.placeholders),
        ("fully masked samples (nothing to train)", st.fully_masked_samples),
        ("trainable tokens", st.trainable_tokens),
        ("engine output tokens = trained + untrained", _balance(st.token_accounting)),
    ]
    rows += [(f"  untrained: {k}", v) for k, v in _untrained(st.token_accounting).items()]
    for name, value in rows:
        table.add_row(name, str(value))
    return table


SESSION_ROWS = 50


def accounting_table(st: LogStats) -> Table:
    """Per session: engine output tokens = trained + untrained, with the reasons."""
    table = Table(title="engine output tokens per session (trained + untrained by reason)")
    for name, justify in (("session", "left"), ("engine output", "right"), ("trained", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    table.add_column("untrained by reason")
    for sid in sorted(st.session_accounting)[:SESSION_ROWS]:
        acc = st.session_accounting[sid]
        untrained = "; ".join(f"{k} {v}" for k, v in _untrained(acc).items()) or "—"
        table.add_row(sid, str(acc.get("engine output", 0)), str(acc.get("trained", 0)), untrained)
    if len(st.session_accounting) > SESSION_ROWS:
        table.caption = f"… and {len(st.session_accounting) - SESSION_ROWS} more sessions"
    return table


def _untrained(acc: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in acc.items() if k not in ("engine output", "trained") and v}


def _balance(acc: dict[str, int]) -> str:
    total, trained = acc.get("engine output", 0), acc.get("trained", 0)
    untrained = sum(_untrained(acc).values())
    mark = "ok" if total == trained + untrained else "MISMATCH"
    return f"{total} = {trained} + {untrained} ({mark})"


def _fmt(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "—"
