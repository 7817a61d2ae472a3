"""The runs index: one summary row per session, folded from the log as it grows.

The log keeps no per-session summary table, and a row needs facts only the
event payloads hold (status, reward, TITO verdicts, the rollout's outcome).
So the viewer folds every event once, in position order, into a small
`RunRow` per session, and on each request folds only the events appended
since (position ranges after the last one read): a live log costs one short
read per page view, never a re-scan, and never a reduction. Only the events
a row shows are read and decoded (`DECODED`), in position order. Trained tokens come from the
newest `replay reclassify` summary projection when one exists (the runs page
reduces nothing); the session page reduces its one session.

Filtering, sorting and paging then run over these rows in memory: 10,000
rows sort in a few milliseconds, well under what a SQL round trip costs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import sqlalchemy as sa

from recorder.log.events import (
    decode_event,
)
from recorder.log.store.base import EventStore
from recorder.log.store.tables import events
from replay.reclassify import SUMMARY_PREFIX, SessionSummary

PAGE = 5000  # events per read while catching up


@dataclass(slots=True)
class RunRow:
    """What the runs page shows of one session."""

    session_id: str
    first_ts: float = 0.0
    last_ts: float = 0.0
    last_position: int = 0
    status: str = "open"
    reason: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None
    turns: set[int] = field(default_factory=set)
    input_tokens: int = 0  # new (not reused) engine input tokens, summed over turns
    output_tokens: int = 0
    tito_checked: int = 0
    tito_failed: int = 0
    engine_errors: int = 0
    aborts: int = 0
    failed: str = ""  # SessionFailed / rollout infra cause
    passed: bool | None = None  # the rollout grader's verdict
    infra_cause: str = ""
    trained: int | None = None  # from the newest summary projection

    @property
    def n_turns(self) -> int:
        return len(self.turns)

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    @property
    def duration(self) -> float:
        return max(0.0, self.last_ts - self.first_ts)

    @property
    def trained_share(self) -> float | None:
        if self.trained is None or not self.output_tokens:
            return None
        return self.trained / self.output_tokens

    @property
    def outcome(self) -> str:
        """passed / failed (the grader's word), infra:<cause>, or the session's status."""
        if self.infra_cause:
            return f"infra:{self.infra_cause}"
        if self.passed is not None:
            return "passed" if self.passed else "failed"
        if self.status in ("open", "completed"):
            return "" if self.reward is None else ("passed" if self.reward > 0 else "failed")
        return self.status

    @property
    def instance(self) -> str:
        return str(self.metadata.get("instance_id", ""))

    @property
    def group(self) -> str:
        """The rollout group (samples of one task drawn together), or ""."""
        if "instance_id" not in self.metadata:
            return str(self.metadata.get("group", ""))
        return f"{self.metadata['instance_id']}#g{self.metadata.get('group_index', 0)}"

    def haystack(self) -> str:
        meta = " ".join(f"{k}={v}" for k, v in self.metadata.items())
        return f"{self.session_id} {meta}".lower()


# The fold reads only these events; the rest of a session (requests, chain
# decisions, attempts, responses: most of its ~6 events per turn) is never
# read, decoded or folded. A session's duration runs from its first to its
# last event of these types (open sessions: to the last answer's result).
DECODED = (
    "session_opened",
    "session_closed",
    "session_failed",
    "rendered_input",
    "generate_result",
    "tito_verdict",
    "engine_error",
    "turn_aborted",
    "reward_assigned",
    "sandbox_event",
)
SPAN = 50_000  # positions per catch-up step
# How long a page waits for a fold under way before it shows the rows so far:
# a small log's build ends within it; a big one's (10,000 x 40 turns: ~24 s)
# shows progress instead of a blank wait.
GRACE = 0.5

_DECODED = (
    sa.select(
        events.c.position,
        events.c.session_id,
        events.c.type,
        events.c.version,
        events.c.ts,
        events.c.payload,
    )
    .where(
        events.c.position > sa.bindparam("after"),
        events.c.position <= sa.bindparam("until"),
        events.c.type.in_(DECODED),
    )
    .order_by(events.c.position)
)


def _opened(row: RunRow, ev: Any) -> None:
    row.metadata = dict(ev.metadata)
    row.status, row.reason = "open", ""


def _closed(row: RunRow, ev: Any) -> None:
    row.status, row.reason = ev.status, ev.reason


def _failed(row: RunRow, ev: Any) -> None:
    row.failed = f"{ev.where}: {ev.error_type}"


def _rendered(row: RunRow, ev: Any) -> None:
    row.input_tokens += ev.input_ids.length - ev.prefix_len


def _result(row: RunRow, ev: Any) -> None:
    row.turns.add(ev.turn)
    row.output_tokens += ev.output_ids.length


def _tito(row: RunRow, ev: Any) -> None:
    row.tito_checked += 1
    row.tito_failed += 0 if ev.ok else 1


def _engine_error(row: RunRow, ev: Any) -> None:
    row.engine_errors += 1


def _aborted(row: RunRow, ev: Any) -> None:
    row.aborts += 1


def _reward(row: RunRow, ev: Any) -> None:
    row.reward = ev.reward


def _sandbox(row: RunRow, ev: Any) -> None:
    if ev.kind == "eval_result":
        row.passed = bool(ev.detail.get("passed"))
    elif ev.kind == "failed":
        row.infra_cause = str(ev.detail.get("cause", "unknown"))


_FOLD = {
    "session_opened": _opened,
    "session_closed": _closed,
    "session_failed": _failed,
    "rendered_input": _rendered,
    "generate_result": _result,
    "tito_verdict": _tito,
    "engine_error": _engine_error,
    "turn_aborted": _aborted,
    "reward_assigned": _reward,
    "sandbox_event": _sandbox,
}
assert set(_FOLD) == set(DECODED)


def fold(row: RunRow, position: int, ts: float, type_: str, ev: Any) -> None:
    """Add one event of a `DECODED` type to its session's row (pure)."""
    if not row.first_ts or ts < row.first_ts:
        row.first_ts = ts
    if ts > row.last_ts:
        row.last_ts = ts
    if position > row.last_position:
        row.last_position = position
    _FOLD[type_](row, ev)


class RunIndex:
    """Every session's `RunRow`, kept current with the log (see the module docstring)."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.rows: dict[str, RunRow] = {}
        self.position = 0
        self.projection: str | None = None
        self.head = 0  # the log position the running (or last) fold heads for
        self.span = SPAN
        self._lock = asyncio.Lock()
        self._idle = asyncio.Event()  # set while no fold runs
        self._idle.set()

    @property
    def indexing(self) -> bool:
        """A fold is under way and has not reached `head` yet (the first build
        of a big log takes a while: see tools/bench_view.py)."""
        return self._lock.locked() and (not self.head or self.position < self.head)

    async def current(self) -> int:
        """`refresh`, unless a fold is already under way: then wait for it at
        most `GRACE` seconds and answer with the position folded so far. Pages
        use this, so the startup build of a big log never keeps a page waiting
        (they show the rows indexed so far), while a small log's page is whole."""
        if self._lock.locked():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), GRACE)
            if self._lock.locked():
                return self.position
        return await self.refresh()

    async def refresh(self, *, until: int | None = None) -> int:
        """Fold the events appended since the last call (up to `until`, if
        given); returns the log position folded."""
        async with self._lock:
            self._idle.clear()
            try:
                return await self._fold(until)
            finally:
                self._idle.set()

    async def _fold(self, until: int | None) -> int:
        engine = self.store.read_engine  # type: ignore[attr-defined]
        self.head = await self.store.last_position()
        stop = self.head if until is None else min(until, self.head)
        while self.position < stop:
            span = {"after": self.position, "until": min(stop, self.position + self.span)}
            async with engine.connect() as conn:
                decoded = (await conn.execute(_DECODED, span)).all()
            rows = self.rows
            for position, sid, type_, version, ts, payload in decoded:
                row = rows.get(sid)
                if row is None:
                    row = rows[sid] = RunRow(sid)
                fold(row, position, ts, type_, decode_event(type_, version, payload))
            self.position = span["until"]
        await self._load_trained()
        return self.position

    async def _load_trained(self) -> None:
        names = [n for n in await self.store.projection_names() if n.startswith(SUMMARY_PREFIX)]
        newest = names[-1] if names else None
        if newest == self.projection:
            return
        self.projection = newest
        rows = await self.store.load_projection(newest) if newest else {}
        decoder = msgspec.msgpack.Decoder(SessionSummary)
        for row in self.rows.values():
            row.trained = None
        for sid, (_covers, _digest, payload) in rows.items():
            if sid in self.rows:
                self.rows[sid].trained = decoder.decode(payload).trainable_tokens


