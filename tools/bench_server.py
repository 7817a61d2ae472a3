"""Throughput and overhead of the live recorder under many concurrent sessions.

Runs the scripted engine (zero latency, keeping nothing per request) and
`recorder serve` as subprocesses, then drives N concurrent sessions x T turns
of a growing conversation through the real HTTP server from this process (raw
aiohttp, no SDK overhead); a single session first takes max(30, 3T) turns. The
baseline, measured in the same run at the same concurrency, is the same
number of `/generate` calls sent straight to the engine with the same token
counts. Middleware overhead per turn = client-observed latency minus the
engine time the recorder measured for that turn (GenerateResult.latency_s).

`--context N` makes every session's first message ~N tokens long (that first
turn is taken by all sessions before the clock starts), so the measured
turns run at ~N tokens of context. `--workers N` runs `recorder serve
--workers N` (Postgres `--db` only). Each phase prints per-core utilisation
(from /proc/stat), the CPU per turn of the recorder (all its processes and
threads), the engine and this load generator, and (the cores are shared with
other users' processes) our processes' share of the box beside the others',
with the rate the measured CPU per turn allows on two cores of our own.

Before/after in one run: `--before-src DIR` (another checkout, e.g. `git
worktree add --detach DIR main`) runs that recorder beside this one, and
`--inline on|off|both` sets this checkout's SQLite inline commits
(`TR_SQLITE_INLINE_WRITES`); `--sessions 64,128` measures each count, the
recorders taking turns per count, each on a fresh server and database.

    python tools/bench_server.py [--sessions 128] [--turns 8] [--db PATH|URL]
        [--context 100000] [--workers 2] [--before-src DIR] [--inline both]
        [--no-single]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import click
import numpy as np
import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python tools/...`

from recorder.log import events as ev
from recorder.log.store import open_store
from recorder.log.store.sqlite import INLINE_ENV
from tools.benchkit import wire
from tools.benchkit.cpu import machine_state
from tools.benchkit.engine import start_test_engine
from tools.benchkit.lean_engine import start_lean_engine
from tools.benchkit.procs import REPO
from tools.benchkit.recorder import ADMIN, RecorderProcess
from tools.benchkit.stats import pct
from tools.benchkit.table import Columns

ENGINES = {
    "lean": "lean engine (a canned /generate, tools/benchkit/lean_engine.py)",
    "scripted": "scripted test engine",
}
TABLE = Columns(
    [
        ("sessions x turns", 17, "<"), ("path", 28, "<"), ("turns", 6, ">"), ("err", 5, ">"),
        ("turns/s", 9, ">"), ("p50 ms", 8, ">"), ("p99 ms", 8, ">"), ("ovh p50", 9, ">"),
        ("ovh p99", 9, ">"), ("cpu ms/turn", 12, ">"),
    ]
)  # fmt: skip


@dataclass
class Run:
    latencies: list[float] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    engine_cpu_s: float = 0.0  # the engine process's CPU in the same phase
    client_cpu_s: float = 0.0  # this process's (the load generator's)
    cores: list[float] = field(default_factory=list)  # busy fraction per core


def core_ticks() -> list[tuple[int, int]]:
    """(busy, total) jiffies per core from /proc/stat."""
    out = []
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            values = [int(v) for v in fields]
            idle = values[3] + values[4]  # idle + iowait
            out.append((sum(values) - idle, sum(values)))
    return out


def utilisation(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[float]:
    return [(b1 - b0) / max(1, t1 - t0) for (b0, t0), (b1, t1) in zip(before, after, strict=True)]


def process_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and its children (the workers), all threads."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    return sum(sum(p.cpu_times()[:2]) for p in procs)


@dataclass(frozen=True)
class Engine:
    url: str
    pid: int


class Session:
    """One session's conversation: `prelude_words` of context in its first message.

    Its messages are kept as the JSON they are sent as, so a turn's ~0.5 MB body at
    100k tokens is one join of bytes (the load generator's CPU is on the same cores
    as the recorder's: `json=` re-encoding the whole conversation every turn cost
    more than the recorder did).
    """

    def __init__(self, index: int, prelude_words: int) -> None:
        self.index = index
        self.prelude = " ".join(["word"] * prelude_words)
        self.messages: list[bytes] = []  # each message's JSON, as sent
        self.sid = ""
        self.turn = 0

    def body(self, message: bytes, *, stream: bool) -> bytes:
        """`json.dumps` of the request with `message` (its `json.dumps`) after the messages
        so far, byte for byte: what `http.post(json=...)` sent before the bodies were
        pre-encoded. "stream" comes after the messages, as there: turns alternate it, and
        before the messages it would end every body's shared prefix with the previous
        one at byte 40 (the recorder would store each ~0.5 MB body whole, not as a delta).

        One join of the kept pieces, so the ~0.5 MB at 100k tokens is copied once a turn
        (concatenating the messages, then the body, copied it 4 times: a third of this
        process's CPU)."""
        pieces = [b'{"model": "bench", "max_tokens": 64, "messages": [']
        for encoded in (*self.messages, message):
            pieces += (encoded, b", ")
        pieces[-1] = b'], "stream": true}' if stream else b'], "stream": false}'
        return b"".join(pieces)


def encode_message(message: dict[str, Any]) -> bytes:
    """A message's JSON as `json.dumps` writes it inside the request (see `Session.body`)."""
    return json.dumps(message).encode()


async def recorder_session(
    http: aiohttp.ClientSession,
    url: str,
    index: int,
    turns: int,
    run: Run,
    session: Session | None = None,
) -> list[int]:
    if session is None:
        session = Session(index, 0)
    if not session.sid:
        session.sid = await wire.open_session(http, url, ADMIN, {"index": index})
    headers = {"Authorization": f"Bearer {session.sid}", "Content-Type": "application/json"}
    input_lengths: list[int] = []
    for _ in range(turns):
        k = session.turn
        session.turn += 1
        prelude = session.prelude + " " if k == 0 and session.prelude else ""
        content = f"{prelude}Session {index}, step {k}: please continue the task."
        message = encode_message({"role": "user", "content": content})
        stream = k % 2 == 1
        started = time.perf_counter()
        async with http.post(
            url + "/v1/messages", data=session.body(message, stream=stream), headers=headers
        ) as resp:
            raw = await resp.read()
            ok = resp.status == 200
        run.latencies.append(time.perf_counter() - started)
        if not ok or b"event: error" in raw:
            run.errors += 1
            run.latencies.pop()  # keep latencies aligned with answered ids
            continue
        if stream:
            msg_id, blocks, usage = wire.parse_sse(raw)
        else:
            data = orjson.loads(raw)
            msg_id, blocks, usage = data["id"], data["content"], data["usage"]
        run.ids.append(msg_id)
        input_lengths.append(usage["input_tokens"] + usage["cache_read_input_tokens"])
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        session.messages += (message, encode_message({"role": "assistant", "content": text}))
    return input_lengths


class EngineInputs:
    """`/generate` bodies whose input ids are the first n of one random array: its JSON
    is encoded once and each body takes a slice of it (no per-turn encoding)."""

    def __init__(self, longest: int, seed: int) -> None:
        ids = np.random.default_rng(seed).integers(100, 40000, size=max(1, longest))
        self._json = orjson.dumps(ids, option=orjson.OPT_SERIALIZE_NUMPY)
        # Where each id's digits end in the JSON (after "[" and one "," per id before it).
        self._ends = np.cumsum(np.char.str_len(ids.astype(str))) + np.arange(1, len(ids) + 1)

    def body(self, n: int) -> bytes:
        rid = os.urandom(16).hex().encode()
        return b"".join(
            (
                b'{"rid":"%s","input_ids":' % rid,
                self._json[: int(self._ends[n - 1])],
                b'],"return_logprob":true,"sampling_params":{"max_new_tokens":64,'
                b'"temperature":1.0}}',
            )
        )


async def engine_session(
    http: aiohttp.ClientSession, url: str, lengths: list[int], inputs: EngineInputs, run: Run
) -> None:
    """The same turns straight to the engine: inputs of the recorded lengths."""
    headers = {"Content-Type": "application/json"}
    for n in lengths:
        started = time.perf_counter()
        async with http.post(url + "/generate", data=inputs.body(n), headers=headers) as resp:
            await resp.read()
            ok = resp.status == 200
        run.latencies.append(time.perf_counter() - started)
        run.errors += not ok


async def engine_latency_by_request(db: str) -> dict[str, float]:
    store = await open_store(db)
    try:
        out: dict[str, float] = {}
        after = 0
        while True:
            page = await store.read_all(after=after, limit=5000)
            if not page:
                return out
            for r in page:
                if isinstance(r.event, ev.GenerateResult):
                    out[r.event.request_id] = out.get(r.event.request_id, 0.0) + r.event.latency_s
            after = page[-1].position
    finally:
        await store.close()


async def measure(
    http: aiohttp.ClientSession,
    url: str,
    engine: Engine,
    sessions: int,
    turns: int,
    pid: int,
    prelude_words: int = 0,
    baseline: bool = True,
) -> tuple[Run, Run | None]:
    """(recorder run, engine-direct baseline run or None without `baseline`) at the
    same concurrency and token counts.

    With `prelude_words`, every session first takes its long first turn, unmeasured."""
    started_sessions = [Session(i, prelude_words) for i in range(sessions)]
    if prelude_words:
        await asyncio.gather(
            *(recorder_session(http, url, s.index, 1, Run(), s) for s in started_sessions)
        )
    cpu_before = process_cpu_s(pid)
    engine_before, client_before = process_cpu_s(engine.pid), time.process_time()
    cores_before = core_ticks()
    rec = Run()
    started = time.perf_counter()
    lengths = await asyncio.gather(
        *(recorder_session(http, url, s.index, turns, rec, s) for s in started_sessions)
    )
    rec.wall_s = time.perf_counter() - started
    rec.cpu_s = process_cpu_s(pid) - cpu_before
    rec.engine_cpu_s = process_cpu_s(engine.pid) - engine_before
    rec.client_cpu_s = time.process_time() - client_before
    rec.cores = utilisation(cores_before, core_ticks())
    if not baseline:
        return rec, None
    base = Run()
    inputs = EngineInputs(max((max(ls, default=1) for ls in lengths), default=1), seed=sessions)
    engine_before, client_before = process_cpu_s(engine.pid), time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(engine_session(http, engine.url, ls, inputs, base) for ls in lengths))
    base.wall_s = time.perf_counter() - started
    base.engine_cpu_s = process_cpu_s(engine.pid) - engine_before
    base.client_cpu_s = time.process_time() - client_before
    return rec, base


