"""A training run's traffic through `recorder serve`: memory over long sessions, per-turn overhead.

`recorder serve` runs as a user runs it (a child process, SQLite log) in front
of the scripted engine (another child process, `keep_history=False`: it keeps
nothing per request and answers each call with a ~50-token tool call at once,
plus `--engine-latency-ms` of simulated GPU time). This process drives S
sessions shaped like Claude Code's: a large constant preamble (~2,000 words
of instructions and ~20 tools, ~15k tokens), billing header and metadata
constant within a session, history growing by tool results. Sessions take
turns round-robin, one turn in flight at a time, so each turn's engine time
is known exactly.

Each session is grown quickly (tool results of up to `--growth-tokens`) to
just below every checkpoint context, then takes `--point-turns` measured
turns there (`--turns` at the last checkpoint), each adding ~`--new-tokens`
(a tool result plus the model's call). Per round (every session one turn)
the server's RSS is read every `--rss-every` rounds.

Printed:
  overhead   per-turn middleware time at each checkpoint (client wall minus
             the engine's own `/generate` time), median and mean over the
             measured turns, and turns/s of the whole loop. Peer: the same
             server with its turn planner replaced (in that process only) by a
             full re-render + re-tokenize of the whole conversation every turn
             (`benchkit.peer.full_render_plan`, which checks it reproduces
             the chain's tokens), `--peer-sessions` sessions, `--peer-turns`
             measured turns per checkpoint, measured in the same run.
  memory     RSS of the server every `--rss-every` rounds at the last
             checkpoint, its growth per round and per turn served (least
             squares over the samples after the first), RSS before the
             sessions opened, with all S sessions at the last checkpoint
             (per open session: the difference / S) and after they closed.
Target: growth per turn served < 50 kB at 100k tokens after warm-up, beyond
what the configured caches may still take (`--piece-cache-mb`,
`--sqlite-cache-mb` are passed to `recorder serve`: SQLite's page caches fill
as the log grows, up to their bound).

    python -m tools.bench_training [--sessions 16] [--contexts 10000,50000,100000]
        [--turns 100] [--point-turns 30] [--new-tokens 250] [--rss-every 10]
        [--peer-sessions 1] [--peer-turns 30] [--no-peer] [--engine-latency-ms 0]
        [--before-src DIR]

`--before-src DIR` (another checkout, e.g. `git worktree add --detach DIR main`)
runs that checkout's `recorder serve` through the same sessions in the same
run, after this one's, and adds its column to the log table (before/after).
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from rich.table import Table

from tools.benchkit import wire
from tools.benchkit.conversation import FIXED_TOKENS_PER_TURN, Conversation, words_per_token
from tools.benchkit.engine import EngineProcess, fixture_tokenizer
from tools.benchkit.memory import MB
from tools.benchkit.procs import REPO
from tools.benchkit.recorder import ADMIN, RecorderProcess, idle_rss
from tools.benchkit.stats import engine_seconds, ints, slope
from tools.benchkit.table import console, rich_table

# --------------------------------------------------------------------------
# Sessions
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    started: float
    ended: float
    context: int  # prompt tokens of this turn


class Driver:
    """Opens sessions on one recorder and takes their turns, one at a time."""

    def __init__(
        self, http: aiohttp.ClientSession, recorder: RecorderProcess, args: argparse.Namespace
    ) -> None:
        self.http = http
        self.recorder = recorder
        self.args = args
        self.sessions: list[tuple[str, Conversation]] = []
        self.context: dict[str, int] = {}  # prompt + output tokens after the last turn

    async def open(self, seed: int) -> str:
        session_id = await wire.open_session(self.http, self.recorder.url, ADMIN)
        conversation = Conversation(
            seed, instructions_words=self.args.instructions_words, n_tools=self.args.tools
        )
        self.sessions.append((session_id, conversation))
        self.context[session_id] = 0
        return session_id

    async def close_all(self) -> None:
        for session_id, _ in self.sessions:
            closed = {"status": "completed"}
            await wire.close_session(self.http, self.recorder.url, ADMIN, session_id, closed)
        self.sessions = []
        self.context = {}

    async def turn(self, session_id: str, conversation: Conversation, words: int | None) -> Sample:
        answered = await wire.take_turn(
            self.http, self.recorder.url, session_id, conversation, words
        )
        usage = answered.usage
        prompt = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
        self.context[session_id] = prompt + usage.get("output_tokens", 0)
        return Sample(answered.started, answered.ended, prompt)

    async def round(self, words: int | None) -> list[Sample]:
        return [await self.turn(sid, conv, words) for sid, conv in self.sessions]

    async def grow_to(self, target: int, words_per_token: float) -> None:
        """Turns with large tool results until every session is just below `target`."""
        for session_id, conversation in self.sessions:
            while True:
                missing = target - self.context[session_id] - FIXED_TOKENS_PER_TURN
                if missing <= self.args.new_tokens:
                    break
                n = min(missing, self.args.growth_tokens)
                await self.turn(session_id, conversation, max(1, round(n * words_per_token)))


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


@dataclass
class Point:
    target: int
    samples: list[Sample] = field(default_factory=list)
    engine_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    # (round, mean context, RSS bytes, anonymous RSS bytes)
    rss: list[tuple[int, int, int, int]] = field(default_factory=list)

    def overhead_ms(self) -> list[float]:
        return [
            (s.ended - s.started - e) * 1000
            for s, e in zip(self.samples, self.engine_s, strict=True)
        ]


@dataclass(frozen=True)
class LogBytes:
    """A live log's bytes by kind, and the context tokens its sessions reached."""

    context_tokens: int  # sum over the sessions of each one's last context
    ids: int  # int32 arrays: engine inputs, outputs, chain snapshots (compressed)
    bodies: int  # uint8 arrays: raw request bodies (compressed, deltas)
    other_arrays: int  # float arrays (logprobs)
    events: int  # event payloads
    db_file: int  # the database file
    wal_file: int  # its WAL
    # Pages of the database (as of the newest commit) by table or index:
    # name -> (bytes of pages, bytes of their stored payload)
    pages: dict[str, tuple[int, int]] = field(default_factory=dict)
    free_pages: int = 0  # bytes of pages on the freelist

    @property
    def file(self) -> int:
        return self.db_file + self.wal_file


