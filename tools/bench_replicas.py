"""Replicas on one Postgres, and time to first answer after a restart.

Replicas: R `recorder serve` processes on one Postgres (R = 1, 2, 3) and a
zero-latency scripted engine; S concurrent sessions x T turns, each request
routed either sticky (by a hash of the session's key, what a load balancer
with consistent hashing on the Authorization/x-api-key header does) or to a
random replica (each turn then usually catches up with the turn another
replica served). Catch-up cost per turn = random minus sticky p50 at the
same R. At 100k context: one session whose first message is ~100k tokens,
then small turns alternating between two replicas (a catch-up every turn)
against the same on one replica.

Recovery: S sessions x T turns on one server, which is then restarted; every
session then sends one turn at once. Time to first answer = from `/health`
ok to each answer (the median over restarts of the server's first answer;
median and p99 over every answer of every restart; the median over restarts
of until the last), per history length T, on
SQLite and on Postgres; restarts alternate between rebuilding sessions by
the full replay (`--restore-from replay`, the baseline) and from their state
snapshots; the peer is the same 256 turns at once on the warm server. Also: what a snapshot adds to a turn at 100k context (`--sessions
0` skips the replica part).

    python tools/bench_replicas.py --pg postgresql+asyncpg://... [--sessions 32] [--turns 8]
        [--recovery-sessions 256] [--recovery-turns 10,100] [--recovery-restarts 3]
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python tools/...`

from tools.benchkit import wire
from tools.benchkit.engine import start_test_engine
from tools.benchkit.recorder import ADMIN, RecorderProcess
from tools.benchkit.stats import pct
from tools.benchkit.table import Columns

Route = Callable[[str, int], str]


class Replicas:
    """R recorder processes on one database."""

    def __init__(self, engine_url: str, db: str, n: int, extra: Sequence[str] = ()) -> None:
        self.started = [RecorderProcess(engine_url, db, extra, log=True) for _ in range(n)]
        self.urls = [r.url for r in self.started]

    async def healthy(self, http: aiohttp.ClientSession) -> None:
        for recorder in self.started:
            await recorder.wait_healthy(http)

    def stop(self) -> None:
        for recorder in self.started:
            recorder.proc.terminate()
        for recorder in self.started:
            recorder.proc.wait(timeout=60)


def sticky(urls: list[str]) -> Route:
    return lambda sid, _turn: urls[zlib.crc32(sid.encode()) % len(urls)]


def scattered(urls: list[str]) -> Route:
    return lambda _sid, _turn: random.choice(urls)


def alternating(urls: list[str]) -> Route:
    return lambda _sid, turn: urls[turn % len(urls)]


async def turn(
    http: aiohttp.ClientSession, url: str, sid: str, messages: list[dict[str, Any]]
) -> float:
    """One non-streaming turn; appends the answer to `messages`; its latency in seconds."""
    body = {"model": "bench", "max_tokens": 32, "messages": messages}
    started = time.perf_counter()
    async with http.post(url + "/v1/messages", json=body, headers={"x-api-key": sid}) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"turn failed: {resp.status} {data}")
    latency = time.perf_counter() - started
    messages.append({"role": "assistant", "content": data["content"][0]["text"]})
    return latency


async def session(
    http: aiohttp.ClientSession, route: Route, turns: int, first: str, latencies: list[float]
) -> tuple[str, list[dict[str, Any]]]:
    sid = await wire.open_session(http, route("", 0), ADMIN)
    messages: list[dict[str, Any]] = []
    for k in range(turns):
        messages.append({"role": "user", "content": first if k == 0 else f"step {k}: go on."})
        latencies.append(await turn(http, route(sid, k), sid, messages))
    return sid, messages


async def drive(
    http: aiohttp.ClientSession, route: Route, sessions: int, turns: int
) -> tuple[list[float], float]:
    latencies: list[float] = []
    started = time.perf_counter()
    await asyncio.gather(
        *(session(http, route, turns, "Start the task.", latencies) for _ in range(sessions))
    )
    return latencies, time.perf_counter() - started


async def catch_up_totals(http: aiohttp.ClientSession, urls: list[str]) -> tuple[int, float]:
    """(catch-ups that found new events, seconds spent at head checks) over the replicas."""
    calls, seconds = 0, 0.0
    for url in urls:
        async with http.get(url + "/health") as resp:
            data = await resp.json()
        calls, seconds = calls + data["catch_ups"], seconds + data["catch_up_s"]
    return calls, seconds


REPLICAS = Columns(
    [
        ("replicas, routing", 30, "<"), ("turns", 7, ">"), ("turns/s", 9, ">"),
        ("p50 ms", 9, ">"), ("p99 ms", 9, ">"), ("caught up", 10, ">"),
        ("head+catch-up ms/turn", 22, ">"),
    ]
)  # fmt: skip
RECOVERY = Columns(
    [("backend", 10, "<"), ("sessions", 9, ">"), ("turns", 7, ">")]
    + [(name, 9, ">") for name in ("first", "p50", "p99", "last", "load")] * 2
    + [("speedup", 10, ">"), ("warm last", 10, ">")]
)
SNAPSHOT = Columns([("", 34, "<"), ("p50 us", 9, ">"), ("bytes", 9, ">")])


def row(
    name: str, latencies: list[float], wall_s: float | None, catch_ups: Any, turns: int = 0
) -> str:
    """A routing's line: turns, turns/s (when timed as a whole), p50, p99, and the
    catch-ups (calls, seconds) the replicas did meanwhile over `turns` (default: all)."""
    calls, seconds = catch_ups
    n = turns or len(latencies)
    return REPLICAS.row(
        name,
        len(latencies),
        f"{len(latencies) / wall_s:.1f}" if wall_s else "",
        f"{pct(latencies, 50):.1f}",
        f"{pct(latencies, 99):.1f}",
        f"{calls / n * 100:.0f}%",
        f"{seconds / n * 1000:.2f}",
    )


async def bench_replicas(engine_url: str, pg: str, sessions: int, turns: int) -> None:
    print(f"\nreplicas on one Postgres: {sessions} sessions x {turns} turns, zero-latency engine")
    print(REPLICAS.header())
    timeout = aiohttp.ClientTimeout(total=1200)
    for n in (1, 2, 3):
        replicas = Replicas(engine_url, pg, n)
        try:
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=timeout
            ) as http:
                await replicas.healthy(http)
                await drive(http, sticky(replicas.urls), 2, 2)  # warm-up
                routes = [("sticky", sticky)] + ([("random", scattered)] if n > 1 else [])
                for name, make in routes:
                    before = await catch_up_totals(http, replicas.urls)
                    latencies, wall = await drive(http, make(replicas.urls), sessions, turns)
                    caught = np.subtract(await catch_up_totals(http, replicas.urls), before)
                    print(row(f"{n} {name}", latencies, wall, caught))
                if n == 2:
                    await long_context(http, replicas.urls)
        finally:
            replicas.stop()


async def long_context(http: aiohttp.ClientSession, urls: list[str], reps: int = 30) -> None:
    """~100k tokens of context: a catch-up every turn (alternating) vs none (one replica)."""
    first = " ".join(f"word{i % 997}" for i in range(25_600))  # ~100k tokens
    results = {}
    for name, route in (("sticky", sticky(urls[:1])), ("alternating", alternating(urls))):
        latencies: list[float] = []
        before = await catch_up_totals(http, urls)
        await session(http, route, reps + 1, first, latencies)
        calls, seconds = np.subtract(await catch_up_totals(http, urls), before)
        results[name] = latencies[1:]  # the first turn renders the whole context
        caught = (calls, seconds)  # per turn over every turn taken, the first included
        print(row(f"  100k context, {name}", results[name], None, caught, len(latencies)))
    extra = pct(results["alternating"], 50) - pct(results["sticky"], 50)
    print(f"{'':<30}at 100k context a catch-up adds {extra:.1f} ms "
          f"({extra / pct(results['sticky'], 50) * 100:.0f}% of a turn)")  # fmt: skip


async def first_answer(
    http: aiohttp.ClientSession, url: str, sid: str, messages: list[dict[str, Any]], t0: float
) -> float:
    """Seconds from `t0` (the restarted server healthy) to this session's next answer."""
    messages.append({"role": "user", "content": "And now?"})
    await turn(http, url, sid, messages)
    return time.perf_counter() - t0