@dataclass
class Variant:
    """One recorder under test: a checkout and its inline-commit setting."""

    label: str
    root: Path = REPO
    inline: bool | None = None  # None: the checkout's default (a switch older ones lack)

    def env(self) -> dict[str, str]:
        return {} if self.inline is None else {INLINE_ENV: "1" if self.inline else "0"}


def variants(before_src: Path | None, inline: str, before_last: bool = False) -> list[Variant]:
    """The recorders to compare: `before_src` as it is (if given), then this
    checkout with inline commits as `inline` says (on, off, or both); the
    other way round with `before_last` (to see what running first does)."""
    if before_src is None and inline == "on":
        return [Variant("this")]
    before = [] if before_src is None else [Variant("before", before_src)]
    settings = {"on": [True], "off": [False], "both": [True, False]}[inline]
    this = [Variant(f"this, inline {'on' if on else 'off'}", inline=on) for on in settings]
    return this + before if before_last else before + this


@contextlib.contextmanager
def environment(extra: dict[str, str]) -> Iterator[None]:
    """`os.environ` with `extra` set while a child process is started."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Phase:
    name: str
    variant: str
    rec: Run
    base: Run | None
    engine_s: dict[str, float]


async def run_variant(
    variant: Variant,
    engine: Engine,
    db: str,
    phases: list[tuple[int, int]],
    prelude_words: int,
    workers: int,
    baseline: bool,
) -> tuple[list[Phase], int, int]:
    """Each (sessions, turns) phase against a fresh `recorder serve` of `variant`;
    also the number of turns its log has a line for, and the turns it took."""
    extra = ["--workers", str(workers)] if workers > 1 else []
    with environment(variant.env()):
        recorder = RecorderProcess(engine.url, db, extra, log=True, root=variant.root)
    url = recorder.url
    runs: list[tuple[str, Run, Run | None]] = []
    try:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            await recorder.wait_healthy(http)
            await recorder_session(http, url, -1, 2, Run())  # warm-up
            for n, t in phases:
                rec, base = await measure(
                    http, url, engine, n, t, recorder.proc.pid, prelude_words, baseline
                )
                runs.append((f"{n} x {t}", rec, base))
    finally:
        recorder.terminate()
    engine_s = await engine_latency_by_request(db)
    assert recorder.log_file is not None
    log = recorder.log_file.read_text().splitlines()
    turn_lines = sum(1 for line in log if "turn session=" in line)
    # Turns taken: the warm-up's, the measured ones, each session's long first turn.
    taken = 2 + sum(
        len(rec.latencies) + rec.errors + (n if prelude_words else 0)
        for (n, _), (_, rec, _) in zip(phases, runs, strict=True)
    )
    found = [Phase(name, variant.label, rec, base, engine_s) for name, rec, base in runs]
    return found, turn_lines, taken


async def bench(
    sessions: list[int],
    turns: int,
    db: str | None,
    context: int = 0,
    workers: int = 1,
    tmp: Path = Path("."),
    compare: list[Variant] | None = None,
    single: bool = True,
    engine_kind: str = "lean",
    repeat: int = 1,
) -> None:
    """Every variant at every session count, variants in turn per count, each
    against a fresh `recorder serve` (and, without `db`, a fresh SQLite file);
    all of it `repeat` times (the single session only the first time).
    The engine-direct baseline runs with the first variant of each count."""
    compare = compare or [Variant("this")]
    start = start_lean_engine if engine_kind == "lean" else start_test_engine
    engine_proc, engine_url = start(max(32768, int(context * 1.2) + 8192))
    engine = Engine(engine_url, engine_proc.pid)
    prelude_words = int(context * 0.75)  # the fixture tokenizer: ~1.3 tokens per "word"
    results: list[Phase] = []
    turns_logged = turns_taken = 0
    try:
        for rep, k, n in [(r, k, n) for r in range(repeat) for k, n in enumerate(sessions)]:
            phases = [(n, turns)]
            if single and rep == k == 0:
                # At least 30 turns: the single session's p50 is a median of >= 30.
                phases.insert(0, (1, max(30, 3 * turns)))
            for i, variant in enumerate(compare):
                # A given --db is shared by the runs (one at a time; request ids are unique).
                path = db or str(tmp / f"bench-{rep}-{k}-{i}.db")
                found, logged, taken = await run_variant(
                    variant, engine, path, phases, prelude_words, workers, baseline=i == 0
                )
                results += found
                turns_logged += logged
                turns_taken += taken
    finally:
        engine_proc.terminate()
        engine_proc.wait(timeout=30)
    print_results(results, db, context, workers, turns_logged, turns_taken, engine_kind)
    if repeat > 1:
        print_medians(results, repeat)


def print_medians(results: list[Phase], repeat: int) -> None:
    """Per phase and path, the medians over the `repeat` runs: the box is shared, and
    one run can lose half of it to other users' processes."""
    rows: dict[tuple[str, str], list[Run]] = {}
    for phase in results:
        rows.setdefault((phase.name, f"recorder: {phase.variant}"), []).append(phase.rec)
        if phase.base is not None:
            rows.setdefault((phase.name, "engine /generate"), []).append(phase.base)
    print(f"medians over {repeat} runs (turns/s; CPU ms per turn: recorder, engine, load gen.)")
    for (name, path), runs in rows.items():
        n = [max(1, len(r.latencies) + r.errors) for r in runs]
        rate = statistics.median(len(r.latencies) / r.wall_s for r in runs)
        fields = ["engine_cpu_s", "client_cpu_s"]
        if path.startswith("recorder"):
            fields.insert(0, "cpu_s")
        cpu = [
            statistics.median(getattr(r, f) / k * 1000 for r, k in zip(runs, n, strict=True))
            for f in fields
        ]
        cpus = " ".join(f"{c:.2f}" for c in cpu)
        print(f"{name:<17}{path:<28}{rate:>9.1f} turns/s   CPU ms/turn {cpus}")


