"""Per-turn middleware overhead of the live recorder, chain reuse vs full re-render.

Section 1, end to end (what the issue asks for): the real `RecorderServer`
over a real SQLite store, set up as `recorder serve` sets it up, in front of
the scripted test engine (zero token delay) in a child process, as a real
engine would be (`--engine-thread` runs it in a thread of this process
instead: it then shares the GIL and the garbage collector with the server;
the engine keeps nothing per request, `keep_history=False`). Each `/generate` call also waits
`--engine-latency-ms` (default 50 ms, less than any real GPU needs for a
long prompt): an idle engine time the server's background writes can
overlap, as they overlap a real engine's. Two sessions are fed the
same Claude-Code-shaped tool-use conversation, turn by turn, as streaming
Messages requests with the body and headers the Anthropic SDK sends (raw
aiohttp with pre-encoded bodies, so no client-side SDK work is timed):

  ours      the server as it is: the chain's exact tokens + only the new
            messages rendered and tokenized (`plan_turn`)
  baseline  the same server, with its turn planner replaced (inside this
            process only) by one that renders and tokenizes the WHOLE
            conversation every turn and returns the same plan (same chain,
            "extend", same prefix), so HTTP, parsing, store writes and the
            response stay identical: only the tokenization strategy differs
            (its ChainDecision events therefore also read "extend")

The conversation is built up quickly with large tool results to just below
each checkpoint (~1k, ~10k, ~100k tokens), then both sessions take N turns
(alternating) of ~200 new tokens each (a ~150-token tool result + the
model's ~50-token tool call), centred on the checkpoint. The bench fails
unless every measured turn's ChainDecision is an extension.

Per turn: middleware time = client wall time minus the engine's own time,
the span of the engine's `/generate` handler (simulated latency, reading and
JSON-parsing the input ids, prefix-cache walk, decoding); the spans are
fetched over HTTP, perf_counter being the system-wide monotonic clock.
Sending the ids over loopback counts as middleware time. The parse and plan
columns time the server's own `parse_request` (with the session's
ParseCache) and turn planner calls. The store columns are
the time a store call (`append` / `put_array`) was in flight during the turn
while the engine was not working: the store's share that the engine call did
not hide. Means and medians are shown: the store's commits make outliers.

`--dialect openai-chat` (or openai-responses) replaces the baseline by the
same conversation spoken over that OpenAI endpoint with the chain path: the
peer columns are then the OpenAI dialect, the ratio its overhead against
Messages, measured in the same run (the issue's "within 10%").

Section cpu (`--section cpu`, or `all`): whole `recorder serve` processes,
CPU per turn from /proc (all threads) against the re-render peer, and against
another checkout with `--before-src DIR` (tools/benchkit/cpu_turns.py), with
the load average; default checkpoints there 1k, 10k, 100k, 200k. With
`--slime-src DIR` (a THUDM/slime checkout) slime's agent middleware, its real
AnthropicAdapter in its own process (tools/benchkit/slime_peer.py), takes the
same turns too: columns "slime CPU ms", "slime wall p50", "slime/ours CPU", and
a line comparing its prompt ids with our chain's. CI runs it without. The
"floor" column (`--no-floor` leaves it out) is the I/O any aiohttp middleware
must do per turn and nothing else (tools/benchkit/floor.py): what our CPU per
turn cannot go below without leaving aiohttp and asyncio's transports.
`--answer-words N` makes every answer N words of text and then its call
(~1.3 tokens a word): a thinking model's turn, where what a middleware pays
per output token (logprobs, the TITO check, the parser) shows.

Section 2, pure (no HTTP, no store, no engine): parse + plan in-process, the
chain path against parse + full render + full encode, median of repeats
(tools/bench_middleware_pure.py).

    python -m tools.bench_middleware [--contexts 1000,10000,100000] [--turns 30]
        [--section both|e2e|pure] [--engine-thread] [--engine-latency-ms 50]
        [--db-dir DIR] [--per-turn] [--repeat 30] [--dialect anthropic|openai-chat]
    python -m tools.bench_middleware --section cpu [--cpu-contexts 1000,10000,100000,200000]
        [--before-src DIR] [--no-peer] [--no-floor] [--slime-src DIR] [--answer-words N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from rich.table import Table

from recorder.log import events as ev
from recorder.log.store import open_store
from recorder.log.store.base import EventStore
from recorder.model.tokenizer import load_tokenizer
from recorder.server import RecorderServer
from tools.bench_middleware_pure import measure, pure_table
from tools.benchkit import wire
from tools.benchkit.conversation import FIXED_TOKENS_PER_TURN, Conversation, words_per_token
from tools.benchkit.cpu_turns import CpuRow, PromptCheck, cpu_table, prompt_note, run_cpu
from tools.benchkit.engine import TOKENIZER, EngineProcess, EngineThread, fixture_tokenizer
from tools.benchkit.probes import Planner, time_store_calls
from tools.benchkit.procs import REPO
from tools.benchkit.recorder import start_server
from tools.benchkit.stats import (
    Span,
    engine_seconds,
    fmean_ms,
    inside,
    ints,
    median,
    overlap,
    union_length,
)
from tools.benchkit.table import console, rich_table

TEMPLATE = REPO / "recorder" / "model" / "templates" / "chatml-tools.jinja"


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


@dataclass
class TurnSample:
    mode: str
    request_id: str
    started: float
    ended: float
    prompt_tokens: int
    new_tokens: int
    plan_s: float
    parse_s: float
    engine_s: float = 0.0
    store_s: float = 0.0

    @property
    def middleware_s(self) -> float:
        return self.ended - self.started - self.engine_s


@dataclass
class Checkpoint:
    target: int
    samples: list[TurnSample] = field(default_factory=list)

    def of(self, mode: str) -> list[TurnSample]:
        return [s for s in self.samples if s.mode == mode]


@dataclass
class Stack:
    server: RecorderServer
    engine: EngineThread | EngineProcess
    store: EventStore
    http: aiohttp.ClientSession
    planner: Planner
    store_spans: list[Span]


class LiveSession:
    """One recorder session and its conversation, driven over HTTP."""

    def __init__(self, stack: Stack, session_id: str, dialect: str = "anthropic") -> None:
        self.stack = stack
        self.session_id = session_id
        self.dialect = dialect
        self.conversation = Conversation()
        self.prompt_tokens = 0
        self.output_tokens = 0

    async def turn(self, mode: str, tool_result_words: int | None) -> TurnSample:
        """Answer the last tool call (if any) and take one turn with `mode`'s planner."""
        stack = self.stack
        stack.planner.mode = mode
        answered = await wire.take_turn(
            stack.http,
            stack.server.url,
            self.session_id,
            self.conversation,
            tool_result_words,
            self.dialect,
        )
        call = stack.planner.calls[-1]
        new_tokens = call.new_tokens + self.output_tokens  # the previous output joins the context
        self.prompt_tokens = call.prompt_tokens
        self.output_tokens = answered.usage.get("output_tokens", 0)
        return TurnSample(
            mode,
            answered.request_id,
            answered.started,
            answered.ended,
            call.prompt_tokens,
            new_tokens,
            call.seconds,
            stack.planner.parse_s[-1],
        )


