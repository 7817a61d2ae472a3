"""Benchmark `replay reclassify` on a synthetic log, as a user runs it; prints a table.

    python tools/bench_replay.py                       # 500 and 2,000 sessions x 40 turns
    python tools/bench_replay.py --sessions 200 --small 50 --turns 10   # quick

The synthetic log is written through the real store: per turn a
MessagesRequest, ChainDecision, RenderedInput (stored with `extends=` the
chain's previous full sequence, so only new tokens are stored), GenerateResult
(output ids + float32 logprobs) and ResponseSent; random token ids over a
49,152 vocabulary (fixed seed). Logs are cached under --cache-dir keyed by
their parameters. As a live server writes it (`--layout interleaved`, the
default), each turn is its own append and `--concurrency` sessions are open
at once, so a session's events are spread over the whole log between other
sessions' turns; `--layout contiguous` writes each session in one piece.
`--long-first F --long-turns N`: the first F of the sessions in id order run N
turns (as the rollout driver's ids sort a long task's samples side by side),
for the parallel split (`bench_replay_parallel.py`).

Each measurement runs in a fresh subprocess on a private copy of the cached
log, in the product's default configuration (nothing is patched):
- scan: `iter_session_logs` over `open_store(db)` (read every event page and
  every array the reducer needs, no reduction): the baseline;
- CLI: `replay reclassify --db DB` (the console command, run in-process);
- API: `reclassify(await open_store(db), Rules())` (a Python caller's path,
  store opened with the default caches);
- CLI Nw: `replay reclassify --db DB --workers N`.
Peak RSS is the subprocess's VmHWM (for workers: the largest process).
Targets: reclassify of 2,000 sessions x 40 turns < 60 s, peak RSS < 1 GB and
flat between the small and the large log (ratio ~1.0, not ~sessions ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import resource
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from recorder.log.store import open_store  # noqa: E402
from tools.benchkit.log import write_session  # noqa: E402
from tools.benchkit.memory import status_bytes  # noqa: E402
from tools.benchkit.procs import measure_in_child  # noqa: E402
from tools.benchkit.table import Columns  # noqa: E402

GENERATOR_VERSION = 2


# ---------------------------------------------------------------- generation


async def generate(path: Path, sessions: int, args: argparse.Namespace) -> None:
    store = await open_store(str(path), create=True)
    sem = asyncio.Semaphore(args.concurrency)
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        async with sem:
            await write_session(
                store,
                f"s{i:06d}",
                session_turns(i, sessions, args),
                args.new_tokens,
                args.out_tokens,
                i,
                interleaved=args.layout == "interleaved",
            )
            done += 1
            if done % 100 == 0:
                print(f"  generated {done}/{sessions} sessions", file=sys.stderr, flush=True)

    try:
        await asyncio.gather(*(one(i) for i in range(sessions)))
    finally:
        await store.close()


def add_skew_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--long-first", type=float, default=0.0, help="the first F of the sessions (id order) ..."
    )
    p.add_argument("--long-turns", type=int, default=160, help="... run this many turns")


def session_turns(i: int, sessions: int, args: argparse.Namespace) -> int:
    """Turns of the i-th session (in id order): `--long-turns` for the first `--long-first`."""
    long_first = getattr(args, "long_first", 0.0)
    return args.long_turns if i < long_first * sessions else args.turns


def cached_log(sessions: int, args: argparse.Namespace) -> Path:
    from recorder.log.store.migrations import head_revision

    # The schema revision is part of the key: a log written under an older
    # schema is regenerated rather than measured through an upgrade.
    key = json.dumps(
        [
            GENERATOR_VERSION,
            head_revision(),
            sessions,
            args.turns,
            args.new_tokens,
            args.out_tokens,
            args.layout,
            args.concurrency,
            # Only a skewed log's key names the skew (the uniform logs keep their cache).
            *([args.long_first, args.long_turns] if getattr(args, "long_first", 0.0) else []),
        ]
    )
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    folder = Path(args.cache_dir) / f"log-{sessions}x{args.turns}-{args.layout}-{tag}"
    db = folder / "runs.db"
    if (folder / "complete").exists():
        return db
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    print(f"generating {sessions} sessions x {args.turns} turns into {db}", file=sys.stderr)
    t0 = time.perf_counter()
    asyncio.run(generate(db, sessions, args))
    print(f"  done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    (folder / "complete").write_text(key)
    return db


# ---------------------------------------------------------------- measurement


async def scan(db: str, page_size: int) -> dict[str, float]:
    from replay.load import iter_session_logs

    store = await open_store(db)
    n_sessions = 0
    try:
        async for _log in iter_session_logs(store, page_size=page_size):
            n_sessions += 1
    finally:
        await store.close()
    return {"sessions": n_sessions}


async def reclassify_api(db: str, page_size: int) -> dict[str, float]:
    from replay.reclassify import reclassify
    from replay.rules import Rules

    store = await open_store(db)
    try:
        report = await reclassify(store, Rules(), page_size=page_size)
    finally:
        await store.close()
    return {"sessions": report.sessions}


def reclassify_cli(db: str, page_size: int, workers: int) -> dict[str, float]:
    from replay.cli import main

    args = ["reclassify", "--db", db, "--page-size", str(page_size), "--workers", str(workers)]
    main.main(args=args, standalone_mode=False)
    return {}


def measure(mode: str, db: str, page_size: int) -> None:
    t0 = time.perf_counter()
    if mode == "scan":
        out = asyncio.run(scan(db, page_size))
    elif mode == "api":
        out = asyncio.run(reclassify_api(db, page_size))
    else:
        out = reclassify_cli(db, page_size, workers=int(mode.removeprefix("cli")))
    out["seconds"] = time.perf_counter() - t0
    # Largest of this process and any worker process (each its own peak).
    # This process's own peak since its exec (VmHWM, not RUSAGE_SELF: see status_bytes).
    own_kib = status_bytes("VmHWM") // 1024
    peak = max(own_kib, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    out["peak_rss_mb"] = peak / 1024
    with sqlite3.connect(db) as conn:
        (out["events"],) = conn.execute("SELECT COUNT(*) FROM events").fetchone()
    print("\n" + json.dumps(out))


def run_measure(mode: str, db: Path, page_size: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        copy = Path(tmp) / "runs.db"
        shutil.copyfile(db, copy)
        args = ["--measure", mode, str(copy), "--page-size", str(page_size)]
        return measure_in_child(__file__, args, f"measurement {mode} on {db}")  # type: ignore[return-value]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sessions", type=int, default=2000)
    p.add_argument("--small", type=int, default=500, help="the smaller log for the RSS comparison")
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=150, help="inserted tokens per turn")
    p.add_argument("--out-tokens", type=int, default=100, help="model tokens per turn")
    p.add_argument("--concurrency", type=int, default=64, help="sessions open at once")
    p.add_argument("--layout", choices=("interleaved", "contiguous"), default="interleaved")
    p.add_argument("--page-size", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2, help="processes for the parallel run")
    p.add_argument("--cache-dir", default="/tmp/tr-bench-replay")
    add_skew_options(p)
    p.add_argument("--measure", nargs=2, metavar=("MODE", "DB"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        measure(args.measure[0], args.measure[1], args.page_size)
        return

    w = args.workers
    modes = ["scan", "cli1", "api", f"cli{w}"]
    rows = []
    for n in sorted({args.small, args.sessions}):
        db = cached_log(n, args)
        runs = {m: run_measure(m, db, args.page_size) for m in modes}
        rows.append((n, db.stat().st_size, runs))

    print()
    print(
        f"replay reclassify: {args.turns} turns/session, {args.new_tokens} inserted + "
        f"{args.out_tokens} model tokens per turn, page size {args.page_size}, default caches; "
        f"log {args.layout}"
        + (f" ({args.concurrency} sessions open at once)" if args.layout == "interleaved" else "")
    )
    table = Columns(
        [
            ("sessions", 9, ">"), ("events", 9, ">"), ("db MB", 6, ">"), ("scan s", 7, ">"),
            ("CLI s", 7, ">"), ("events/s", 9, ">"), ("vs scan", 8, ">"), ("API s", 7, ">"),
            (f"CLI {w}w s", 9, ">"), ("events/s", 9, ">"), ("scan RSS", 9, ">"),
            ("CLI RSS", 8, ">"), ("API RSS", 8, ">"), (f"{w}w RSS", 8, ">"),
        ],
        sep=" ",
    )  # fmt: skip
    print(table.header())
    print(table.rule())
    for n, size, r in rows:
        scan_, cli, api, par = r["scan"], r["cli1"], r["api"], r[f"cli{w}"]
        print(
            table.row(
                n,
                int(cli["events"]),
                f"{size / 2**20:.0f}",
                f"{scan_['seconds']:.1f}",
                f"{cli['seconds']:.1f}",
                f"{cli['events'] / cli['seconds']:,.0f}",
                f"{cli['seconds'] / scan_['seconds']:.2f}x",
                f"{api['seconds']:.1f}",
                f"{par['seconds']:.1f}",
                f"{par['events'] / par['seconds']:,.0f}",
                *(f"{run['peak_rss_mb']:.0f}" for run in (scan_, cli, api, par)),
            )
        )
    print("(seconds are wall time; RSS is peak resident memory in MB)")
    if len(rows) == 2:
        (n0, _, r0), (n1, _, r1) = rows
        ratios = ", ".join(
            f"{label} {r1[m]['peak_rss_mb'] / r0[m]['peak_rss_mb']:.2f}x"
            for label, m in (
                ("scan", "scan"),
                ("CLI", "cli1"),
                ("API", "api"),
                (f"{w}w", f"cli{w}"),
            )
        )
        big = r1["cli1"]
        worst = max(r1[m]["peak_rss_mb"] for m in modes)
        print(
            f"\npeak RSS {n1} vs {n0} sessions ({n1 / n0:.0f}x the sessions): {ratios}\n"
            f"reclassify of {n1} sessions (CLI): {big['seconds']:.1f} s (target < 60 s); "
            f"largest peak RSS {worst:.0f} MB (target < 1024 MB)"
        )


if __name__ == "__main__":
    main()