def cpu_split(run: Run, *, recorder: bool) -> str:
    """CPU per turn of each process on the box in one phase (the recorder's, if it ran)."""
    n = max(1, len(run.latencies) + run.errors)
    parts = [("recorder", run.cpu_s)] if recorder else []
    parts += [("engine", run.engine_cpu_s), ("load generator", run.client_cpu_s)]
    return "CPU ms per turn: " + ", ".join(f"{name} {s / n * 1000:.2f}" for name, s in parts)


def box_share(run: Run, cores: int) -> str:
    """What the box gave this benchmark in one phase, and the rate its CPU per turn allows.

    The two cores are shared with whatever else runs on the machine: turns/s
    alone says as much about the neighbours as about the recorder. Our three
    processes' share of the cores, the rest of the busy time (other processes),
    and the CPU-bound rate (cores / CPU seconds per turn of all three; the
    recorder's alone on one core) separate the two. The rates are projections
    from measured CPU, not measured turns/s.
    """
    n = max(1, len(run.latencies) + run.errors)
    ours_s = run.cpu_s + run.engine_cpu_s + run.client_cpu_s
    ours = ours_s / max(run.wall_s, 1e-9) / cores
    others = max(0.0, sum(run.cores) / max(1, len(run.cores)) - ours)
    return (
        f"box: our 3 processes {ours * 100:.0f}% of {cores} cores, other processes "
        f"{others * 100:.0f}%; CPU-bound rate {n * cores / max(ours_s, 1e-9):.0f} turns/s "
        f"(recorder alone on 1 core: {n / max(run.cpu_s, 1e-9):.0f})"
    )