# How a restarted server rebuilds sessions: the baseline replays every turn.
RESTORE_MODES = (("replay", ["--restore-from", "replay"]), ("snapshot", []))


async def restart_and_answer(
    http: aiohttp.ClientSession,
    engine_url: str,
    db: str,
    extra: Sequence[str],
    built: list[tuple[str, list[dict[str, Any]]]],
) -> tuple[list[float], float, float]:
    """Start a server on `db`; every session sends one turn at once; (seconds to each
    answer, mean seconds the server spent rebuilding a session, seconds until the last
    answer when every session sends one more turn at once: the warm server's peer)."""
    replicas = Replicas(engine_url, db, 1, extra)
    try:
        await replicas.healthy(http)
        started = time.perf_counter()
        url = replicas.urls[0]
        waits = await asyncio.gather(*(first_answer(http, url, s, m, started) for s, m in built))
        async with http.get(url + "/health") as resp:
            health = await resp.json()
        # New connections, as after the restart: the peer differs only in the server's state.
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=http.timeout
        ) as fresh:
            started = time.perf_counter()
            warm = await asyncio.gather(
                *(first_answer(fresh, url, s, m, started) for s, m in built)
            )
        return waits, health["session_load_s"] / max(1, health["sessions_loaded"]), max(warm)
    finally:
        replicas.stop()


