"""What each replica keeps cached once every session is closed: served vs cached vs RSS.

Two `recorder serve` processes on one Postgres and a zero-latency scripted
engine. S sessions, C at a time, each T turns and then closed, routed either
the README's sticky way (turns by a hash of the session's key; the admin
token's hash sends every open and close to one replica) or at random (every
request to either). Each routing runs three variants at once, each on its
own two fresh replicas (so all share the machine alike): the close watch off
(`--close-watch-interval 0`, the code before it: the peer), on
(`--close-watch-interval 0.5`), and off with the memory bound tight
(`--max-cached-mb 2`). After the last close and
twice the interval, each replica's `/health` gives what it still holds:
`sessions_cached`, `sessions_open` (all were closed, so every one is stale),
`sessions_held_mb`; RSS (and its growth over the run) is the child's own.

    python tools/bench_replica_cache.py --pg postgresql+asyncpg://... [--sessions 300]
        [--turns 3] [--concurrency 16] [--words 600] [--routings sticky,random]
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python tools/...`

from tools.benchkit import wire
from tools.benchkit.conversation import text
from tools.benchkit.engine import start_test_engine
from tools.benchkit.memory import MB
from tools.benchkit.recorder import ADMIN, RecorderProcess
from tools.benchkit.table import Columns

WATCH_S = 0.5
BOUND_MB = 2
# (label, serve options); "off" is the peer, the code before the close watch.
VARIANTS: list[tuple[str, list[str]]] = [
    ("off", ["--close-watch-interval", "0"]),
    ("on", ["--close-watch-interval", str(WATCH_S)]),
    ("bound", ["--close-watch-interval", "0", "--max-cached-mb", str(BOUND_MB)]),
]
Route = Callable[[str], int]  # a request's bearer token -> replica index


def sticky(_rng: random.Random) -> Route:
    """The README's recipe: a consistent hash of the Authorization / x-api-key header."""
    return lambda token: zlib.crc32(token.encode()) % 2


def scattered(rng: random.Random) -> Route:
    return lambda _token: rng.randrange(2)


@dataclass
class Served:
    """What the clients did on each replica."""

    sessions: list[set[str]] = field(default_factory=lambda: [set(), set()])
    turns: list[int] = field(default_factory=lambda: [0, 0])