def attribute(sample: TurnSample, engine: list[Span], store: list[Span]) -> None:
    """Engine CPU time and the store's unhidden in-flight time inside one turn."""
    what = f"{sample.mode} turn {sample.request_id}"
    sample.engine_s = engine_seconds(engine, sample.started, sample.ended, what)
    stored = overlap(sample.started, sample.ended, store)
    in_flight = [Span(*iv) for iv in stored]
    hidden = [
        iv
        for s in inside(engine, sample.started, sample.ended)
        for iv in overlap(s.start, s.end, in_flight)
    ]
    sample.store_s = union_length(stored) - union_length(hidden)


async def start_stack(
    db: str,
    context_length: int,
    planner: Planner,
    engine_process: bool = False,
    engine_latency_s: float = 0.0,
) -> Stack:
    engine: EngineThread | EngineProcess
    if engine_process:
        engine = EngineProcess(context_length, engine_latency_s)
    else:
        engine = EngineThread(fixture_tokenizer(), context_length, engine_latency_s)
    await engine.start()
    store = await open_store(db, create=True)
    spans: list[Span] = []
    time_store_calls(store, spans)
    server = await start_server(store, engine.url, fixture_tokenizer(), context_length)
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
    return Stack(server, engine, store, http, planner, spans)


async def stop_stack(stack: Stack) -> None:
    await stack.http.close()
    await stack.server.stop(grace_s=5)
    await stack.store.close()
    await stack.engine.stop()


async def open_session(stack: Stack, dialect: str = "anthropic") -> LiveSession:
    token = stack.server.ctx.config.admin_token
    session_id = await wire.open_session(stack.http, stack.server.url, token, {"bench": True})
    return LiveSession(stack, session_id, dialect)