async def bench_recovery(
    engine_url: str, db: str, label: str, sessions: int, history: list[int], restarts: int
) -> None:
    """Per history length: build the sessions, then restart `restarts` times per mode,
    alternating modes (each restart adds one turn to every session)."""
    timeout = aiohttp.ClientTimeout(total=1800)
    for turns in history:
        replicas = Replicas(engine_url, db, 1)
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=timeout
        ) as http:
            try:
                await replicas.healthy(http)
                route = sticky(replicas.urls)
                built = await asyncio.gather(
                    *(session(http, route, turns, "Start.", []) for _ in range(sessions))
                )
            finally:
                replicas.stop()
            waits: dict[str, list[float]] = {name: [] for name, _ in RESTORE_MODES}
            firsts: dict[str, list[float]] = {name: [] for name, _ in RESTORE_MODES}
            lasts: dict[str, list[float]] = {name: [] for name, _ in RESTORE_MODES}
            loads: dict[str, list[float]] = {name: [] for name, _ in RESTORE_MODES}
            warm: list[float] = []
            for _ in range(restarts):
                for name, extra in RESTORE_MODES:
                    answered, load_s, warm_s = await restart_and_answer(
                        http, engine_url, db, extra, built
                    )
                    waits[name] += answered
                    firsts[name].append(min(answered))
                    lasts[name].append(max(answered))
                    loads[name].append(load_s)
                    warm.append(warm_s)
        cells = [
            cell
            for name, _ in RESTORE_MODES
            for cell in (
                f"{float(np.median(firsts[name])) * 1000:.0f}",
                f"{pct(waits[name], 50):.0f}",
                f"{pct(waits[name], 99):.0f}",
                f"{float(np.median(lasts[name])) * 1000:.0f}",
                f"{pct(loads[name], 50):.1f}",
            )
        ]
        speedup = np.median(lasts["replay"]) / np.median(lasts["snapshot"])
        warm_ms = float(np.median(warm)) * 1000
        print(RECOVERY.row(label, sessions, turns, *cells, f"{speedup:.1f}x", f"{warm_ms:.0f}"))


