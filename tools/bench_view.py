"""Benchmark `replay view` in a real browser on a large log; prints a table.

    python tools/bench_view.py                          # 10,000 sessions x 40 turns + a 120k-token one
    python tools/bench_view.py --sessions 500 --repeat 3   # quick

The log is written through the real store with `tools/benchkit/log.py`'s
synthetic sessions (per turn: request, chain decision, rendered input stored
as a delta, generate result with logprobs, response; 150 new + 100 output
tokens per turn), plus one long session whose final sample holds about
--big-tokens tokens. Logs are cached under --cache-dir keyed by parameters.

`replay view --db DB` runs as a subprocess; chromium (Debian's, through
Playwright) opens each page --repeat times:
- runs page: navigation start -> first contentful paint (the browser's own
  `first-contentful-paint` entry), 50 rows of 10,000 sessions sorted by start;
- session page (a 40-turn session): navigation -> first contentful paint;
- sample page of the 120k-token sample: navigation -> the first chunk of tokens
  is on the page and the main thread answers (time to interactive);
against `replay show --db DB --session ID` (a fresh process reading and
reducing the same session, as a user would in a terminal) in the same run.
At start the server folds the whole log into the runs index; pages answer
meanwhile with what is indexed so far: the runs page's answer time right after
start and the time until the index is complete are printed on their own line. Medians over --repeat; "cold" is the
first visit (the session is reduced), "warm" the median of the rest.
Targets: runs < 1 s, session < 1 s, 120k sample interactive < 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from recorder.log.events import (  # noqa: E402
    ChainDecision,
    GenerateResult,
    MessagesRequest,
    NewEvent,
    RenderedInput,
    ResponseSent,
    RewardAssigned,
    SessionClosed,
    SessionOpened,
    TitoVerdict,
)
from recorder.log.store import open_store  # noqa: E402
from tools.benchkit.log import VOCAB  # noqa: E402
from tools.benchkit.procs import repo_env  # noqa: E402
from tools.benchkit.stats import median  # noqa: E402
from tools.benchkit.table import console, rich_table  # noqa: E402

GENERATOR_VERSION = 1
BIG = "big-120k"
CHROMIUM = "/usr/bin/chromium"


# ---------------------------------------------------------------- generation


async def template(
    store: Any, turns: int, new_tokens: int, out_tokens: int, seed: int
) -> list[Any]:
    """One session's turn events (arrays stored), to be appended under many ids.

    Sessions made from one template share their arrays (the store is content
    addressed), which keeps writing 10,000 sessions to minutes; every session
    still has all of its own events, which is what the runs index reads.
    """
    rng = np.random.default_rng(seed)
    body = await store.put_array(np.frombuffer(b'{"bench": true}', dtype=np.uint8))
    events: list[Any] = []
    full = None
    for t in range(turns):
        new = rng.integers(0, VOCAB, new_tokens, dtype=np.int32)
        inp = await store.put_array(new, extends=full)
        out = rng.integers(0, VOCAB, out_tokens, dtype=np.int32)
        out_ref = await store.put_array(out)
        lp_ref = await store.put_array(-rng.random(out_tokens, dtype=np.float32))
        full = await store.put_array(out, extends=inp)
        rid = f"r{t}"
        events += [
            MessagesRequest(
                request_id=rid, turn=t, body=body, system_digest="main", n_messages=2 * t + 1
            ),
            ChainDecision(
                rules_version="bench",
                request_id=rid,
                turn=t,
                chain_id=0,
                action="new" if t == 0 else "extend",
                reason="first" if t == 0 else "extends",
            ),
            RenderedInput(
                request_id=rid,
                turn=t,
                chain_id=0,
                input_ids=inp,
                prefix_len=inp.length - new_tokens,
            ),
            GenerateResult(
                request_id=rid,
                turn=t,
                attempt=0,
                rid=f"{t:032x}",
                output_ids=out_ref,
                logprobs=lp_ref,
                finish_reason="stop",
                weight_version="1",
            ),
            TitoVerdict(rules_version="bench", request_id=rid, turn=t, ok=rng.random() > 0.02),
            ResponseSent(
                request_id=rid,
                turn=t,
                content=[{"type": "text", "text": "ok"}],
                stop_reason="end_turn",
            ),
        ]
    return events


async def write_copy(store: Any, sid: str, i: int, body: list[Any], group_size: int) -> None:
    meta = {
        "instance_id": f"task-{i // group_size:05d}",
        "group_index": 0,
        "sample_index": i % group_size,
    }
    reward = float((i * 7919) % 5) / 4
    tail = [
        RewardAssigned(reward=reward),
        SessionClosed(status="completed" if i % 97 else "failed"),
    ]
    events = [SessionOpened(session_id=sid, metadata=meta), *body, *tail]
    for k in range(0, len(events), 1000):
        await store.append(sid, [NewEvent(event=e) for e in events[k : k + 1000]])


async def generate(path: Path, args: argparse.Namespace) -> None:
    store = await open_store(str(path), create=True)
    try:
        bodies = [
            await template(store, args.turns, args.new_tokens, args.out_tokens, seed)
            for seed in range(args.templates)
        ]
        for i in range(args.sessions):
            await write_copy(store, f"s{i:06d}", i, bodies[i % len(bodies)], 8)
            if (i + 1) % 1000 == 0:
                print(f"  generated {i + 1}/{args.sessions} sessions", file=sys.stderr, flush=True)
        per_turn = args.big_tokens // args.turns
        big = await template(store, args.turns, per_turn - args.out_tokens, args.out_tokens, 10**6)
        await write_copy(store, BIG, args.sessions, big, 8)
    finally:
        await store.close()


def cached_log(args: argparse.Namespace) -> Path:
    from recorder.log.store.migrations import head_revision

    key = json.dumps(
        [
            GENERATOR_VERSION,
            head_revision(),
            args.sessions,
            args.turns,
            args.new_tokens,
            args.out_tokens,
            args.big_tokens,
            args.templates,
        ]
    )
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    folder = Path(args.cache_dir) / f"log-{args.sessions}x{args.turns}-{tag}"
    db = folder / "runs.db"
    if (folder / "complete").exists():
        return db
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    print(f"generating {args.sessions} sessions x {args.turns} turns into {db}", file=sys.stderr)
    t0 = time.perf_counter()
    asyncio.run(generate(db, args))
    print(f"  done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    (folder / "complete").write_text(key)
    return db


# ---------------------------------------------------------------- measurement


class Viewer:
    """`replay view --db DB --port 0` as a subprocess."""

    def __init__(self, db: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "replay.cli", "view", "--db", str(db), "--port", "0"],
            cwd=ROOT,
            env={**repo_env(), "COLUMNS": "200"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"http://\S+/", line)
        if found is None:
            self.proc.kill()
            raise SystemExit(f"replay view did not start: {line}")
        self.url = found.group(0).rstrip("/")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def first_paint(page: Any, url: str) -> float:
    """Seconds from navigation start to the browser's first contentful paint."""
    page.goto(url, wait_until="load")
    for _ in range(500):  # the paint entry may land just after `load`
        entries = page.evaluate(
            "performance.getEntriesByName('first-contentful-paint').map(e => e.startTime)"
        )
        if entries:
            return float(entries[0]) / 1000
        page.wait_for_timeout(20)
    raise SystemExit(f"no first-contentful-paint entry for {url}")


