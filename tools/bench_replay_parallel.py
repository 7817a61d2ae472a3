"""Benchmark parallel `replay reclassify`, `replay export` and `replay stats`
(`--jobs ... stats`): one process vs N local
worker processes vs Ray tasks, in the same run, on the same logs; prints a table.

    python tools/bench_replay_parallel.py                         # 2,000 and 20,000 x 40
    python tools/bench_replay_parallel.py --sizes 2000 --repeat 3
    python tools/bench_replay_parallel.py --sizes 200 --turns 10 --jobs reclassify  # quick
    python tools/bench_replay_parallel.py --sizes 2000 --turns 20 --long-first 0.25 \
        --long-turns 100 --jobs reclassify --no-ray      # long sessions first in id order

Logs: the 2,000-session log is `tools/bench_replay.py`'s (same generator, same
cache: per turn MessagesRequest, ChainDecision, RenderedInput, GenerateResult,
ResponseSent, 64 sessions open at once). A larger size is that log copied
size/2,000 times under new session ids (events re-inserted with fresh event ids
and positions after the original's, each copy interleaved as the original is):
the event table and the reduction work grow with the size; arrays are
content-addressed, so the copies share the original's (the database file grows
less than a freshly generated log would, and the page cache is warmer for it).

Each measurement runs in a fresh interpreter on a private copy of the log,
through the same functions and defaults the console command uses:
- `1 proc`: `--workers 1`, the serial baseline;
- `Nw`: `--workers N` local processes (default N = this machine's cores);
- `ray Nc`: `--ray ADDRESS --workers N` against a Ray head started by this
  benchmark on this machine with N CPUs (`ray start --head --block`; started
  once, stopped at the end by its own process id).
Wall is elapsed time (median over --repeat); CPU is user+sys of the driver and
its child processes (Ray's workers are not its children: not counted). On a
shared machine wall time says more about the neighbours than about us, so the
table also gives the CPU path: the driver's CPU plus the busiest worker's
(a worker process counts from its start, a Ray task its job), which is the
wall time when every worker has a core to itself. "Per added core" =
(path(1 proc) / path(N) - 1) / (N - 1): 1.00 is linear. Peak RSS is the
largest single process (driver, worker process or Ray worker, from VmHWM).
The load average is printed because this machine is shared.

`--before-src DIR` (another checkout, e.g. `git worktree add --detach DIR main`)
adds that code's `1 proc` and `Nw` rows, measured in the same run on the same
logs, interleaved with this checkout's (so both see the same neighbours).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A measurement of another checkout (`--src DIR`) imports that checkout's code.
SRC = Path(sys.argv[sys.argv.index("--src") + 1]) if "--src" in sys.argv else ROOT
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from tools import bench_replay  # noqa: E402
from tools.benchkit.memory import status_bytes  # noqa: E402
from tools.benchkit.procs import measure_in_child, repo_env  # noqa: E402
from tools.benchkit.table import Columns  # noqa: E402

BASE_SESSIONS = 2000


# ---------------------------------------------------------------- logs


def scaled_log(size: int, args: argparse.Namespace) -> Path:
    """The base log, or a copy of it `size / base` times larger (see the docstring)."""
    base = min(size, BASE_SESSIONS)
    db = bench_replay.cached_log(base, args)
    if size <= base:
        return db
    copies = size // base
    folder = db.parent.with_name(db.parent.name + f"-x{copies}")
    out = folder / "runs.db"
    if (folder / "complete").exists():
        return out
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    print(f"copying {base} sessions {copies}x into {out}", file=sys.stderr)
    shutil.copyfile(db, out)
    # Closed explicitly and checkpointed: measurements copy the database file alone.
    with contextlib.closing(sqlite3.connect(out)) as conn:
        (top,) = conn.execute("SELECT MAX(position) FROM events").fetchone()
        for k in range(1, copies):
            conn.execute(
                "INSERT INTO events (position, session_id, seq, event_id, type, version, ts,"
                " payload) SELECT position + ?, session_id || ?, seq, randomblob(16), type,"
                " version, ts, payload FROM events WHERE position <= ? ORDER BY position",
                (k * top, f"-c{k}", top),
            )
        conn.commit()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    (folder / "complete").write_text(str(copies))
    return out


# ---------------------------------------------------------------- measurement


def measure(job: str, mode: str, db: str, ray_address: str) -> None:
    import inspect

    from replay.cli import _run
    from replay.export import export_samples
    from replay.reclassify import reclassify
    from replay.rules import Rules

    workers = 1 if mode == "1" else int(mode.removeprefix("ray"))
    ray = ray_address if mode.startswith("ray") else None
    out = Path(db).with_name("samples.jsonl")
    # As the console command runs it: local workers forked up front where the
    # code under test does that (`_run(fork=...)`).
    fork = {"fork": workers} if ray is None and "fork" in inspect.signature(_run).parameters else {}
    t0 = time.perf_counter()
    if job == "reclassify":
        result = _run(
            db,
            lambda store: reclassify(store, Rules(), workers=workers, ray=ray),
            streaming=True,
            **fork,
        )
    elif job == "export":
        result = _run(
            db,
            lambda store: export_samples(store, out, "jsonl", Rules(), workers=workers, ray=ray),
            streaming=True,
            **fork,
        )
    else:
        from replay.stats import log_stats

        # Older code ran stats in one process whatever the cores: its "Nw" row says so.
        parallel = "workers" in inspect.signature(log_stats).parameters
        result = _run(
            db,
            lambda store: (
                log_stats(store, Rules(), workers=workers, ray=ray)
                if parallel
                else log_stats(store, Rules())
            ),
            streaming=True,
            **fork,
        )
    seconds = time.perf_counter() - t0
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    peaks = [status_bytes("VmHWM"), kids.ru_maxrss * 1024]
    partitions = getattr(result, "partitions", [])  # older code's stats had none
    peaks += [p.peak_rss for p in partitions]
    print(
        "\n"
        + json.dumps(
            {
                "seconds": seconds,
                "cpu": own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime,
                # The driver's CPU plus the busiest worker's: the wall time on idle
                # cores (a worker process counts its start-up; a Ray task its job).
                "path_cpu": own.ru_utime
                + own.ru_stime
                + max([p.cpu_seconds for p in partitions], default=0.0),
                "peak_rss_mb": max(peaks) / 2**20,
                "sessions": result.sessions,
                "nodes": len({p.node for p in partitions}) or 1,
            }
        )
    )


def run_measure(
    job: str, mode: str, db: Path, ray_address: str, src: Path | None = None
) -> dict[str, float]:
    """One measurement in a fresh interpreter; `src`: of that checkout's code."""
    with tempfile.TemporaryDirectory(prefix="bench-replay-par-") as tmp:
        copy = Path(tmp) / "runs.db"
        shutil.copyfile(db, copy)
        args = ["--measure", job, mode, str(copy), "--ray-address", ray_address]
        args += ["--src", str(src)] if src is not None else []
        return measure_in_child(__file__, args, f"{job} {mode} on {db}")  # type: ignore[return-value]