def print_results(
    results: list[Phase],
    db: str | None,
    context: int,
    workers: int,
    logged: int,
    taken: int,
    engine_kind: str = "lean",
) -> None:
    print()
    print(
        f"zero-latency {ENGINES[engine_kind]}, db {db or 'a temp SQLite file per run'}, "
        f"{os.cpu_count()} cores shared by engine, "
        f"recorder ({workers} worker{'s' if workers > 1 else ''}), clients; "
        f"context ~{context:,} tokens; {machine_state()}"
    )
    print(TABLE.header())
    errors = 0
    baseline: dict[str, Run] = {}
    for phase in results:
        rec, engine_s = phase.rec, phase.engine_s
        if phase.base is not None:
            baseline[phase.name] = phase.base
        base = baseline[phase.name]
        overhead = [
            lat - engine_s[rid]
            for lat, rid in zip(rec.latencies, rec.ids, strict=True)
            if rid in engine_s
        ]
        rows: list[tuple[str, Run, list[float] | None]] = [
            (f"recorder: {phase.variant}", rec, overhead)
        ]
        if phase.base is not None:
            rows.insert(0, ("engine /generate", base, None))
        for path, run, ovh in rows:
            n = len(run.latencies)
            cpu = f"{run.cpu_s / n * 1000:.2f}" if run is rec else ""
            o50 = f"{pct(ovh, 50):.1f}" if ovh is not None else ""
            o99 = f"{pct(ovh, 99):.1f}" if ovh is not None else ""
            rate, p50, p99 = n / run.wall_s, pct(run.latencies, 50), pct(run.latencies, 99)
            print(
                TABLE.row(
                    phase.name, path, n, run.errors, f"{rate:.1f}", f"{p50:.1f}", f"{p99:.1f}",
                    o50, o99, cpu,
                )
            )  # fmt: skip
        cores = " ".join(f"{u * 100:.0f}%" for u in rec.cores)
        print(f"{'':<17}recorder phase: per-core utilisation {cores} (all processes on the box)")
        print(f"{'':<17}{cpu_split(rec, recorder=True)}")
        print(f"{'':<17}{box_share(rec, len(rec.cores))}")
        if phase.base is not None:
            print(f"{'':<17}engine /generate phase: {cpu_split(phase.base, recorder=False)}")
        throughput = len(rec.latencies) / rec.wall_s / (len(base.latencies) / base.wall_s)
        print(
            f"{'':<17}ratio recorder/engine: throughput {throughput:.2f}x, "
            f"p50 latency {pct(rec.latencies, 50) / pct(base.latencies, 50):.1f}x"
        )
        errors += rec.errors + (phase.base.errors if phase.base is not None else 0)
    print(f"turn log lines {logged} for {taken} turns")
    if errors:
        raise SystemExit(f"{errors} errors")