# -------------------------------------------------------------- querying


SORT_KEYS: dict[str, Any] = {
    "started": lambda r: r.first_ts,
    "session": lambda r: r.session_id,
    "status": lambda r: r.status,
    "outcome": lambda r: r.outcome,
    "reward": lambda r: -1e18 if r.reward is None else r.reward,
    "turns": lambda r: r.n_turns,
    "tokens": lambda r: r.tokens,
    "trained": lambda r: -1.0 if r.trained_share is None else r.trained_share,
    "tito": lambda r: r.tito_failed,
    "errors": lambda r: r.engine_errors,
    "duration": lambda r: r.duration,
    "group": lambda r: (r.group, r.first_ts),
}


@dataclass(slots=True)
class Query:
    status: str = ""
    outcome: str = ""
    instance: str = ""
    group: str = ""
    text: str = ""
    sort: str = "started"
    desc: bool = True
    page: int = 0
    per_page: int = 50

    @classmethod
    def from_params(cls, params: Any) -> Query:
        def num(name: str, default: int, hi: int) -> int:
            try:
                return max(0, min(hi, int(params.get(name, default))))
            except ValueError:
                return default

        sort = params.get("sort", "started")
        return cls(
            status=params.get("status", ""),
            outcome=params.get("outcome", ""),
            instance=params.get("instance", ""),
            group=params.get("group", ""),
            text=params.get("q", ""),
            sort=sort if sort in SORT_KEYS else "started",
            desc=params.get("dir", "desc") != "asc",
            page=num("page", 0, 10**9),
            per_page=num("per", 50, 1000) or 50,
        )


