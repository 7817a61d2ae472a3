"""Does one near-limit body stall the other sessions? (issue 15)

One session sends an 8 MB user text (context 1M tokens, so it passes the
length bound and is really tokenized) while another session takes small
turns and polls `/health`. Printed: median and p90 latency of the other
session's turns and of `/health` (>= 30 each), idle and while the big body is
in flight, with long texts encoded GIL-free (this code) and, as the peer
measured in the same run, with the GIL held (the plain `encode` call every
text took before). Then the time to refuse a 63 MB text from its length, and
the RSS each big body added.

Then, per field kind (issue 24: the bulk of a body in assistant text,
thinking, tool input, tool descriptions or schemas, system blocks, tool
results, OpenAI Chat history and tool arguments, Responses input): a body of
`--mb` megabytes that cannot fit the context, each sent to a fresh
`recorder serve` (`benchkit/bulk.py`), with this code and, as the peer in the
same run, the code at `--before` (a git revision, extracted to a temporary
directory): the server's peak RSS gain (the kernel's VmHWM) and the median
time to its answer; then three such bodies at once on one server.

    python tools/bench_big_body.py [--reps 40] [--mb 16] [--before 043d474] [--only-fields]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import recorder.model.tokenizer as tokenizer_module  # noqa: E402
from recorder.model.tokenizer import load_tokenizer  # noqa: E402
from tests.server.conftest import FIXTURE_TOKENIZER, Harness, make_harness  # noqa: E402
from tests.server.test_large_bodies import big_body, peak_rss  # noqa: E402
from tools.benchkit.bodies import KINDS  # noqa: E402
from tools.benchkit.bulk import Measured, measure  # noqa: E402
from tools.benchkit.engine import start_test_engine  # noqa: E402
from tools.benchkit.memory import MB  # noqa: E402
from tools.benchkit.stats import rank_ms  # noqa: E402
from tools.benchkit.table import Columns  # noqa: E402

SMALL = json.dumps(
    {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
).encode()


async def timed_post(h: Harness, sid: str, raw: bytes) -> float:
    assert h.http is not None
    headers = {"Authorization": f"Bearer {sid}", "Content-Type": "application/json"}
    start = time.perf_counter()
    async with h.http.post(h.url + "/v1/messages", data=raw, headers=headers) as resp:
        await resp.read()
    return time.perf_counter() - start


async def timed_health(h: Harness) -> float:
    assert h.http is not None
    start = time.perf_counter()
    async with h.http.get(h.url + "/health") as resp:
        await resp.read()
    return time.perf_counter() - start


async def small_turns(h: Harness, sid: str, reps: int, busy: asyncio.Event | None) -> tuple:
    """(turn latencies, /health latencies), counting only while `busy` is set (if given)."""
    turns: list[float] = []
    healths: list[float] = []
    while len(turns) < reps or len(healths) < reps:
        t, g = await timed_post(h, sid, SMALL), await timed_health(h)
        if busy is None or busy.is_set():
            turns.append(t)
            healths.append(g)
    return turns, healths


async def big_sender(
    h: Harness, sid: str, raw: bytes, busy: asyncio.Event, stop: asyncio.Event
) -> list[int]:
    """Send `raw` again and again until `stop`; the RSS each one added."""
    gains: list[int] = []
    while not stop.is_set():
        with peak_rss() as gained:
            busy.set()
            await timed_post(h, sid, raw)
            busy.clear()
        gains.append(gained[0])
    return gains


async def under_load(h: Harness, reps: int) -> tuple[list[float], list[float], list[int]]:
    big, other = await h.open_session(), await h.open_session()
    busy, stop = asyncio.Event(), asyncio.Event()
    sender = asyncio.create_task(big_sender(h, big, big_body(8_000_000), busy, stop))
    turns, healths = await small_turns(h, other, reps, busy)
    stop.set()
    return turns, healths, await sender


TABLE = Columns(
    [
        ("other session, 8 MB body tokenized meanwhile", 44, "<"), ("n", 4, ">"),
        ("median ms", 9, ">"), ("p90 ms", 9, ">"),
    ],
    sep=" | ",
    edges=("| ", " |"),
)  # fmt: skip


def row(name: str, values: list[float]) -> str:
    median, p90 = statistics.median(values) * 1000, rank_ms(values, 0.9)
    return TABLE.row(name, len(values), f"{median:.1f}", f"{p90:.1f}")


async def bench(reps: int) -> None:
    tok = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template="chatml-tools")
    with tempfile.TemporaryDirectory() as tmp:
        h = await make_harness(
            tok,
            f"sqlite+aiosqlite:///{tmp}/bench.db",
            context_length=1_000_000,
            engine_kwargs={"context_length": 1_000_000},
        )
        try:
            other = await h.open_session()
            idle_turns, idle_health = await small_turns(h, other, reps, None)
            gil_free = await under_load(h, reps)
            saved = tokenizer_module._GIL_FREE_CHARS
            tokenizer_module._GIL_FREE_CHARS = sys.maxsize  # the peer: plain encode, GIL held
            try:
                gil_held = await under_load(h, reps)
            finally:
                tokenizer_module._GIL_FREE_CHARS = saved
        finally:
            await h.close()
        h = await make_harness(tok, f"sqlite+aiosqlite:///{tmp}/bench2.db")
        try:
            sid = await h.open_session()
            raw = big_body(63 * 2**20)
            refusals = []
            for _ in range(3):
                with peak_rss() as refused_rss:
                    refusals.append(await timed_post(h, sid, raw))
        finally:
            await h.close()

    print(TABLE.header())
    print(TABLE.rule())
    print(row("turn, idle (baseline)", idle_turns))
    print(row("turn, big body in flight, GIL-free encode", gil_free[0]))
    print(row("turn, big body in flight, GIL held (peer)", gil_held[0]))
    print(row("/health, idle (baseline)", idle_health))
    print(row("/health, big body in flight, GIL-free encode", gil_free[1]))
    print(row("/health, big body in flight, GIL held (peer)", gil_held[1]))
    print(
        f"\n8 MB body: {len(gil_free[2])} sent GIL-free, peak RSS gain median "
        f"{statistics.median(gil_free[2]) / MB:.0f} MB; {len(gil_held[2])} sent GIL held, "
        f"{statistics.median(gil_held[2]) / MB:.0f} MB"
    )
    print(
        f"63 MB body refused from its length (context 8192): median "
        f"{statistics.median(refusals) * 1000:.0f} ms over {len(refusals)} (upload included), "
        f"peak RSS gain {refused_rss[0] / MB:.0f} MB"
    )


# The commit before issue 24's item 4: the early check counted user, tool and system text.
BEFORE = "043d474"
FIELDS_CONTEXT = 8192
FIELDS = Columns(
    [
        ("bulk of the body in", 34, "<"), ("MB", 5, ">"), ("status", 6, ">"),
        ("before s", 9, ">"), ("after s", 8, ">"), ("before peak MB", 14, ">"),
        ("after peak MB", 13, ">"), ("before x body", 13, ">"), ("after x body", 12, ">"),
    ],
    sep=" | ",
    edges=("| ", " |"),
)  # fmt: skip
CONCURRENT = ("assistant text", "tool_use input", "chat assistant")


def checkout(revision: str, into: Path) -> Path:
    """The repository's tree at `revision` (a git revision, extracted into `into`, not a
    worktree; or a directory holding such a tree already)."""
    if Path(revision).is_dir():
        return Path(revision)
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", revision], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def field_row(before: Measured, after: Measured) -> str:
    return FIELDS.row(
        after.kind,
        f"{after.body_bytes / MB:.1f}",
        f"{before.status}/{after.status}",
        f"{before.seconds:.2f}",
        f"{after.seconds:.2f}",
        f"{before.peak_bytes / MB:.0f}",
        f"{after.peak_bytes / MB:.0f}",
        f"{before.peak_bytes / before.body_bytes:.1f}",
        f"{after.peak_bytes / after.body_bytes:.1f}",
    )


async def bench_fields(mb: float, reps: int, revision: str) -> None:
    proc, engine_url = start_test_engine(FIELDS_CONTEXT)
    n = int(mb * MB)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_before_") as tmp:
            before_src = checkout(revision, Path(tmp))
            rows = []
            for kind in KINDS:  # alternated, so load on the machine hits both alike
                [before] = await measure(
                    engine_url, FIELDS_CONTEXT, [(kind, n)], before_src, reps=reps
                )
                [after] = await measure(engine_url, FIELDS_CONTEXT, [(kind, n)], reps=reps)
                rows.append(field_row(before, after))
            together = [(kind, n) for kind in CONCURRENT]
            [before] = await measure(
                engine_url, FIELDS_CONTEXT, together, before_src, concurrent=True
            )
            [after] = await measure(engine_url, FIELDS_CONTEXT, together, concurrent=True)
            rows.append(field_row(before, after))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(
        f"\nA body that cannot fit (context {FIELDS_CONTEXT}), its bulk in one field, each on a "
        f"fresh server; before = {revision}, after = this tree; seconds: median of {reps} sends "
        "(upload included); peak: the server's RSS gain on the first send"
    )
    print(FIELDS.header())
    print(FIELDS.rule())
    for line in rows:
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--mb", type=float, default=16.0, help="size of each field-kind body")
    parser.add_argument("--field-reps", type=int, default=3, help="sends per field-kind body")
    parser.add_argument(
        "--before", default=BEFORE, help="git revision (or a source tree) measured as the peer"
    )
    parser.add_argument("--only-fields", action="store_true", help="skip the GIL table")
    args = parser.parse_args()
    if not args.only_fields:
        asyncio.run(bench(args.reps))
    asyncio.run(bench_fields(args.mb, args.field_reps, args.before))


if __name__ == "__main__":
    main()