async def one_session(
    http: aiohttp.ClientSession,
    urls: list[str],
    route: Route,
    turns: int,
    words: int,
    served: Served,
    rng: random.Random,
) -> None:
    """Open, `turns` turns, close; each request to the replica `route` names."""
    sid = await wire.open_session(http, urls[route(ADMIN)], ADMIN)
    messages: list[dict[str, Any]] = []
    for k in range(turns):
        messages.append({"role": "user", "content": text(rng, words if k == 0 else words // 4)})
        at = route(sid)
        body = {"model": "bench", "max_tokens": 32, "messages": messages}
        async with http.post(
            urls[at] + "/v1/messages", json=body, headers={"x-api-key": sid}
        ) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"turn failed: {resp.status} {data}")
        messages.append({"role": "assistant", "content": data["content"][0]["text"]})
        served.sessions[at].add(sid)
        served.turns[at] += 1
    await wire.close_session(http, urls[route(ADMIN)], ADMIN, sid, {"reward": 1.0})


@dataclass(frozen=True)
class Held:
    """One replica after the run."""

    served: int
    turns: int
    cached: int
    open: int
    held_mb: float
    shed: int
    rss_mb: float
    grown_mb: float


async def workload(
    http: aiohttp.ClientSession,
    urls: list[str],
    route: Route,
    sessions: int,
    turns: int,
    concurrency: int,
    words: int,
) -> tuple[Served, float]:
    """Every session's turns and close on one pair of replicas; what went where, wall time."""
    served = Served()
    gate = asyncio.Semaphore(concurrency)

    async def gated(i: int) -> None:
        async with gate:
            await one_session(http, urls, route, turns, words, served, random.Random(i))

    started = time.perf_counter()
    await asyncio.gather(*(gated(i) for i in range(sessions)))
    return served, time.perf_counter() - started


async def held_by(
    http: aiohttp.ClientSession, replica: RecorderProcess, start_rss: int, served: Served, i: int
) -> Held:
    async with http.get(replica.url + "/health") as resp:
        health = await resp.json()
    rss = replica.rss()
    return Held(
        served=len(served.sessions[i]),
        turns=served.turns[i],
        cached=health["sessions_cached"],
        open=health["sessions_open"],
        held_mb=health["sessions_held_mb"],
        shed=health["sessions_shed"],
        rss_mb=rss / MB,
        grown_mb=(rss - start_rss) / MB,
    )


async def run(
    engine_url: str,
    pg: str,
    routing: Callable[[random.Random], Route],
    sessions: int,
    turns: int,
    concurrency: int,
    words: int,
) -> dict[str, tuple[list[Held], float]]:
    """Every variant at once, each on its own two fresh replicas (so all share the machine
    alike): per variant, each replica's state after the run and the wall time."""
    pairs = {
        label: [RecorderProcess(engine_url, pg, options, log=True) for _ in range(2)]
        for label, options in VARIANTS
    }
    timeout = aiohttp.ClientTimeout(total=3600)
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=timeout
        ) as http:
            for pair in pairs.values():
                for replica in pair:  # six start at once: give them time on a busy machine
                    await wire.wait_healthy(http, replica.url, replica.proc.poll, "a replica", 900)
            start_rss = {label: [r.rss() for r in pair] for label, pair in pairs.items()}
            done = await asyncio.gather(
                *(
                    workload(
                        http, [r.url for r in pair], routing(random.Random(24)),
                        sessions, turns, concurrency, words,
                    )
                    for pair in pairs.values()
                )
            )  # fmt: skip
            await asyncio.sleep(2 * WATCH_S)  # one poll at least, where the watch is on
            results = {}
            for (label, pair), (served, wall) in zip(pairs.items(), done, strict=True):
                held = [
                    await held_by(http, replica, start_rss[label][i], served, i)
                    for i, replica in enumerate(pair)
                ]
                results[label] = (held, wall)
            return results
    finally:
        for pair in pairs.values():
            for replica in pair:
                await replica.stop()


TABLE = Columns(
    [
        ("routing", 8, "<"), ("replica", 8, "<"), ("served on/off", 15, ">"),
        ("turns on/off", 14, ">"),
        ("cached on/off", 15, ">"), ("open on/off", 13, ">"), ("held MB on/off", 16, ">"),
        ("RSS MB on/off", 15, ">"), ("+RSS MB on/off", 16, ">"),
        ("| bound: cached", 16, ">"), ("open", 6, ">"), ("held MB", 9, ">"), ("shed", 6, ">"),
        ("RSS MB", 8, ">"),
    ]
)  # fmt: skip


def pair(on: object, off: object) -> str:
    return f"{on} / {off}"


def rows(routing: str, off: list[Held], on: list[Held], bound: list[Held]) -> list[str]:
    """One line per replica: the watch on against off (the peer), then the bounded run."""
    lines = []
    for i in range(2):
        a, b, c = on[i], off[i], bound[i]
        lines.append(
            TABLE.row(
                routing,
                "AB"[i],
                pair(a.served, b.served),
                pair(a.turns, b.turns),
                pair(a.cached, b.cached),
                pair(a.open, b.open),
                pair(f"{a.held_mb:.1f}", f"{b.held_mb:.1f}"),
                pair(f"{a.rss_mb:.0f}", f"{b.rss_mb:.0f}"),
                pair(f"{a.grown_mb:+.0f}", f"{b.grown_mb:+.0f}"),
                c.cached,
                c.open,
                f"{c.held_mb:.1f}",
                c.shed,
                f"{c.rss_mb:.0f}",
            )
        )
    return lines


ROUTINGS: dict[str, Callable[[random.Random], Route]] = {"sticky": sticky, "random": scattered}


async def bench(
    pg: str, sessions: int, turns: int, concurrency: int, words: int, routings: list[str]
) -> None:
    engine_proc, engine_url = start_test_engine(32768)
    print(
        f"\nwhat each of 2 replicas on one Postgres holds after {sessions} sessions x {turns} "
        f"turns ({concurrency} at a time; first message {words} words, then {words // 4}), "
        f"every session closed; on/off: close watch every {WATCH_S} s / none (the peer: the "
        f"code before it), each on fresh replicas; bound: watch off, --max-cached-mb "
        f"{BOUND_MB}; served: sessions with a turn there; +RSS: growth over the run"
    )
    print(TABLE.header())
    try:
        for routing in routings:
            route = ROUTINGS[routing]
            results = await run(engine_url, pg, route, sessions, turns, concurrency, words)
            held = {label: h for label, (h, _) in results.items()}
            for line in rows(routing, held["off"], held["on"], held["bound"]):
                print(line)
            print(f"{'':<16}turns/s (the three at once): " + ", ".join(
                f"{label} {sessions * turns / wall:.1f}" for label, (_, wall) in results.items()
            ))  # fmt: skip
    finally:
        engine_proc.terminate()
        engine_proc.wait(timeout=30)


@click.command()
@click.option("--pg", default=lambda: os.environ.get("TR_TEST_POSTGRES_URL", ""),
              help="Postgres URL (default $TR_TEST_POSTGRES_URL; tools/pg_cluster.sh starts one)")  # fmt: skip
@click.option("--sessions", type=int, default=300, show_default=True)
@click.option("--turns", type=int, default=3, show_default=True)
@click.option("--concurrency", type=int, default=16, show_default=True)
@click.option("--words", type=int, default=600, show_default=True,
              help="Words of the first user message (later ones: a quarter).")  # fmt: skip
@click.option("--routings", default="sticky,random", show_default=True)
def main(pg: str, sessions: int, turns: int, concurrency: int, words: int, routings: str) -> None:
    if not pg:
        raise SystemExit(
            'no Postgres: pass --pg URL, or `eval "$(tools/pg_cluster.sh start /tmp/pg)"` first'
        )
    names = routings.split(",")
    unknown = sorted(set(names) - set(ROUTINGS))
    if unknown:
        raise SystemExit(f"unknown routing {unknown}: choose from {', '.join(ROUTINGS)}")
    asyncio.run(bench(pg, sessions, turns, concurrency, words, names))


if __name__ == "__main__":
    main()