def read_log_bytes(db: Path, context_tokens: int) -> LogBytes:
    """Sizes of what the log stores, read from its SQLite file (the server may still run)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        by_dtype = dict(
            conn.execute(
                "SELECT dtype, SUM(LENGTH(data) + IFNULL(LENGTH(data_tail), 0)) "
                "FROM arrays GROUP BY dtype"
            ).fetchall()
        )
        (events,) = conn.execute("SELECT IFNULL(SUM(LENGTH(payload)), 0) FROM events").fetchone()
        pages = {
            name: (int(size), int(payload))
            for name, size, payload in conn.execute(
                "SELECT name, SUM(pgsize), SUM(payload) FROM dbstat GROUP BY name"
            )
        }
        ((free,),) = conn.execute("PRAGMA freelist_count").fetchall()
        ((page_size,),) = conn.execute("PRAGMA page_size").fetchall()
    finally:
        conn.close()
    wal = db.with_name(db.name + "-wal")
    return LogBytes(
        context_tokens,
        ids=int(by_dtype.pop("int32", 0) or 0),
        bodies=int(by_dtype.pop("uint8", 0) or 0),
        other_arrays=int(sum(v or 0 for v in by_dtype.values())),
        events=int(events),
        db_file=db.stat().st_size,
        wal_file=wal.stat().st_size if wal.exists() else 0,
        pages=pages,
        free_pages=int(free) * int(page_size),
    )


@dataclass
class Run:
    name: str
    sessions: int
    points: list[Point] = field(default_factory=list)
    rss_before: int = 0
    rss_open: int = 0  # all sessions grown to the last checkpoint
    rss_end: int = 0
    rss_closed: int = 0
    log: LogBytes | None = None  # the SQLite log's bytes, read after the measured turns

    def growth_per_round(self) -> float:
        """Least-squares RSS slope (bytes per round) at the last checkpoint, first sample left out."""
        rss = self.points[-1].rss[1:]
        return slope([r[0] for r in rss], [r[2] for r in rss])


async def _engine_times(engine: EngineProcess, samples: list[Sample]) -> list[float]:
    """Each turn's engine time: the `/generate` spans inside its wall interval."""
    spans = await engine.fetch_spans()
    return [engine_seconds(spans, s.started, s.ended, "a turn") for s in samples]