def sample_interactive(page: Any, url: str) -> float:
    """Seconds from navigation to the first chunk of tokens shown with the main
    thread answering (a round trip through it after the chunk is in the DOM)."""
    t0 = time.perf_counter()
    page.goto(url, wait_until="commit")
    page.wait_for_selector("#sample-tokens .tok", state="attached")
    page.evaluate("document.querySelectorAll('#sample-tokens .tok').length")
    return time.perf_counter() - t0


def replay_show(db: Path, sid: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "replay.cli", "show", "--db", str(db), "--session", sid],
        cwd=ROOT,
        env={**repo_env(), "COLUMNS": "200"},
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - t0


def fetch_seconds(url: str) -> float:
    import urllib.request

    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=3600) as resp:
        resp.read()
    return time.perf_counter() - t0


def fetch_json(url: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=3600) as resp:
        return json.loads(resp.read())


def measure(db: Path, args: argparse.Namespace) -> None:
    from playwright.sync_api import sync_playwright

    viewer = Viewer(db)
    try:
        started = time.perf_counter()
        early = fetch_seconds(viewer.url + "/")  # answers while the index is built
        early_progress = fetch_json(viewer.url + "/api/position")
        while fetch_json(viewer.url + "/api/position")["indexing"]:
            time.sleep(0.05)
        build = time.perf_counter() - started
        session = "s000000"
        big_sample = f"{viewer.url}/session/{BIG}/sample/0"
        timings: dict[str, list[float]] = {"runs": [], "session": [], "sample": []}
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium)
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            page.set_default_timeout(600_000)
            for _ in range(args.repeat):
                timings["runs"].append(first_paint(page, viewer.url + "/"))
                timings["sample"].append(sample_interactive(page, big_sample))
                timings["session"].append(first_paint(page, f"{viewer.url}/session/{session}"))
            tokens = page.locator("#n-tokens")
            page.goto(big_sample)
            n_tokens = int(tokens.inner_text())
            browser.close()
        show_session = [replay_show(db, session) for _ in range(args.repeat)]
        show_big = [replay_show(db, BIG) for _ in range(args.repeat)]
    finally:
        viewer.stop()

    def cell(values: list[float]) -> tuple[str, str]:
        warm = values[1:] or values
        return f"{values[0] * 1000:.0f}", f"{median(warm) * 1000:.0f}"

    rows = [
        ("runs page, first paint", *cell(timings["runs"]), "—", "< 1000"),
        (
            f"session page ({args.turns} turns), first paint",
            *cell(timings["session"]),
            f"{median(show_session) * 1000:.0f}",
            "< 1000",
        ),
        (
            f"sample page ({n_tokens:,} tokens), interactive",
            *cell(timings["sample"]),
            f"{median(show_big) * 1000:.0f}",
            "< 2000",
        ),
    ]
    out = console()
    out.print(
        rich_table(
            f"replay view on {args.sessions:,} sessions x {args.turns} turns "
            f"(median of {args.repeat}; ms)",
            ["page", "cold", "warm median", "replay show (same session)", "target"],
            rows,
            left=1,
        )
    )
    out.print(
        f"runs page right after start: answered in {early:.2f} s with "
        f"{early_progress['position']:,} of {early_progress['head']:,} events indexed; "
        f"the runs index was complete {build:.1f} s after start"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sessions", type=int, default=10_000)
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=150, help="inserted tokens per turn")
    p.add_argument("--out-tokens", type=int, default=100, help="model tokens per turn")
    p.add_argument("--big-tokens", type=int, default=120_000, help="the long session's tokens")
    p.add_argument("--templates", type=int, default=16, help="distinct token streams")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--chromium", default=CHROMIUM)
    p.add_argument("--cache-dir", default="/tmp/tr-bench-view")
    p.add_argument("--generate-only", action="store_true")
    args = p.parse_args()
    db = cached_log(args)
    if not args.generate_only:
        measure(db, args)


if __name__ == "__main__":
    main()
