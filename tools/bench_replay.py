"""Benchmark `replay reclassify` on a synthetic log; prints a table.

    python tools/bench_replay.py                       # 500 and 2,000 sessions x 40 turns
    python tools/bench_replay.py --sessions 200 --small 50 --turns 10   # quick

The synthetic log is written through the real store: per turn a
MessagesRequest, ChainDecision, RenderedInput (stored with `extends=` the
chain's previous full sequence, so only new tokens are stored), GenerateResult
(output ids + float32 logprobs) and ResponseSent; random token ids over a
49,152 vocabulary (fixed seed). Logs are cached under --cache-dir keyed by
their parameters; generation runs many sessions concurrently so the store's
group commit batches the writes.

Each measurement runs in a fresh subprocess on a private copy of the cached
log: first a plain scan (read every event page + every array the reducer
needs, no reduction: the baseline), then `reclassify` (stream + reduce +
write the projection). Peak RSS is the subprocess's ru_maxrss. Targets:
reclassify of 2,000 sessions x 40 turns < 60 s, peak RSS < 1 GB and flat
between the small and the large log.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from recorder.events import (  # noqa: E402
    ArrayRef,
    ChainDecision,
    GenerateResult,
    MessagesRequest,
    NewEvent,
    RenderedInput,
    ResponseSent,
    RewardAssigned,
    SessionClosed,
    SessionOpened,
)
from recorder.store import EventStore, open_store  # noqa: E402

GENERATOR_VERSION = 1
VOCAB = 49_152


# ---------------------------------------------------------------- generation


async def write_session(
    store: EventStore, sid: str, turns: int, new_tokens: int, out_tokens: int, seed: int
) -> int:
    rng = np.random.default_rng(seed)
    body = await store.put_array(np.frombuffer(b'{"bench": true}', dtype=np.uint8))
    events: list[NewEvent] = [
        NewEvent(event=SessionOpened(session_id=sid, metadata={"bench": True}, context_length=None))
    ]
    full: ArrayRef | None = None
    for t in range(turns):
        new = rng.integers(0, VOCAB, new_tokens, dtype=np.int32)
        inp = await store.put_array(new, extends=full)
        out = rng.integers(0, VOCAB, out_tokens, dtype=np.int32)
        lps = -rng.random(out_tokens, dtype=np.float32)
        out_ref = await store.put_array(out)
        lp_ref = await store.put_array(lps)
        full = await store.put_array(out, extends=inp)
        rid = f"{sid}-{t}"
        events += [
            NewEvent(
                event=MessagesRequest(
                    request_id=rid, turn=t, body=body, system_digest="main", n_messages=2 * t + 1
                )
            ),
            NewEvent(
                event=ChainDecision(
                    rules_version="bench",
                    request_id=rid,
                    turn=t,
                    chain_id=0,
                    action="new" if t == 0 else "extend",
                    reason="first" if t == 0 else "extends",
                )
            ),
            NewEvent(
                event=RenderedInput(
                    request_id=rid,
                    turn=t,
                    chain_id=0,
                    input_ids=inp,
                    prefix_len=inp.length - new_tokens,
                )
            ),
            NewEvent(
                event=GenerateResult(
                    request_id=rid,
                    turn=t,
                    attempt=0,
                    rid=f"{t:032x}",
                    output_ids=out_ref,
                    logprobs=lp_ref,
                    finish_reason="stop",
                    weight_version="1",
                )
            ),
            NewEvent(
                event=ResponseSent(
                    request_id=rid,
                    turn=t,
                    content=[{"type": "text", "text": "ok"}],
                    stop_reason="end_turn",
                )
            ),
        ]
    events += [NewEvent(event=RewardAssigned(reward=1.0)), NewEvent(event=SessionClosed())]
    for i in range(0, len(events), 500):
        await store.append(sid, events[i : i + 500])
    return len(events)


async def generate(path: Path, sessions: int, args: argparse.Namespace) -> None:
    store = await open_store(str(path), create=True)
    sem = asyncio.Semaphore(args.concurrency)
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        async with sem:
            await write_session(store, f"s{i:06d}", args.turns, args.new_tokens, args.out_tokens, i)
            done += 1
            if done % 100 == 0:
                print(f"  generated {done}/{sessions} sessions", file=sys.stderr, flush=True)

    try:
        await asyncio.gather(*(one(i) for i in range(sessions)))
    finally:
        await store.close()


def cached_log(sessions: int, args: argparse.Namespace) -> Path:
    from recorder.store.migrations import head_revision

    # The schema revision is part of the key: a log written under an older
    # schema is regenerated rather than measured through an upgrade.
    key = json.dumps(
        [GENERATOR_VERSION, head_revision(), sessions, args.turns, args.new_tokens, args.out_tokens]
    )
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    folder = Path(args.cache_dir) / f"log-{sessions}x{args.turns}-{tag}"
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
    n_events = n_sessions = 0
    try:
        async for log in iter_session_logs(store, page_size=page_size):
            n_sessions += 1
            n_events += len(log.events)
    finally:
        await store.close()
    return {"events": n_events, "sessions": n_sessions}


async def reclassify_run(db: str, page_size: int, workers: int = 1) -> dict[str, float]:
    from replay.reclassify import reclassify
    from replay.rules import Rules

    store = await open_store(db)
    try:
        report = await reclassify(store, Rules(), page_size=page_size, workers=workers)
        events = await store.last_position()
    finally:
        await store.close()
    return {"events": events, "sessions": report.sessions, "samples": report.samples}


def measure(mode: str, db: str, page_size: int, piece_cache_mb: int | None) -> None:
    if piece_cache_mb is not None:
        # Shrink the store's caches (decoded pieces, SQLite page caches) so that
        # what is left of the RSS is replay's own working set.
        import recorder.store.sql as sql
        import recorder.store.sqlite as sqlite

        sql.PIECE_CACHE_BYTES = piece_cache_mb * 2**20
        sqlite.WRITER_CACHE_KIB = sqlite.READER_CACHE_KIB = 2048
    t0 = time.perf_counter()
    if mode == "scan":
        out = asyncio.run(scan(db, page_size))
    else:
        out = asyncio.run(
            reclassify_run(db, page_size, workers=int(mode.removeprefix("reclassify")))
        )
    out["seconds"] = time.perf_counter() - t0
    # Largest of this process and any worker process (each its own peak).
    peak = max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
    )
    out["peak_rss_mb"] = peak / 1024
    print(json.dumps(out))


def run_measure(
    mode: str, db: Path, page_size: int, piece_cache_mb: int | None = None
) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        copy = Path(tmp) / "runs.db"
        shutil.copyfile(db, copy)
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--measure",
                mode,
                str(copy),
                "--page-size",
                str(page_size),
                *(["--piece-cache-mb", str(piece_cache_mb)] if piece_cache_mb is not None else []),
            ],
            capture_output=True,
            text=True,
        )
    if proc.returncode != 0:
        raise SystemExit(f"measurement {mode} on {db} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sessions", type=int, default=2000)
    p.add_argument("--small", type=int, default=500, help="the smaller log for the RSS comparison")
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=150, help="inserted tokens per turn")
    p.add_argument("--out-tokens", type=int, default=100, help="model tokens per turn")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--page-size", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2, help="processes for the parallel run")
    p.add_argument("--cache-dir", default="/tmp/tr-bench-replay")
    p.add_argument(
        "--piece-cache-mb",
        type=int,
        default=None,
        help="shrink the store's caches: decoded-piece LRU to this size, SQLite page caches "
        "to 2 MiB (default: the store's own sizes)",
    )
    p.add_argument("--measure", nargs=2, metavar=("MODE", "DB"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        measure(args.measure[0], args.measure[1], args.page_size, args.piece_cache_mb)
        return

    rows = []
    for n in sorted({args.small, args.sessions}):
        db = cached_log(n, args)
        base = run_measure("scan", db, args.page_size, args.piece_cache_mb)
        red = run_measure("reclassify1", db, args.page_size, args.piece_cache_mb)
        par = run_measure(f"reclassify{args.workers}", db, args.page_size, args.piece_cache_mb)
        rows.append((n, db.stat().st_size, base, red, par))

    print()
    print(
        f"replay reclassify: {args.turns} turns/session, {args.new_tokens} inserted + "
        f"{args.out_tokens} model tokens per turn, page size {args.page_size}"
    )
    w = args.workers
    header = (
        f"{'sessions':>9} {'events':>9} {'db MB':>6} {'scan s':>7} {'reclass s':>10} "
        f"{'events/s':>9} {'vs scan':>8} {f'{w} workers s':>12} {'events/s':>9} "
        f"{'scan RSS MB':>12} {'reclass RSS MB':>15} {f'{w}w RSS MB':>10}"
    )
    print(header)
    print("-" * len(header))
    for n, size, base, red, par in rows:
        print(
            f"{n:>9} {int(red['events']):>9} {size / 2**20:>6.0f} {base['seconds']:>7.1f} "
            f"{red['seconds']:>10.1f} {red['events'] / red['seconds']:>9,.0f} "
            f"{red['seconds'] / base['seconds']:>7.2f}x {par['seconds']:>12.1f} "
            f"{par['events'] / par['seconds']:>9,.0f} {base['peak_rss_mb']:>12.0f} "
            f"{red['peak_rss_mb']:>15.0f} {par['peak_rss_mb']:>10.0f}"
        )
    if len(rows) == 2:
        (n0, _, _, r0, _), (n1, _, _, r1, _) = rows
        print(
            f"\npeak RSS {n1} vs {n0} sessions: {r1['peak_rss_mb'] / r0['peak_rss_mb']:.2f}x "
            f"(sessions {n1 / n0:.0f}x); reclassify of {n1} sessions: {r1['seconds']:.1f} s "
            f"(target < 60 s), peak RSS {r1['peak_rss_mb']:.0f} MB (target < 1024 MB)"
        )


if __name__ == "__main__":
    main()