@click.command()
@click.option(
    "--sessions",
    default="128",
    show_default=True,
    help="concurrent sessions; a comma list (64,128) runs each in turn",
)
@click.option("--turns", type=int, default=8, show_default=True)
@click.option(
    "--db", default=None, help="SQLite path or Postgres URL (default: a temp SQLite file)"
)
@click.option(
    "--context", type=int, default=0, show_default=True, help="tokens of context per session"
)
@click.option(
    "--workers", type=int, default=1, show_default=True, help="recorder serve --workers N"
)
@click.option(
    "--before-src",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="another checkout (git worktree add --detach DIR main) measured beside this one",
)
@click.option(
    "--inline",
    type=click.Choice(["on", "off", "both"]),
    default="on",
    show_default=True,
    help=f"this checkout's SQLite inline commits ({INLINE_ENV}); both: one run each",
)
@click.option("--before-last", is_flag=True, help="run the --before-src recorder after this one's")
@click.option(
    "--engine",
    "engine_kind",
    type=click.Choice(list(ENGINES)),
    default="lean",
    show_default=True,
    help="lean: a canned /generate that costs next to nothing (the recorder is what is "
    "measured); scripted: the test engine as the tests run it",
)
@click.option(
    "--single/--no-single",
    default=True,
    show_default=True,
    help="measure one session first (max(30, 3 x turns) turns)",
)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="run everything N times; medians per phase printed after the table",
)
def main(
    sessions: str,
    turns: int,
    db: str | None,
    context: int,
    workers: int,
    before_src: Path | None,
    inline: str,
    before_last: bool,
    single: bool,
    engine_kind: str,
    repeat: int,
) -> None:
    counts = [int(n) for n in sessions.split(",")]
    compare = variants(before_src.resolve() if before_src else None, inline, before_last)
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(
            bench(
                counts, turns, db, context, workers, Path(tmp), compare, single, engine_kind, repeat
            )
        )


if __name__ == "__main__":
    main()
