"""Memory of `recorder serve`: idle RSS by parser backend, RSS per open 100k session from
8 to 32 sessions, and a census of open 100k sessions.

Three tables, each with its peer measured in the same run:

  idle       RSS of a started, healthy `recorder serve` holding no session, on a
             log it opened before (a restart: the common start) and on a new
             one, median over `--idle-rounds` rounds, the default parser
             backend (SGLang's parsers) beside the builtin one; with
             `--before-src DIR` the same for that checkout (a worktree of
             main), rounds interleaved.
  slope      RSS per open session, decisively: one server per checkout opens
             sessions in stages (`--stages`, e.g. 8, 16, 32), grows each to
             `--context` tokens and gives every open session one more turn,
             and samples its RSS after each stage. Per session: RSS growth / n
             at each stage (what n sessions cost, with every process-wide cache
             they fill), and the marginal cost (least-squares slope of RSS over
             the stages: what one more session costs once caches of fixed size
             are warm), medians over `--repeats` runs, checkouts interleaved.
             Variants (`--variant NAME=ARG,ARG`) run this checkout with other
             options, e.g. the engine body cache off: its cap is a per-process
             cost once reached, its per-session share below it.
  census     `--sessions` sessions shaped like Claude Code's (bench_training's
             conversations) grown to `--context` tokens in one server, which
             runs with a census probe (`--serve`, below). Per open session:
             the bytes each structure of its state keeps alive (benchkit.census:
             each object counted once, views counted by the buffer they keep
             alive), what the store's piece cache, SQLite's allocator and
             glibc's heap grew by, divided by the sessions, and the measured
             RSS growth per session, measured in runs without the probe (its
             own allocations would count): this checkout's and, with
             `--before-src`, that checkout's, same sessions.

`python -m tools.bench_session_memory --serve SERVE_ARGS` is `recorder serve`
with the probe: on SIGUSR1 it writes the census as JSON to $CENSUS_FILE; with
CENSUS_TRACEMALLOC=N (frames) in its environment it traces allocations from the
start, and each census after the first adds the heap's growth since the first by
allocating traceback (key "tracemalloc" of `--census-json`).

    python -m tools.bench_session_memory [--sessions 8] [--context 100000]
        [--stages 8,16,32] [--repeats 3] [--variant 'no body cache=--engine-body-cache-mb,0']
        [--idle-rounds 3] [--before-src DIR] [--no-idle] [--no-slope] [--no-census]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from rich.table import Table

from tools.bench_training import Driver
from tools.benchkit.census import STRUCTURES
from tools.benchkit.conversation import words_per_token
from tools.benchkit.engine import EngineProcess, fixture_tokenizer
from tools.benchkit.memory import MB
from tools.benchkit.procs import REPO
from tools.benchkit.recorder import RecorderProcess, idle_rss
from tools.benchkit.stats import slope
from tools.benchkit.table import console, rich_table

kB = 1024

# --------------------------------------------------------------------------
# The probe, inside the server process
# --------------------------------------------------------------------------


def serve_with_census(argv: list[str]) -> None:
    """`recorder serve ARGV`, writing `benchkit.census.census` to $CENSUS_FILE on SIGUSR1."""
    import recorder.server.app as app
    from recorder.cli import main
    from tools.benchkit import census

    contexts: list[Any] = []
    make_context = app.make_context

    def recording(**kwargs: Any) -> Any:
        ctx = make_context(**kwargs)
        contexts.append(ctx)
        return ctx

    app.make_context = recording  # type: ignore[assignment]

    traced = bool(os.environ.get("CENSUS_TRACEMALLOC"))
    snapshots: list[Any] = []
    if traced:  # where the heap grew between two censuses, by allocating line
        import tracemalloc

        tracemalloc.start(int(os.environ["CENSUS_TRACEMALLOC"]))

    def dump(signum: int, frame: object) -> None:
        loop = asyncio.events._get_running_loop()
        data = census.census(contexts[-1], shared=[loop] if loop else [])
        if traced:
            snapshots.append(tracemalloc.take_snapshot())
            if len(snapshots) > 1:
                diff = snapshots[-1].compare_to(snapshots[0], "traceback")[:40]
                data["tracemalloc"] = [
                    [d.size_diff, d.count_diff, d.traceback.format()] for d in diff
                ]
        Path(os.environ["CENSUS_FILE"]).write_text(json.dumps(data))

    signal.signal(signal.SIGUSR1, dump)
    main(["serve", *argv])


# --------------------------------------------------------------------------
# Idle RSS
# --------------------------------------------------------------------------


async def idle_table_data(
    engine: EngineProcess, tmp: Path, roots: dict[str, Path], rounds: int
) -> dict[tuple[str, str, str], list[int]]:
    """Idle RSS per (checkout, backend, log): on a log it opened before (a restart) and on
    a new one (a first start, which creates the schema), the cells interleaved per round."""
    out: dict[tuple[str, str, str], list[int]] = {}
    cells = [(name, backend) for name in roots for backend in ("default", "builtin")]
    for name, backend in cells:  # creates each log: the rounds below start on an existing one
        await idle_rss(
            engine.url, str(tmp / f"idle-{name}-{backend}.db"), _flag(backend), roots[name]
        )
    for k in range(rounds):
        for name, backend in cells:
            for log in ("existing", "new"):
                suffix = f"-new{k}" if log == "new" else ""
                db = tmp / f"idle-{name}-{backend}{suffix}.db"
                rss = await idle_rss(engine.url, str(db), _flag(backend), roots[name])
                out.setdefault((name, backend, log), []).append(rss)
    return out


def _flag(backend: str) -> str | None:
    return None if backend == "default" else backend


def idle_table(data: dict[tuple[str, str, str], list[int]]) -> Table:
    title = (
        "idle RSS of `recorder serve` (healthy, no session), median of "
        f"{len(next(iter(data.values())))} rounds, on a log it opened before (a restart) and on "
        "a new one; goal: <= 150 MB with the default backend"
    )
    rows = []
    for name, log in dict.fromkeys((n, g) for n, _, g in data):
        default = statistics.median(data[(name, "default", log)])
        builtin = statistics.median(data[(name, "builtin", log)])
        rows.append(
            (
                name,
                log,
                f"{default / MB:.1f} MB",
                f"{builtin / MB:.1f} MB",
                f"{(default - builtin) / MB:+.1f} MB",
            )
        )
    cols = ("checkout", "log", "default backend (sglang)", "builtin backend", "sglang's cost")
    return rich_table(title, cols, rows)


# --------------------------------------------------------------------------
# RSS per open session, over stages of open sessions
# --------------------------------------------------------------------------


async def slope_run(
    engine: EngineProcess, tmp: Path, args: argparse.Namespace, root: Path, extra: list[str]
) -> dict[str, Any]:
    """One server of checkout `root` (with `extra` options): its RSS with the warm-up
    session closed, then after each stage of `--stages` open sessions at `--context`."""
    db = tmp / f"slope-{root.name}-{len(os.listdir(tmp))}.db"
    recorder = RecorderProcess(engine.url, str(db), ["--log-level", "WARNING", *extra], root=root)
    result: dict[str, Any] = {"rss": [], "contexts": []}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            await recorder.wait_healthy(http)
            driver = Driver(http, recorder, args)
            wpt = words_per_token(fixture_tokenizer())
            await _warm_up(driver)
            result["rss_before"] = recorder.rss()
            for n in args.stages:
                opened = Driver(http, recorder, args)  # this stage's new sessions
                for i in range(len(driver.sessions), n):
                    await opened.open(i)
                await opened.round(None)
                await opened.grow_to(args.context, wpt)
                driver.sessions += opened.sessions
                driver.context.update(opened.context)
                await driver.round(max(1, round(args.new_tokens * wpt)))  # every open one
                await asyncio.sleep(0.5)
                result["rss"].append(recorder.rss())
                result["contexts"].append(statistics.fmean(driver.context.values()))
    finally:
        await recorder.stop()
    return result


async def _warm_up(driver: Driver) -> None:
    """A short session, closed: what any first session loads (templates, statements)
    is not charged to the sessions measured."""
    warm = await driver.open(10_000)
    for k in range(3):
        await driver.turn(warm, driver.sessions[0][1], None if k == 0 else 200)
    await driver.close_all()
    await asyncio.sleep(0.5)


def slope_figures(result: dict[str, Any], stages: list[int]) -> dict[str, float]:
    """Per session: RSS growth / n at each stage, and the marginal slope over the stages."""
    out = {
        f"{n}": (rss - result["rss_before"]) / n
        for n, rss in zip(stages, result["rss"], strict=True)
    }
    out["marginal"] = slope(stages, result["rss"])
    return out


def slope_table(data: dict[str, list[dict[str, Any]]], stages: list[int], context: float) -> Table:
    runs = len(next(iter(data.values())))
    title = (
        f"RSS per open session at {context:,.0f} tokens of context (mean), `recorder serve` "
        f"without a probe, median of {runs} runs (checkouts interleaved): growth / n with n "
        "sessions open, and the marginal cost (slope of RSS over n); goal: <= 1.5 MB"
    )
    rows = []
    for name, results in data.items():
        figures = [slope_figures(r, stages) for r in results]
        cells = [
            f"{statistics.median(f[key] for f in figures) / MB:.2f} MB"
            for key in [*map(str, stages), "marginal"]
        ]
        top = statistics.median(r["rss"][-1] for r in results) / MB
        start = statistics.median(r["rss_before"] for r in results) / MB
        rows.append((name, *cells, f"{start:.0f} -> {top:.0f} MB"))
    cols = ("checkout", *(f"{n} sessions" for n in stages), "marginal (slope)", "RSS")
    return rich_table(title, cols, rows)


async def slope_data(
    engine: EngineProcess, tmp: Path, args: argparse.Namespace, roots: dict[str, Path]
) -> dict[str, list[dict[str, Any]]]:
    """`--repeats` rounds of one run per checkout and variant, interleaved."""
    cells: dict[str, tuple[Path, list[str]]] = {"this": (REPO, list(args.serve_arg))}
    for spec in args.variant:
        name, _, options = spec.partition("=")
        cells[f"this, {name}"] = (REPO, [*args.serve_arg, *filter(None, options.split(","))])
    if "before" in roots:
        cells["before"] = (roots["before"], [])
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in cells}
    for _ in range(args.repeats):
        for name, (root, extra) in cells.items():
            out[name].append(await slope_run(engine, tmp, args, root, extra))
    return out


# --------------------------------------------------------------------------
# Census
# --------------------------------------------------------------------------


async def census_run(
    engine: EngineProcess, tmp: Path, args: argparse.Namespace, root: Path, probe: bool
) -> dict[str, Any]:
    """One server of checkout `root`: its RSS with the warm-up session closed and with
    `--sessions` open at `--context`; with the probe, the census at both points."""
    out = tmp / f"census-{os.getpid()}.json"
    os.environ["CENSUS_FILE"] = str(out)
    module = ["tools.bench_session_memory", "--serve"] if probe else []
    db = tmp / f"census-{root.name}-{probe}.db"
    extra = ["--log-level", "WARNING"]
    if root.resolve() == REPO.resolve():  # this checkout's own options (`--serve-arg`)
        extra += args.serve_arg
    recorder = RecorderProcess(engine.url, str(db), extra, root=root, module=module)
    result: dict[str, Any] = {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            await recorder.wait_healthy(http)
            driver = Driver(http, recorder, args)
            wpt = words_per_token(fixture_tokenizer())
            await _warm_up(driver)
            result["rss_before"] = recorder.rss()
            if probe:
                base = await take_census(recorder, out)
            for i in range(args.sessions):
                await driver.open(i)
            await driver.round(None)
            await driver.grow_to(args.context, wpt)
            await driver.round(max(1, round(args.new_tokens * wpt)))  # one ordinary turn each
            await asyncio.sleep(0.5)
            result["rss_open"] = recorder.rss()
            result["contexts"] = list(driver.context.values())
            if probe:
                result["census"] = await take_census(recorder, out)
                result["census"]["base"] = base
            else:  # what reading a session back from the log costs its close
                started = time.perf_counter()
                await driver.close_all()
                result["close_s"] = (time.perf_counter() - started) / args.sessions
    finally:
        await recorder.stop()
    return result


async def take_census(recorder: RecorderProcess, out: Path) -> dict[str, Any]:
    """Signal the probe and read what it wrote."""
    out.unlink(missing_ok=True)
    recorder.proc.send_signal(signal.SIGUSR1)
    waits = 6000 if os.environ.get("CENSUS_TRACEMALLOC") else 600  # tracing: snapshots too
    for _ in range(waits):
        await asyncio.sleep(0.1)
        if out.exists() and out.stat().st_size:
            await asyncio.sleep(0.1)
            try:
                return json.loads(out.read_text())  # type: ignore[no-any-return]
            except ValueError:
                continue  # still being written
    raise RuntimeError(f"the server wrote no census in {waits / 10:.0f} s")


def _mean(values: list[int]) -> float:
    return statistics.fmean(values) if values else 0.0


def census_table(after: dict[str, Any], plain: dict[str, dict[str, Any]], n: int) -> Table:
    """Per open session: each structure, the process-wide growth / n, RSS growth / n."""
    c = after["census"]
    sessions = c["sessions"]
    context = _mean(after["contexts"])
    title = (
        f"per open session: {n} sessions at {context:,.0f} tokens of context (mean), in one "
        "`recorder serve`; structures counted once each, views by the buffer they keep alive"
    )
    rows: list[tuple[str, ...]] = []

    def row(what: str, nbytes: float) -> None:
        rows.append((what, f"{nbytes / kB:,.0f} kB", f"{nbytes / max(context, 1):.2f}"))

    for name in STRUCTURES:
        row(name, _mean([s[name] for s in sessions]))
    total = _mean([sum(s.values()) for s in sessions])
    row("= the sessions' states", total)
    row("(the registry's own estimate, held_bytes)", _mean(c["held_bytes"]))
    pieces = c["piece_cache"]
    base = c.get("base", {})
    base_pieces = base.get("piece_cache", {})
    for key in sorted(k for k in pieces if k.endswith(" bytes")):
        dtype = key.removesuffix(" bytes")
        grown = {
            what: pieces.get(f"{dtype} {what}", 0) - base_pieces.get(f"{dtype} {what}", 0)
            for what in ("bytes", "items", "pieces")
        }
        what = f"{grown['pieces'] / n:.0f} pieces, {grown['items'] / n:,.0f} items"
        row(f"store piece cache: {dtype} ({what}, charged)", grown["bytes"] / n)
    shared, base_shared = c["shared"], base.get("shared", {})
    for key in ("engine body cache", "tokenizer word cache"):
        if key in shared:
            row(f"{key} (per process, grown / n)", (shared[key] - base_shared.get(key, 0)) / n)
    cap = shared["engine body cache: cap"]
    rows.append(
        (
            "engine body cache: cap (per process, --engine-body-cache-mb)",
            f"{cap / MB:.0f} MB",
            f"reached at ~{cap / max(shared['engine body cache'] / max(n, 1), 1):.0f} sessions",
        )
    )
    sqlite = c["sqlite"] - base.get("sqlite", 0)
    row("SQLite allocator (page caches; grows with the log)", sqlite / n)
    heap = c["malloc"]
    for key in ("in use", "free, held", "mmapped"):
        row(f"glibc heap {key} (all of the process)", (heap[key] - base["malloc"][key]) / n)
    py, py_base = c["pymalloc"], base["pymalloc"]
    for key in ("in use", "free"):
        row(f"Python small-object arenas: {key}", (py[key] - py_base[key]) / n)
    for name, result in plain.items():
        rss = (result["rss_open"] - result["rss_before"]) / n
        start, end = result["rss_before"] / MB, result["rss_open"] / MB
        row(f"RSS growth, {name} (no probe; {start:.1f} -> {end:.1f} MB)", rss)
    for name, result in plain.items():
        rows.append(
            (f"close (reads the session back), {name}", f"{result['close_s'] * 1e3:.0f} ms", "")
        )
    return rich_table(title, ("what", "per session", "bytes / context token"), rows, left=1)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = EngineProcess(int(args.context * 1.5) + 8192, 0.0)
    await engine.start()
    roots = {"this": REPO}
    if args.before_src:
        roots["before"] = Path(args.before_src).resolve()
    out = console()
    results: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(dir=args.db_dir) as tmp_dir:
            tmp = Path(tmp_dir)
            if args.idle:
                idle = results["idle"] = await idle_table_data(engine, tmp, roots, args.idle_rounds)
                out.print(idle_table(idle))
            if args.slope:
                slopes = results["slope"] = await slope_data(engine, tmp, args, roots)
                context = statistics.fmean(
                    r["contexts"][-1] for runs in slopes.values() for r in runs
                )
                out.print(slope_table(slopes, args.stages, context))
            if args.census:
                # RSS growth without the probe (its own allocations would count), every
                # checkout alike; then the census in a run of its own.
                plain = {
                    name: await census_run(engine, tmp, args, root, probe=False)
                    for name, root in roots.items()
                }
                after = await census_run(engine, tmp, args, REPO, probe=True)
                results.update(census=after["census"], plain=plain)
                out.print(census_table(after, plain, args.sessions))
                if args.census_json:
                    Path(args.census_json).write_text(json.dumps(after, indent=1))
    finally:
        await engine.stop()
    return results


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (its tables printed); what it measured, for tests."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        serve_with_census(argv[1:])
        return {}
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--context", type=int, default=100_000, help="tokens each session reaches")
    ap.add_argument("--new-tokens", type=int, default=250, help="growth of the last turn")
    ap.add_argument("--growth-tokens", type=int, default=8000, help="largest growth turn")
    ap.add_argument("--instructions-words", type=int, default=2000)
    ap.add_argument("--tools", type=int, default=16, help="tools besides Read/Bash/Edit/Grep")
    ap.add_argument("--idle-rounds", type=int, default=3)
    ap.add_argument("--idle", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--census", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--slope", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--stages", type=_ints, default=[8, 16, 32], help="slope: open sessions at each sample"
    )
    ap.add_argument("--repeats", type=int, default=3, help="slope: runs per checkout")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="slope: also this checkout as NAME=ARG,ARG (its `recorder serve` options), "
        "e.g. 'no body cache=--engine-body-cache-mb,0'",
    )
    ap.add_argument("--before-src", default=None, help="another checkout (a worktree of main)")
    ap.add_argument("--db-dir", default=None, help="where the SQLite files go")
    ap.add_argument("--census-json", default=None, help="also write the raw census here")
    ap.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="census: an argument for this checkout's `recorder serve` (repeat it), "
        "e.g. --serve-arg=--engine-body-cache-mb --serve-arg=0",
    )
    return asyncio.run(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