# ---------------------------------------------------------------- Ray head


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_ray(cpus: int) -> tuple[subprocess.Popen[bytes], str]:
    """A Ray head on this machine with `cpus` CPUs; returns it and its address."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    head = subprocess.Popen(
        [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            f"--port={port}", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}",
            "--include-dashboard=false", f"--object-store-memory={200 * 2**20}",
        ],
        env=repo_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    probe = f"import ray; ray.init(address={address!r}); ray.shutdown()"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise SystemExit("ray start --head exited; is Ray installed? (pip install .[ray])")
        ok = subprocess.run(
            [sys.executable, "-c", probe], env=repo_env(), capture_output=True, timeout=120
        )
        if ok.returncode == 0:
            return head, address
        time.sleep(2)
    stop_ray(head)
    raise SystemExit("the Ray head did not come up within 180 s")


def stop_ray(head: subprocess.Popen[bytes]) -> None:
    """Stop the head this benchmark started (its process group), never other clusters."""
    try:
        os.killpg(head.pid, 15)
        head.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(head.pid, 9)


# ---------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000])
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=150)
    p.add_argument("--out-tokens", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--layout", choices=("interleaved", "contiguous"), default="interleaved")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    p.add_argument(
        "--jobs",
        nargs="+",
        choices=("reclassify", "export", "stats"),
        default=["reclassify", "export"],
    )
    p.add_argument("--no-ray", action="store_true", help="skip the Ray column")
    p.add_argument("--repeat", type=int, default=1, help="runs per cell (median)")
    p.add_argument("--cache-dir", default="/tmp/tr-bench-replay")
    if hasattr(bench_replay, "add_skew_options"):  # a --src child of an older checkout lacks it
        bench_replay.add_skew_options(p)
    p.add_argument("--measure", nargs=3, metavar=("JOB", "MODE", "DB"), help=argparse.SUPPRESS)
    p.add_argument("--ray-address", default="", help=argparse.SUPPRESS)
    p.add_argument(
        "--before-src", type=Path, default=None, help="another checkout to measure beside this one"
    )
    p.add_argument("--src", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        measure(*args.measure, args.ray_address)
        return

    # Here, not at the top: a `--src` child of an older checkout has no probe.
    from tools.benchkit.cpu import probe_span, speed_probe_ms

    n = args.workers
    modes = ["1", str(n)] + ([] if args.no_ray else [f"ray{n}"])
    # (label, checkout, mode): the before checkout's local rows, then this one's.
    before = args.before_src.resolve() if args.before_src else None
    cells = [("before", before, m) for m in ("1", str(n))] if before else []
    cells += [("", None, m) for m in modes]
    logs = {size: scaled_log(size, args) for size in args.sizes}
    probe_before = speed_probe_ms()
    head, address = (None, "") if args.no_ray else start_ray(n)
    results: dict[tuple[int, str, str], list[dict[str, float]]] = {}
    try:
        for _ in range(args.repeat):
            for size, db in logs.items():
                for job in args.jobs:
                    for label, src, mode in cells:
                        r = run_measure(job, mode, db, address, src)
                        results.setdefault((size, job, label + mode), []).append(r)
                        print(f"  {size} {job} {label}{mode}: {json.dumps(r)}", file=sys.stderr)
    finally:
        if head is not None:
            stop_ray(head)

    print()
    print(
        f"replay reclassify / export (JSONL), {args.turns} turns/session"
        + (
            f" ({args.long_turns} for the first {args.long_first:.0%} in id order)"
            if args.long_first
            else ""
        )
        + f", log {args.layout}; "
        f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f} at the end; "
        f"{probe_span(probe_before)}; median of {args.repeat}"
    )
    table = Columns(
        [
            ("sessions", 9, ">"), ("job", 11, "<"), ("mode", 14, "<"), ("nodes", 6, ">"),
            ("wall s", 8, ">"), ("wall x", 7, ">"), ("vs before", 10, ">"), ("CPU s", 7, ">"),
            ("CPU path s", 11, ">"), ("path x", 7, ">"), ("per added core", 15, ">"),
            ("peak RSS MB", 12, ">"),
        ],
        sep=" ",
    )  # fmt: skip
    print(table.header())
    print(table.rule())
    for size in args.sizes:
        for job in args.jobs:
            for prefix, _src, mode in cells:
                serial = results[(size, job, prefix + "1")]
                base = statistics.median(r["seconds"] for r in serial)
                base_path = statistics.median(r["path_cpu"] for r in serial)
                runs = results[(size, job, prefix + mode)]
                t = statistics.median(r["seconds"] for r in runs)
                path = statistics.median(r["path_cpu"] for r in runs)
                cores = 1 if mode == "1" else int(mode.removeprefix("ray"))
                per_core = f"{(base_path / path - 1) / (cores - 1):.2f}" if cores > 1 else "-"
                label = {"1": "1 proc"}.get(mode, f"{mode}w" if mode.isdigit() else f"ray {cores}c")
                label = f"{prefix} {label}".strip()
                was = results.get((size, job, "before" + mode)) if not prefix else None
                vs = f"{statistics.median(r['seconds'] for r in was) / t:.2f}x" if was else "-"
                cpu = (
                    "-"
                    if mode.startswith("ray")
                    else f"{statistics.median(r['cpu'] for r in runs):.1f}"
                )
                print(
                    table.row(
                        size, job, label, int(max(r["nodes"] for r in runs)), f"{t:.1f}",
                        f"{base / t:.2f}x", vs, cpu, f"{path:.1f}", f"{base_path / path:.2f}x",
                        per_core, f"{max(r['peak_rss_mb'] for r in runs):.0f}",
                    )
                )  # fmt: skip
    print(
        "(wall: elapsed on this shared machine; vs before: the before checkout's wall in the same\n"
        " mode / this one's; CPU: driver + local worker processes; CPU path:\n"
        " the driver's CPU + the busiest worker's, i.e. the wall time on idle cores;\n"
        " per added core = (path x - 1) / (cores - 1), 1.00 = linear; peak RSS: largest process)"
    )


if __name__ == "__main__":
    main()