async def run_e2e(
    contexts: list[int],
    turns: int,
    new_tokens: int,
    warmup: int = 3,
    db_dir: str | None = None,
    engine_process: bool = False,
    engine_latency_s: float = 0.0,
    db_url: str | None = None,
    dialect: str = "anthropic",
) -> list[Checkpoint]:
    """Grow two sessions through each checkpoint; measure `turns` turns per mode there.

    The store is `db_url` if given (e.g. Postgres), else a new SQLite file.
    """
    planner = Planner()
    top = max(contexts) + (turns + 2) * new_tokens
    with tempfile.TemporaryDirectory(dir=db_dir) as tmp, planner.installed():
        db = db_url or str(Path(tmp) / "bench.db")
        stack = await start_stack(
            db, int(top * 1.2) + 8192, planner, engine_process, engine_latency_s
        )
        try:
            return await _drive(stack, contexts, turns, new_tokens, warmup, dialect)
        finally:
            await stop_stack(stack)


async def _drive(
    stack: Stack,
    contexts: list[int],
    turns: int,
    new_tokens: int,
    warmup: int,
    dialect: str = "anthropic",
) -> list[Checkpoint]:
    """`dialect` other than anthropic: the peer session speaks it (chain path), no baseline."""
    peer = "baseline" if dialect == "anthropic" else dialect
    tok = stack.server.ctx.tokenizer
    wpt = words_per_token(tok)
    step_words = max(1, round((new_tokens - FIXED_TOKENS_PER_TURN) * wpt))
    spare = await open_session(stack)  # warms caches, connections, the template
    await spare.turn("ours", None)
    for mode in ["ours", "baseline"] * max(1, warmup):
        grown = (await spare.turn(mode, step_words)).new_tokens
    if peer != "baseline":
        spare_peer = await open_session(stack, dialect)
        await spare_peer.turn(peer, None)
        for _ in range(max(1, warmup)):
            await spare_peer.turn(peer, step_words)
    # Calibrate the tool result so the context grows by `new_tokens` per turn.
    step_words = max(1, step_words + round((new_tokens - grown) * wpt))
    ours = await open_session(stack)
    base = await open_session(stack, "anthropic" if peer == "baseline" else dialect)
    for session in (ours, base):
        await session.turn("ours", None)
    checkpoints = []
    for target in sorted(contexts):
        # Grow fast (both sessions, chain path) until the measured turns centre on `target`.
        start_at = target - turns * new_tokens // 2
        while ours.prompt_tokens + ours.output_tokens + new_tokens < start_at:
            missing = start_at - ours.prompt_tokens - ours.output_tokens - FIXED_TOKENS_PER_TURN
            words = max(step_words, min(round(missing * wpt), 6000))
            for session in (ours, base):
                await session.turn("ours", words)
        point = Checkpoint(target)
        for i in range(turns):
            pair = [(ours, "ours"), (base, peer)]
            for session, mode in pair if i % 2 == 0 else pair[::-1]:
                point.samples.append(await session.turn(mode, step_words))
        checkpoints.append(point)
    await _check_chain_decisions(stack, ours.session_id, base.session_id, checkpoints, peer)
    engine_spans = await stack.engine.fetch_spans()
    for point in checkpoints:
        for sample in point.samples:
            attribute(sample, engine_spans, stack.store_spans)
    return checkpoints


async def _check_chain_decisions(
    stack: Stack, ours_id: str, base_id: str, checkpoints: list[Checkpoint], peer: str
) -> None:
    """Every measured turn genuinely extended its chain, and no turn failed."""
    for session_id in (ours_id, base_id):
        records = await stack.store.read_session(session_id)
        failed = [r.type for r in records if isinstance(r.event, ev.TurnFailed | ev.SessionFailed)]
        if failed:
            raise RuntimeError(f"session {session_id} recorded failures: {failed}")
        decisions = {
            r.event.request_id: r.event for r in records if isinstance(r.event, ev.ChainDecision)
        }
        rendered = {
            r.event.request_id: r.event for r in records if isinstance(r.event, ev.RenderedInput)
        }
        mode = "ours" if session_id == ours_id else peer
        for point in checkpoints:
            for sample in point.of(mode):
                decision = decisions[sample.request_id]
                if decision.action != "extend" or rendered[sample.request_id].prefix_len == 0:
                    raise RuntimeError(
                        f"{mode} turn {decision.turn} at ~{point.target} tokens was "
                        f"{decision.action}/{decision.reason}, not a chain extension"
                    )