async def snapshot_cost(reps: int = 30) -> None:
    """What a state snapshot adds to a turn at ~100k tokens of context (in process).

    The state of a session 100 turns into one chain of 100k tokens (200
    message digests, 100 boundaries), whose turn 99 was snapshotted: turn
    100's snapshot encodes the state, stores the turn's output (32 tokens) as
    a delta on the turn's input, and its new digests and boundary as deltas on
    turn 99's. Peer: storing that input's own delta (500 new tokens), which
    every turn already does.
    """
    from array import array

    from recorder.log.events import ArrayRef, encode_event
    from recorder.log.store.arrays import encode_array
    from recorder.model.tokens import Boundary, Chain, SessionChains
    from recorder.server.journal import Journal
    from recorder.server.sessions import SessionState
    from recorder.server.snapshot import add_snapshot

    rng = np.random.default_rng(0)
    tokens = array("i", rng.integers(0, 150_000, 100_000, dtype=np.int32).tobytes())
    step = len(tokens) // 100
    boundaries = [
        Boundary(2 * k + 1, (k + 1) * step - 32, (k + 1) * step, True) for k in range(100)
    ]
    digests = [f"{k:032x}" for k in range(200)]
    input_ref = ArrayRef(b"\x01" * 16, len(tokens) - 32)
    previous_input = ArrayRef(b"\x02" * 16, len(tokens) - step - 32)
    snapshot_s, snapshot_bytes, peer_s, peer_bytes = [], [], [], []
    for _ in range(reps):
        before = Chain(chain_id=0, system_digest="s" * 32, render_digest="r" * 32,
                       message_digests=digests[:-2], tokens=tokens[:-step],
                       boundaries=boundaries[:-1], main_line=True)  # fmt: skip
        state = SessionState(session_id="s", journal=Journal(None, "s", 0))  # type: ignore[arg-type]
        state.chains = SessionChains(chains={0: before}, main_chain_id=0, next_chain_id=1)
        state.chain_refs = {0: {previous_input.length: previous_input}}
        add_snapshot(state)  # turn 99's, written with its turn
        state.journal = Journal(None, "s", 1)  # type: ignore[arg-type]
        state.chains.chains[0] = Chain(
            chain_id=0, system_digest="s" * 32, render_digest="r" * 32,
            message_digests=digests, tokens=tokens, boundaries=boundaries, main_line=True,
        )  # fmt: skip
        state.chain_refs[0][input_ref.length] = input_ref
        started = time.perf_counter()
        add_snapshot(state)
        event = state.journal.pending[-1].event
        payload = encode_event(event)
        snapshot_s.append(time.perf_counter() - started)
        pieces = state.journal._arrays  # what the append will write
        snapshot_bytes.append(len(payload) + sum(len(p.data) for a in pieces for p in a.pieces))
        started = time.perf_counter()
        encoded = encode_array(np.frombuffer(tokens[-500:], dtype=np.int32), extends=input_ref)
        peer_s.append(time.perf_counter() - started)
        peer_bytes.append(sum(len(p.data) for p in encoded.pieces))
    print(f"\nper-turn cost of the state snapshot at 100k context, 100 turns ({reps} reps)")
    print(SNAPSHOT.header())
    for name, seconds, sizes in (
        ("snapshot (event + new pieces)", snapshot_s, snapshot_bytes),
        ("peer: input delta (500 tokens)", peer_s, peer_bytes),
    ):
        print(SNAPSHOT.row(name, f"{pct(seconds, 50) * 1000:.0f}", f"{np.median(sizes):.0f}"))


async def bench(
    pg: str, sessions: int, turns: int, rec_sessions: int, history: list[int], restarts: int
) -> None:
    engine_proc, engine_url = start_test_engine(131072)
    try:
        if sessions:
            await bench_replicas(engine_url, pg, sessions, turns)
        await snapshot_cost()
        print(
            "\ntime to first answer after a restart, from /health ok (every session sends one"
            f" turn at once; {restarts} restarts per mode; ms; first: the server's first answer;"
            " load: the server's mean time"
            " to rebuild one session; warm last: until the last answer of the next turn, no"
            " restart, on new connections as after one)"
        )
        print(f"{'':<26}{'full replay (baseline)':>45}{'from snapshot':>45}")
        print(RECOVERY.header())
        with tempfile.TemporaryDirectory() as tmp:
            for label, db in (("sqlite", str(Path(tmp) / "r.db")), ("postgres", pg)):
                await bench_recovery(engine_url, db, label, rec_sessions, history, restarts)
    finally:
        engine_proc.terminate()
        engine_proc.wait(timeout=30)


@click.command()
@click.option("--pg", default=lambda: os.environ.get("TR_TEST_POSTGRES_URL", ""),
              help="Postgres URL (default $TR_TEST_POSTGRES_URL; tools/pg_cluster.sh starts one)")  # fmt: skip
@click.option("--sessions", type=int, default=32, show_default=True)
@click.option("--turns", type=int, default=8, show_default=True)
@click.option("--recovery-sessions", type=int, default=256, show_default=True)
@click.option("--recovery-turns", default="10,100", show_default=True)
@click.option("--recovery-restarts", type=int, default=3, show_default=True,
              help="Restarts per restore mode and history length (alternating modes).")  # fmt: skip
def main(
    pg: str,
    sessions: int,
    turns: int,
    recovery_sessions: int,
    recovery_turns: str,
    recovery_restarts: int,
) -> None:
    if not pg:
        raise SystemExit(
            'no Postgres: pass --pg URL, or `eval "$(tools/pg_cluster.sh start /tmp/pg)"` first'
        )
    history = [int(t) for t in recovery_turns.split(",")]
    asyncio.run(bench(pg, sessions, turns, recovery_sessions, history, recovery_restarts))


if __name__ == "__main__":
    main()
