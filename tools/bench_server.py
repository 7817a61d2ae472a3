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
(from /proc/stat) and the recorder's CPU (all its processes and threads).

    python tools/bench_server.py [--sessions 128] [--turns 8] [--db PATH|URL]
        [--context 100000] [--workers 2]
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import click
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python tools/...`

from recorder.log import events as ev
from recorder.log.store import open_store
from tools.benchkit import wire
from tools.benchkit.cpu import load_average
from tools.benchkit.engine import start_test_engine
from tools.benchkit.recorder import ADMIN, RecorderProcess
from tools.benchkit.stats import pct
from tools.benchkit.table import Columns

TABLE = Columns(
    [
        ("sessions x turns", 17, "<"), ("path", 22, "<"), ("turns", 6, ">"), ("err", 5, ">"),
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


class Session:
    """One session's conversation: `prelude_words` of context in its first message."""

    def __init__(self, index: int, prelude_words: int) -> None:
        self.index = index
        self.prelude = " ".join(["word"] * prelude_words)
        self.messages: list[dict[str, Any]] = []
        self.sid = ""
        self.turn = 0


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
    sid, messages = session.sid, session.messages
    headers = {"Authorization": f"Bearer {sid}"}
    input_lengths: list[int] = []
    for _ in range(turns):
        k = session.turn
        session.turn += 1
        prelude = session.prelude + " " if k == 0 and session.prelude else ""
        messages.append(
            {
                "role": "user",
                "content": f"{prelude}Session {index}, step {k}: please continue the task.",
            }
        )
        body = {"model": "bench", "max_tokens": 64, "messages": messages, "stream": k % 2 == 1}
        started = time.perf_counter()
        async with http.post(url + "/v1/messages", json=body, headers=headers) as resp:
            raw = await resp.read()
            ok = resp.status == 200
        run.latencies.append(time.perf_counter() - started)
        if not ok or b"event: error" in raw:
            run.errors += 1
            run.latencies.pop()  # keep latencies aligned with answered ids
            messages.pop()
            continue
        if body["stream"]:
            msg_id, content, usage = wire.parse_sse(raw)
        else:
            data = json.loads(raw)
            msg_id, content, usage = data["id"], data["content"], data["usage"]
        run.ids.append(msg_id)
        input_lengths.append(usage["input_tokens"] + usage["cache_read_input_tokens"])
        text = "".join(b["text"] for b in content if b["type"] == "text")
        messages.append({"role": "assistant", "content": text})
    return input_lengths


async def engine_session(
    http: aiohttp.ClientSession, url: str, lengths: list[int], run: Run
) -> None:
    """The same turns straight to the engine: inputs of the recorded lengths."""
    rng = np.random.default_rng(len(lengths))
    for n in lengths:
        body = {
            "rid": os.urandom(16).hex(),
            "input_ids": rng.integers(100, 40000, size=n).tolist(),
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 64, "temperature": 1.0},
        }
        started = time.perf_counter()
        async with http.post(url + "/generate", json=body) as resp:
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
    engine_url: str,
    sessions: int,
    turns: int,
    pid: int,
    prelude_words: int = 0,
) -> tuple[Run, Run]:
    """(recorder run, engine-direct baseline run) at the same concurrency and token counts.

    With `prelude_words`, every session first takes its long first turn, unmeasured."""
    started_sessions = [Session(i, prelude_words) for i in range(sessions)]
    if prelude_words:
        await asyncio.gather(
            *(recorder_session(http, url, s.index, 1, Run(), s) for s in started_sessions)
        )
    cpu_before = process_cpu_s(pid)
    cores_before = core_ticks()
    rec = Run()
    started = time.perf_counter()
    lengths = await asyncio.gather(
        *(recorder_session(http, url, s.index, turns, rec, s) for s in started_sessions)
    )
    rec.wall_s = time.perf_counter() - started
    rec.cpu_s = process_cpu_s(pid) - cpu_before
    rec.cores = utilisation(cores_before, core_ticks())
    base = Run()
    started = time.perf_counter()
    await asyncio.gather(*(engine_session(http, engine_url, ls, base) for ls in lengths))
    base.wall_s = time.perf_counter() - started
    return rec, base


async def bench(sessions: int, turns: int, db: str, context: int = 0, workers: int = 1) -> None:
    engine_proc, engine_url = start_test_engine(max(32768, int(context * 1.2) + 8192))
    extra = ["--workers", str(workers)] if workers > 1 else []
    recorder = RecorderProcess(engine_url, db, extra, log=True)
    prelude_words = int(context * 0.75)  # the fixture tokenizer: ~1.3 tokens per "word"
    url = recorder.url
    phases: list[tuple[str, Run, Run]] = []
    try:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            await recorder.wait_healthy(http)
            await recorder_session(http, url, -1, 2, Run())  # warm-up
            # At least 30 turns per point: the single session's p50 is a median of >= 30.
            for n, t in ((1, max(30, 3 * turns)), (sessions, turns)):
                rec, base = await measure(
                    http, url, engine_url, n, t, recorder.proc.pid, prelude_words
                )
                phases.append((f"{n} x {t}", rec, base))
    finally:
        recorder.terminate()
        engine_proc.terminate()
        engine_proc.wait(timeout=30)

    engine_s = await engine_latency_by_request(db)
    assert recorder.log_file is not None
    log = recorder.log_file.read_text().splitlines()
    turn_lines = sum(1 for line in log if "turn session=" in line)
    print()
    print(
        f"zero-latency scripted engine, db {db}, {os.cpu_count()} cores shared by engine, "
        f"recorder ({workers} worker{'s' if workers > 1 else ''}), clients; "
        f"context ~{context:,} tokens; {load_average()}"
    )
    print(TABLE.header())
    total, errors = 0, 0
    for name, rec, base in phases:
        overhead = [
            lat - engine_s[rid]
            for lat, rid in zip(rec.latencies, rec.ids, strict=True)
            if rid in engine_s
        ]
        for path, run, ovh in (
            ("engine /generate", base, None),
            ("recorder /v1/messages", rec, overhead),
        ):
            n = len(run.latencies)
            cpu = f"{run.cpu_s / n * 1000:.2f}" if run is rec else ""
            o50 = f"{pct(ovh, 50):.1f}" if ovh is not None else ""
            o99 = f"{pct(ovh, 99):.1f}" if ovh is not None else ""
            rate, p50, p99 = n / run.wall_s, pct(run.latencies, 50), pct(run.latencies, 99)
            print(
                TABLE.row(
                    name,
                    path,
                    n,
                    run.errors,
                    f"{rate:.1f}",
                    f"{p50:.1f}",
                    f"{p99:.1f}",
                    o50,
                    o99,
                    cpu,
                )
            )
        cores = " ".join(f"{u * 100:.0f}%" for u in rec.cores)
        print(f"{'':<17}recorder phase: per-core utilisation {cores} (all processes on the box)")
        throughput = len(rec.latencies) / rec.wall_s / (len(base.latencies) / base.wall_s)
        print(
            f"{'':<17}ratio recorder/engine: throughput {throughput:.2f}x, "
            f"p50 latency {pct(rec.latencies, 50) / pct(base.latencies, 50):.1f}x"
        )
        total += len(rec.latencies)
        errors += rec.errors + base.errors
    unmeasured = 2 + (1 + sessions if prelude_words else 0)  # warm-up, long first turns
    print(f"turn log lines {turn_lines} for {total + unmeasured} turns")
    if errors:
        raise SystemExit(f"{errors} errors")


@click.command()
@click.option("--sessions", type=int, default=128, show_default=True)
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
def main(sessions: int, turns: int, db: str | None, context: int, workers: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(bench(sessions, turns, db or str(Path(tmp) / "bench.db"), context, workers))


if __name__ == "__main__":
    main()