@dataclass(frozen=True)
class E2eRow:
    target: int
    context: float
    new_tokens: float
    engine_ms: float
    ours_ms: float
    ours_plan_ms: float
    ours_parse_ms: float
    ours_store_ms: float
    base_ms: float
    base_plan_ms: float
    base_parse_ms: float
    base_store_ms: float
    turns: int
    ours_p50_ms: float
    base_p50_ms: float

    @property
    def ratio(self) -> float:
        return self.base_ms / self.ours_ms

    @property
    def ratio_p50(self) -> float:
        return self.base_p50_ms / self.ours_p50_ms


def summarize(point: Checkpoint, peer: str = "baseline") -> E2eRow:
    ours, base = point.of("ours"), point.of(peer)

    def ms(samples: list[TurnSample], key: Callable[[TurnSample], float]) -> float:
        return fmean_ms(key(s) for s in samples)

    return E2eRow(
        target=point.target,
        context=statistics.fmean(s.prompt_tokens for s in ours),
        new_tokens=statistics.fmean(s.new_tokens for s in ours),
        engine_ms=ms(point.samples, lambda s: s.engine_s),
        ours_ms=ms(ours, lambda s: s.middleware_s),
        ours_plan_ms=ms(ours, lambda s: s.plan_s),
        ours_parse_ms=ms(ours, lambda s: s.parse_s),
        ours_store_ms=ms(ours, lambda s: s.store_s),
        base_ms=ms(base, lambda s: s.middleware_s),
        base_plan_ms=ms(base, lambda s: s.plan_s),
        base_parse_ms=ms(base, lambda s: s.parse_s),
        base_store_ms=ms(base, lambda s: s.store_s),
        turns=len(ours),
        ours_p50_ms=median([s.middleware_s for s in ours]) * 1000,
        base_p50_ms=median([s.middleware_s for s in base]) * 1000,
    )


def e2e_table(
    rows: list[E2eRow],
    engine_latency_ms: float = 0.0,
    backend: str = "SQLite",
    peer: str = "baseline",
) -> Table:
    vs = (
        "base = full re-render + re-tokenize every turn"
        if peer == "baseline"
        else f"base = the same conversation over {peer} (chain reuse); ratio = {peer} / Messages"
    )
    title = (
        "end to end: middleware ms per turn = client wall - engine time; mean and p50 over turns\n"
        f"real server + {backend} store + scripted engine ({engine_latency_ms:g} ms simulated GPU "
        f"time per call); ours = Messages, chain reuse; {vs}"
    )
    cols = (
        "context tok", "new/turn", "turns", "engine ms", "ours ms", "ours p50",
        "ours parse", "ours plan", "ours store", "base ms", "base p50", "base parse",
        "base plan", "base store",
        "ratio", "ratio p50",
    )  # fmt: skip
    ms = (
        "engine_ms", "ours_ms", "ours_p50_ms", "ours_parse_ms", "ours_plan_ms", "ours_store_ms",
        "base_ms", "base_p50_ms", "base_parse_ms", "base_plan_ms", "base_store_ms",
    )  # fmt: skip
    cells = [
        (
            f"{r.context:,.0f}",
            f"{r.new_tokens:.0f}",
            f"{r.turns}",
            *(f"{getattr(r, name):.1f}" for name in ms),
            f"{r.ratio:.1f}x",
            f"{r.ratio_p50:.1f}x",
        )
        for r in rows
    ]
    return rich_table(title, cols, cells)


def per_turn_table(points: list[Checkpoint]) -> Table:
    cols = (
        "mode",
        "prompt tok",
        "new tok",
        "wall",
        "engine",
        "middleware",
        "parse",
        "plan",
        "store",
    )
    cells = [
        (
            s.mode,
            f"{s.prompt_tokens:,}",
            f"{s.new_tokens}",
            *(
                f"{seconds * 1000:.1f}"
                for seconds in (
                    s.ended - s.started,
                    s.engine_s,
                    s.middleware_s,
                    s.parse_s,
                    s.plan_s,
                    s.store_s,
                )
            ),
        )
        for point in points
        for s in point.samples
    ]
    return rich_table("end to end, every measured turn (ms)", cols, cells)


# ==========================================================================
# Command line
# ==========================================================================


@dataclass
class Results:
    e2e: list[E2eRow] = field(default_factory=list)
    pure: list[dict[str, float]] = field(default_factory=list)
    cpu: list[CpuRow] = field(default_factory=list)
    slime_prompt: PromptCheck | None = None