def select(rows: Iterable[RunRow], q: Query) -> list[RunRow]:
    """The rows matching `q`'s filters, sorted (paging is the caller's slice)."""
    text = q.text.lower()
    out = [
        r
        for r in rows
        if (not q.status or r.status == q.status)
        and (not q.outcome or r.outcome == q.outcome or r.outcome.startswith(q.outcome + ":"))
        and (not q.instance or r.instance == q.instance)
        and (not q.group or r.group == q.group)
        and (not text or text in r.haystack())
    ]
    out.sort(key=SORT_KEYS[q.sort], reverse=q.desc)
    return out


@dataclass(slots=True)
class Group:
    name: str
    rows: list[RunRow]

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rows if r.reward is not None]

    @property
    def spread(self) -> tuple[float, float, float] | None:
        """(min, mean, max) reward of the group, None without rewards."""
        rw = self.rewards
        return (min(rw), sum(rw) / len(rw), max(rw)) if rw else None


def group_rows(rows: list[RunRow]) -> list[Group]:
    """Consecutive runs of one rollout group (in the page's order), ungrouped as ""."""
    groups: list[Group] = []
    for r in rows:
        if groups and groups[-1].name == r.group:
            groups[-1].rows.append(r)
        else:
            groups.append(Group(r.group, [r]))
    return groups