async def run_server(
    engine: EngineProcess,
    args: argparse.Namespace,
    *,
    peer: bool,
    db_dir: str,
    root: Path | None = None,
) -> Run:
    sessions = args.peer_sessions if peer else args.sessions
    run = Run("peer" if peer else "before" if root else "ours", sessions)
    db = str(Path(db_dir) / f"{run.name}.db")
    extra = ["--context-length", str(args.context_length), "--log-level", "WARNING"]
    if args.piece_cache_mb is not None:
        extra += ["--piece-cache-mb", str(args.piece_cache_mb)]
    if args.sqlite_cache_mb is not None:
        extra += ["--sqlite-cache-mb", str(args.sqlite_cache_mb)]
    recorder = RecorderProcess(engine.url, db, extra, peer=peer, root=root or REPO)
    timeout = aiohttp.ClientTimeout(total=600)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await recorder.wait_healthy(http)
            driver = Driver(http, recorder, args)
            wpt = words_per_token(fixture_tokenizer())
            step_words = max(1, round((args.new_tokens - FIXED_TOKENS_PER_TURN) * wpt))
            # Warm-up: one session of a few turns, closed, as a run's first episode would be.
            warm = await driver.open(10_000)
            for k in range(3):
                await driver.turn(warm, driver.sessions[0][1], None if k == 0 else step_words)
            warm_context = driver.context[warm]
            await driver.close_all()
            run.rss_before = recorder.rss()
            for i in range(sessions):
                await driver.open(i)
            await driver.round(None)
            contexts = sorted(args.contexts)
            for n, target in enumerate(contexts):
                last = n == len(contexts) - 1
                turns = args.peer_turns if peer else args.turns if last else args.point_turns
                await driver.grow_to(target - turns * args.new_tokens // 2, wpt)
                if last:
                    run.rss_open = recorder.rss()
                point = Point(target)
                t0 = time.perf_counter()
                for k in range(turns):
                    if k % args.rss_every == 0:
                        point.rss.append(_sample(k, driver, recorder))
                    point.samples += await driver.round(step_words)
                point.wall_s = time.perf_counter() - t0
                point.rss.append(_sample(turns, driver, recorder))
                point.engine_s = await _engine_times(engine, point.samples)
                run.points.append(point)
            run.rss_end = recorder.rss()
            reached = warm_context + sum(driver.context.values())
            run.log = await asyncio.to_thread(read_log_bytes, Path(db), reached)
            if args.keep_db and run.name == "ours":
                await asyncio.to_thread(_copy_db, Path(db), Path(args.keep_db))
            await driver.close_all()
            await asyncio.sleep(0.5)
            run.rss_closed = recorder.rss()
    finally:
        await recorder.stop()
    return run


def _copy_db(db: Path, to: Path) -> None:
    """A consistent copy of the live log (its WAL folded in), for a look at its rows."""
    src = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    dst = sqlite3.connect(to)
    try:
        src.backup(dst)
    finally:
        dst.close()
        src.close()


def _sample(k: int, driver: Driver, recorder: RecorderProcess) -> tuple[int, int, int, int]:
    context = round(statistics.fmean(driver.context.values()))
    return k, context, recorder.rss(), recorder.anon()


async def idle_rss_rounds(engine: EngineProcess, db_dir: str, rounds: int) -> dict[str, list[int]]:
    """Idle RSS per parser backend, the backends alternating for `rounds` rounds."""
    out: dict[str, list[int]] = {"default": [], "builtin": []}
    for _ in range(rounds):
        out["default"].append(await idle_rss(engine.url, f"{db_dir}/idle-default.db", None))
        out["builtin"].append(await idle_rss(engine.url, f"{db_dir}/idle-builtin.db", "builtin"))
    return out


async def run_all(args: argparse.Namespace) -> tuple[list[Run], dict[str, list[int]]]:
    engine = EngineProcess(args.context_length, args.engine_latency_ms / 1000)
    await engine.start()
    runs = []
    try:
        with tempfile.TemporaryDirectory(dir=args.db_dir) as tmp:
            idle = await idle_rss_rounds(engine, tmp, args.idle_rounds)
            runs.append(await run_server(engine, args, peer=False, db_dir=tmp))
            if args.peer:
                runs.append(await run_server(engine, args, peer=True, db_dir=tmp))
            if args.before_src:
                before = Path(args.before_src).resolve()
                runs.append(await run_server(engine, args, peer=False, db_dir=tmp, root=before))
    finally:
        await engine.stop()
    return runs, idle


# --------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------


def overhead_table(ours: Run, peer: Run | None) -> Table:
    title = (
        f"per-turn middleware ms (client wall - engine time), {ours.sessions} sessions "
        "round-robin; peer = the same server re-rendering + re-tokenizing the whole "
        f"conversation every turn ({peer.sessions if peer else 0} session(s))"
    )
    cols = ("context tok", "turns", "engine ms", "ours p50", "ours mean", "turns/s")
    cols += ("peer turns", "peer p50", "ratio p50") if peer else ()
    rows = []
    for i, point in enumerate(ours.points):
        ms = point.overhead_ms()
        row = [
            f"{statistics.fmean(s.context for s in point.samples):,.0f}",
            f"{len(ms)}",
            f"{statistics.median(point.engine_s) * 1000:.1f}",
            f"{statistics.median(ms):.1f}",
            f"{statistics.fmean(ms):.1f}",
            f"{len(ms) / point.wall_s:.1f}",
        ]
        if peer:
            peer_ms = peer.points[i].overhead_ms()
            ratio = statistics.median(peer_ms) / statistics.median(ms)
            row += [f"{len(peer_ms)}", f"{statistics.median(peer_ms):.1f}", f"{ratio:.1f}x"]
        rows.append(row)
    return rich_table(title, cols, rows)


def rss_table(run: Run) -> Table:
    point = run.points[-1]
    title = (
        f"{run.name}: server RSS every {point.rss[1][0] if len(point.rss) > 1 else 0} "
        f"rounds at the last checkpoint ({run.sessions} sessions, one turn each per round)"
    )
    cols = ("round", "turns served", "mean context tok", "RSS MB", "vs round 0 MB", "anon MB")
    base = point.rss[0][2]
    rows = [
        (
            f"{k}",
            f"{k * run.sessions}",
            f"{context:,}",
            f"{rss / MB:.1f}",
            f"{(rss - base) / MB:+.1f}",
            f"{anon / MB:.1f}",
        )
        for k, context, rss, anon in point.rss
    ]
    return rich_table(title, cols, rows)


def memory_table(run: Run, args: argparse.Namespace) -> Table:
    piece = 256.0 if args.piece_cache_mb is None else args.piece_cache_mb
    sqlite = 64.0 if args.sqlite_cache_mb is None else args.sqlite_cache_mb
    title = (
        f"{run.name}: memory; configured caches: pieces {piece:g} MB, SQLite pages "
        f"{sqlite:g} MB (writer) + {sqlite / 4:g} MB per reader connection"
    )
    growth = run.growth_per_round()
    rows = [
        ("RSS before the sessions opened", f"{run.rss_before / MB:.1f} MB"),
        (
            f"RSS with {run.sessions} sessions at the last checkpoint",
            f"{run.rss_open / MB:.1f} MB",
        ),
        ("per open session", f"{(run.rss_open - run.rss_before) / run.sessions / MB:.2f} MB"),
        ("RSS after the measured turns", f"{run.rss_end / MB:.1f} MB"),
        ("RSS after every session closed", f"{run.rss_closed / MB:.1f} MB"),
        ("growth per round (after warm-up)", f"{growth / 1024:.1f} kB"),
        ("growth per turn served", f"{growth / run.sessions / 1024:.1f} kB"),
    ]
    return rich_table(title, ("what", "value"), rows, left=1)


def idle_table(idle: dict[str, list[int]]) -> Table:
    title = (
        "idle RSS of `recorder serve` (started, healthy, no session; median over the rounds, "
        "backends alternating); baseline: the builtin parser backend, same run"
    )
    default, builtin = (statistics.median(idle[k]) for k in ("default", "builtin"))
    rows = [
        (
            f"{len(idle['default'])}",
            f"{default / MB:.1f} MB",
            f"{builtin / MB:.1f} MB",
            f"{(default - builtin) / MB:+.1f} MB",
        )
    ]
    cols = ("rounds", "default backend (sglang)", "builtin backend", "sglang's parsers cost")
    return rich_table(title, cols, rows)


def _log_kinds(log: LogBytes) -> list[tuple[str, int]]:
    n = max(log.context_tokens, 1)
    kinds = [
        ("token ids (int32 arrays, compressed)", log.ids),
        ("request bodies (uint8 arrays, compressed)", log.bodies),
        ("other arrays (logprobs)", log.other_arrays),
        ("event payloads", log.events),
    ]
    kinds += [
        (f"pages of {name} (payload {payload / n:.2f} B/token)", size)
        for name, (size, payload) in sorted(log.pages.items(), key=lambda kv: -kv[1][0])
        if size
    ]
    kinds += [
        ("free pages", log.free_pages),
        ("database file", log.db_file),
        ("WAL file", log.wal_file),
        ("database file + WAL", log.file),
    ]
    return kinds


def log_table(run: Run, before: Run | None = None) -> Table:
    """The log's bytes by kind; with `before`, that checkout's beside them (same traffic)."""
    log = run.log
    assert log is not None
    n = max(log.context_tokens, 1)
    title = (
        f"{run.name}: the live SQLite log after the measured turns, bytes per context token "
        f"({log.context_tokens:,} tokens: the sum of every session's last context)"
    )
    cols = ("kind", "bytes", "bytes / context token")
    kinds = _log_kinds(log)
    if before is None or before.log is None:
        rows = [(what, f"{size / 1e6:.2f} MB", f"{size / n:.2f}") for what, size in kinds]
        return rich_table(title, cols, rows, left=1)
    # Page rows carry their payload in the label: match on the table name alone.
    then = {what.split(" (payload")[0]: size for what, size in _log_kinds(before.log)}
    m = max(before.log.context_tokens, 1)
    title += f"; before: --before-src, same sessions ({before.log.context_tokens:,} tokens)"
    cols += ("before B / token", "change")
    rows = []
    for what, size in kinds:
        old = then.get(what.split(" (payload")[0])
        change = f"{(size / n) / (old / m) - 1:+.0%}" if old else ""
        old_s = f"{old / m:.2f}" if old is not None else ""
        rows.append((what, f"{size / 1e6:.2f} MB", f"{size / n:.2f}", old_s, change))
    return rich_table(title, cols, rows, left=1)


def main(argv: list[str] | None = None) -> list[Run]:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--contexts", type=ints, default=[10_000, 50_000, 100_000])
    ap.add_argument("--turns", type=int, default=100, help="measured rounds at the last context")
    ap.add_argument("--point-turns", type=int, default=30, help="measured rounds at the others")
    ap.add_argument("--new-tokens", type=int, default=250, help="context growth per measured turn")
    ap.add_argument("--growth-tokens", type=int, default=8000, help="largest growth turn")
    ap.add_argument("--rss-every", type=int, default=10, help="rounds between RSS samples")
    ap.add_argument("--instructions-words", type=int, default=2000)
    ap.add_argument("--tools", type=int, default=16, help="tools besides Read/Bash/Edit/Grep")
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--peer-sessions", type=int, default=1)
    ap.add_argument("--peer-turns", type=int, default=30)
    ap.add_argument("--engine-latency-ms", type=float, default=0.0)
    ap.add_argument("--context-length", type=int, default=0, help="default: fits the run")
    ap.add_argument("--db-dir", default=None, help="where the SQLite files go")
    ap.add_argument("--piece-cache-mb", type=float, default=None, help="recorder serve's")
    ap.add_argument("--sqlite-cache-mb", type=float, default=None, help="recorder serve's")
    ap.add_argument("--keep-db", default=None, help="copy the measured log here")
    ap.add_argument(
        "--idle-rounds",
        type=int,
        default=3,
        help="idle RSS rounds per backend (0: leave the idle table out)",
    )
    ap.add_argument("--before-src", default=None, help="another checkout, run after this one")
    args = ap.parse_args(argv)
    if not args.context_length:
        top = max(args.contexts) + (args.turns + 2) * args.new_tokens
        args.context_length = int(top * 1.3) + 8192
    runs, idle = asyncio.run(run_all(args))
    out = console()
    if args.idle_rounds > 0:
        out.print(idle_table(idle))
    ours = runs[0]
    peer = next((r for r in runs if r.name == "peer"), None)
    before = next((r for r in runs if r.name == "before"), None)
    out.print(overhead_table(ours, peer))
    out.print(rss_table(ours))
    out.print(memory_table(ours, args))
    out.print(log_table(ours, before))
    return runs


if __name__ == "__main__":
    main()