def main(argv: list[str] | None = None) -> Results:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--section",
        choices=("both", "e2e", "pure", "cpu", "all"),
        default="both",
        help="both = e2e + pure; all = e2e + pure + cpu",
    )
    ap.add_argument(
        "--cpu-contexts", default="1000,10000,100000,200000", help="cpu: checkpoints, tokens"
    )
    ap.add_argument(
        "--before-src",
        type=Path,
        default=None,
        help="cpu: another checkout (e.g. a git worktree of main) measured in the same run",
    )
    ap.add_argument("--no-peer", action="store_true", help="cpu: leave out the re-render peer")
    ap.add_argument(
        "--no-floor",
        action="store_true",
        help="cpu: leave out the I/O floor (tools/benchkit/floor.py)",
    )
    ap.add_argument(
        "--slime-src",
        type=Path,
        default=None,
        help="cpu: a THUDM/slime checkout; adds slime's agent middleware (its real code)",
    )
    ap.add_argument(
        "--answer-words",
        type=int,
        default=0,
        help="cpu: words of text before each answer's tool call (a thinking model's long "
        "turn; 0: the usual ~50-token answer)",
    )
    ap.add_argument("--contexts", default="1000,10000,100000", help="checkpoints, tokens")
    ap.add_argument("--turns", type=int, default=30, help="e2e: measured turns per mode")
    ap.add_argument("--new-tokens", type=int, default=200, help="e2e: context growth per turn")
    ap.add_argument("--warmup", type=int, default=3, help="e2e: warm-up turns per mode")
    ap.add_argument(
        "--db-dir", default=None, help="e2e: where the SQLite file goes (default: system temp)"
    )
    ap.add_argument(
        "--db", default=None, help="e2e: a store URL to use instead (e.g. postgresql://...)"
    )
    ap.add_argument(
        "--engine-thread",
        action="store_true",
        help="e2e: run the scripted engine in a thread of this process, not a child process",
    )
    ap.add_argument(
        "--engine-latency-ms",
        type=float,
        default=50.0,
        help="e2e: simulated GPU time per /generate call (counts as engine time)",
    )
    ap.add_argument("--per-turn", action="store_true", help="e2e: also list every measured turn")
    ap.add_argument(
        "--dialect",
        choices=("anthropic", "openai-chat"),
        default="anthropic",
        help="e2e: openai-chat compares Chat Completions with Messages instead of the baseline",
    )
    ap.add_argument("--repeat", type=int, default=30, help="pure: timing repeats")
    ap.add_argument("--new-words", default="150,1500", help="pure: words of new tool output")
    args = ap.parse_args(argv)
    out = console()
    results = Results()
    contexts = ints(args.contexts)
    if args.section in ("both", "all", "e2e"):
        points = asyncio.run(
            run_e2e(
                contexts,
                args.turns,
                args.new_tokens,
                args.warmup,
                args.db_dir,
                not args.engine_thread,
                args.engine_latency_ms / 1000,
                args.db,
                args.dialect,
            )
        )
        peer = "baseline" if args.dialect == "anthropic" else args.dialect
        results.e2e = [summarize(p, peer) for p in points]
        backend = "Postgres" if args.db and args.db.startswith("postgres") else "SQLite"
        out.print(e2e_table(results.e2e, args.engine_latency_ms, backend, peer))
        if args.per_turn:
            out.print(per_turn_table(points))
    if args.section in ("all", "cpu"):
        run = asyncio.run(
            run_cpu(
                ints(args.cpu_contexts),
                args.turns,
                args.engine_latency_ms / 1000,
                args.before_src,
                not args.no_peer,
                args.slime_src,
                not args.no_floor,
                args.answer_words,
            )
        )
        results.cpu, results.slime_prompt = run.rows, run.slime_prompt
        loads = (run.load_before, run.load_after)
        out.print(cpu_table(run.rows, args.engine_latency_ms, loads, args.answer_words))
        if run.slime_prompt is not None:
            out.print(prompt_note(run.slime_prompt))
    if args.section in ("both", "all", "pure"):
        tok = load_tokenizer(str(TOKENIZER), chat_template=str(TEMPLATE))
        for context in contexts:
            for new_words in ints(args.new_words):
                results.pure.append(measure(tok, context, new_words, args.repeat))
        out.print(pure_table(results.pure))
    return results


if __name__ == "__main__":
    main()
