"""What closing one long session costs: reading its log and reducing it into samples.

The live server does this at every close (`POST /sessions/{id}/close`), and
`replay export` / `reclassify` once per session. A session of T turns whose
context grows to C tokens has T engine inputs, each the previous one plus the
new tokens, stored as pieces extending it. Read naively that is T separate
arrays (T x C / 2 tokens in all: 300 turns at 120k is 18M tokens, 144 MB as
int64); read as the store does now, every input is a view of the last one.

Each measurement runs in a fresh subprocess on one session written through
the real store (`benchkit.log.write_session`, random ids, SQLite):
- `store`: `load_session` + `reduce_session`, the product's path;
- `copies` (baseline, same run): the same read and reducer, with every
  array made its own int64 copy first, as the close path held them before
  inputs shared one buffer (it then also held an int32 copy of each).
Printed per history length: peak RSS above the process's RSS before the read
(VmHWM), the median time of a close over `--reps` repetitions, and the
sample's length (both modes must give the same samples).

    python tools/bench_close.py [--turns 100,300] [--context 120000] [--reps 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.benchkit.log import write_session  # noqa: E402
from tools.benchkit.memory import MB, status_bytes  # noqa: E402
from tools.benchkit.procs import measure_in_child  # noqa: E402
from tools.benchkit.table import Columns  # noqa: E402

OUT_TOKENS = 50
TABLE = Columns(
    [
        ("turns", 6, ">"), ("|", 1, "<"), ("peak MB", 8, ">"), ("baseline", 9, ">"),
        ("|", 1, "<"), ("close ms", 9, ">"), ("baseline", 9, ">"),
    ],
    sep=" ",
)  # fmt: skip


async def _generate(db: str, turns: int, context: int) -> None:
    from recorder.log.store import open_store

    store = await open_store(db, create=True)
    try:
        await write_session(store, "long", turns, context // turns - OUT_TOKENS, OUT_TOKENS, 1)
    finally:
        await store.close()


async def _close_once(db: str, mode: str) -> tuple[float, str]:
    from recorder.log.store import open_store
    from replay import load_session, reduce_session
    from replay.load import SessionLog, needed_refs
    from replay.rules import Rules

    store = await open_store(db)
    try:
        t0 = time.perf_counter()
        if mode == "store":
            log = await load_session(store, "long")
        else:
            events = await store.read_session("long")
            refs = needed_refs(events, routed_experts=False)
            got = await store.get_arrays(refs, cache=False)
            arrays = {
                r.digest: a.astype(np.int64) if a.dtype.kind == "i" else a.copy()
                for r, a in zip(refs, got, strict=True)
            }
            log = SessionLog("long", list(events), arrays)
        result = reduce_session(log.events, log.arrays, Rules())
        seconds = time.perf_counter() - t0
    finally:
        await store.close()
    digest = json.dumps([len(s.tokens) for s in result.samples])
    return seconds, digest


def measure(db: str, mode: str, reps: int) -> None:
    before = status_bytes("VmRSS")
    first, samples = asyncio.run(_close_once(db, mode))
    peak = status_bytes("VmHWM") - before
    times = [first] + [asyncio.run(_close_once(db, mode))[0] for _ in range(reps - 1)]
    print(json.dumps({"peak": peak, "median_s": statistics.median(times), "samples": samples}))


def _run(db: str, mode: str, reps: int) -> dict[str, object]:
    return measure_in_child(
        __file__, ["--measure", mode, db, "--reps", str(reps)], f"{mode} on {db}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--turns", default="100,300", help="history lengths, comma-separated")
    p.add_argument("--context", type=int, default=120_000, help="tokens at the last turn")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--measure", nargs=2, metavar=("MODE", "DB"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        measure(args.measure[1], args.measure[0], args.reps)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-close-") as tmp:
        for turns in (int(t) for t in args.turns.split(",")):
            db = f"sqlite+aiosqlite:///{tmp}/runs-{turns}.db"
            asyncio.run(_generate(db, turns, args.context))
            store, copies = _run(db, "store", args.reps), _run(db, "copies", args.reps)
            if store["samples"] != copies["samples"]:
                raise SystemExit(f"{turns} turns: the two reads gave different samples")
            rows.append((turns, store, copies))
    print(f"\nclose of one session growing to {args.context:,} tokens, median of {args.reps}")
    print(TABLE.header())
    for turns, store, copies in rows:
        peaks = (f"{run['peak'] / MB:.1f}" for run in (store, copies))  # type: ignore[operator]
        times = (f"{run['median_s'] * 1e3:.1f}" for run in (store, copies))  # type: ignore[operator]
        print(TABLE.row(turns, "|", *peaks, "|", *times))


if __name__ == "__main__":
    main()
