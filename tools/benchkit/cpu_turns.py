"""CPU per turn of whole recorder processes, from `/proc`, turn by turn against peers.

Every recorder under test is `recorder serve` in its own child process on
its own SQLite file, in front of one scripted engine (a child process too):

  ours       this checkout
  before     another checkout (`--before-src DIR`, e.g. a `git worktree` of
             main): the before/after figures of one change, in one run
  re-render  this checkout with the full re-render planner (`benchkit.peer`):
             what a middleware that re-tokenizes every turn pays
  slime      slime's agent middleware, its real `AnthropicAdapter` run from a
             checkout (`--slime-src DIR`, `benchkit.slime_peer`): renders the
             whole history with the HF chat template every turn; no store.
             Its sessions open on their first request (a fresh sid each).
             After the run, slime's rendering of ours' last request is
             compared with the ids our chain sent for it (`PromptCheck`).

Each gets the same Claude-Code-shaped conversation (same seed), grown fast
to just below each checkpoint, then `turns` rounds: in each round every
process takes one turn, in an order that rotates, and a process's CPU for
the round (its turn, plus whatever it did in the background until the
round ended) is the difference of `benchkit.cpu.cpu_ns` (all its threads)
before and after. Medians and means over the rounds; the load average is
read before and after, since the machine is shared.
"""

from __future__ import annotations

import asyncio
import copy
import statistics
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp

from recorder.log import events as ev
from recorder.log.store import open_store
from tools.benchkit import wire
from tools.benchkit.conversation import Conversation, words_per_token
from tools.benchkit.cpu import cpu_ns, cpu_ticks_s, machine_state
from tools.benchkit.engine import EngineProcess, fixture_tokenizer
from tools.benchkit.floor import FloorProcess
from tools.benchkit.recorder import RecorderProcess
from tools.benchkit.slime_peer import (
    SlimeProcess,
    TokenDifference,
    check_slime_src,
    token_difference,
)
from tools.benchkit.table import rich_table

STEP_WORDS = 110  # ~150 tokens of tool result; with the ~50-token answer ~200 per turn
STEP_TOKENS = 200
GROW_WORDS = 6000


class Served(Protocol):
    """A middleware under test in its own process: where it listens, its process
    (whose /proc counters are read), and how a session opens on it."""

    url: str
    proc: subprocess.Popen[bytes]

    async def wait_healthy(self, http: aiohttp.ClientSession) -> None: ...

    async def open_session(self, http: aiohttp.ClientSession) -> str: ...

    async def stop(self) -> None: ...


@dataclass
class Contender:
    name: str
    proc: Served
    conversation: Conversation = field(default_factory=Conversation)
    session_id: str = ""
    context: int = 0


@dataclass
class CpuRow:
    target: int
    context: dict[str, float]
    cpu_ms: dict[str, list[float]]
    wall_ms: dict[str, list[float]]
    ticks_ms: dict[str, float]


@dataclass(frozen=True)
class PromptCheck:
    """slime's rendering of ours' last request against the ids our chain sent for it."""

    difference: TokenDifference
    ours_text: str  # the differing middle of each, decoded ("" when identical)
    slime_text: str


@dataclass
class CpuRun:
    rows: list[CpuRow]
    load_before: str
    load_after: str
    slime_prompt: PromptCheck | None = None


async def run_cpu(
    contexts: list[int],
    turns: int,
    engine_latency_s: float,
    before_src: Path | None = None,
    peer: bool = True,
    slime_src: Path | None = None,
    floor: bool = True,
    answer_words: int = 0,
) -> CpuRun:
    """Every contender through every checkpoint, the load average before and after.

    `answer_words`: the engine's answers carry that many words of text before
    their call (~50 tokens without)."""
    if slime_src is not None:
        slime_src = check_slime_src(slime_src)  # before any process starts
    load_before = machine_state()
    per_turn = STEP_TOKENS + int(answer_words / words_per_token(fixture_tokenizer()))
    top = int(max(contexts) * 1.3) + 40_000 + turns * per_turn
    engine = EngineProcess(top, engine_latency_s, answer_words)
    await engine.start()
    with tempfile.TemporaryDirectory() as tmp:
        specs: list[tuple[str, dict[str, object]]] = [("ours", {})]
        if before_src is not None:
            specs.append(("before", {"root": before_src}))
        if peer:
            specs.append(("re-render", {"peer": True}))
        contenders = [
            Contender(name, RecorderProcess(engine.url, f"{tmp}/{name}.db", log=True, **kw))  # type: ignore[arg-type]
            for name, kw in specs
        ]
        if slime_src is not None:
            contenders.append(Contender("slime", SlimeProcess(slime_src, engine.url, log=True)))
        if floor:
            contenders.append(Contender("floor", FloorProcess(engine.url, f"{tmp}/floor.db")))
        check = None
        try:
            timeout = aiohttp.ClientTimeout(total=1200)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                for c in contenders:
                    await c.proc.wait_healthy(http)
                    c.session_id = await c.proc.open_session(http)
                    await _turn(http, c, None)
                rows = [
                    await _checkpoint(http, contenders, t, turns, per_turn)
                    for t in sorted(contexts)
                ]
                slime = contenders[-1].proc
                if isinstance(slime, SlimeProcess):
                    check = await _check_prompt(http, contenders[0], slime, f"{tmp}/ours.db")
        finally:
            for c in contenders:
                await c.proc.stop()
            await engine.stop()
    return CpuRun(rows, load_before, machine_state(), check)


async def _check_prompt(
    http: aiohttp.ClientSession, ours: Contender, slime: SlimeProcess, db: str
) -> PromptCheck:
    """Render ours' last request with slime; compare with the ids ours sent the engine."""
    last = copy.copy(ours.conversation)
    last.messages = ours.conversation.messages[:-1]  # the request, before its answer joined
    theirs = await slime.prompt_ids(http, last.body())
    store = await open_store(db)
    try:
        records = await store.read_session(ours.session_id)
        rendered = [r.event for r in records if isinstance(r.event, ev.RenderedInput)]
        ids = (await store.get_array(rendered[-1].input_ids)).tolist()
    finally:
        await store.close()
    diff = token_difference(ids, theirs)
    tok = fixture_tokenizer()
    mine, slimes = diff.middles(ids, theirs)
    return PromptCheck(diff, tok.decode(mine), tok.decode(slimes))


async def _turn(http: aiohttp.ClientSession, c: Contender, words: int | None) -> float:
    answered = await wire.take_turn(http, c.proc.url, c.session_id, c.conversation, words)
    c.context = answered.usage["input_tokens"] + answered.usage.get("cache_read_input_tokens", 0)
    return answered.ended - answered.started


async def _checkpoint(
    http: aiohttp.ClientSession,
    contenders: list[Contender],
    target: int,
    turns: int,
    per_turn: int = 200,
) -> CpuRow:
    """`turns` rounds centred on `target` tokens of context, ~`per_turn` added a round."""
    start_at = target - turns * per_turn // 2
    while contenders[0].context < start_at:
        words = max(STEP_WORDS, min(GROW_WORDS, int((start_at - contenders[0].context) * 0.7)))
        for c in contenders:
            await _turn(http, c, words)
    for c in contenders:  # settle: caches warm, growth's background writes done
        await _turn(http, c, STEP_WORDS)
    cpu: dict[str, list[float]] = {c.name: [] for c in contenders}
    wall: dict[str, list[float]] = {c.name: [] for c in contenders}
    contexts: dict[str, list[int]] = {c.name: [] for c in contenders}
    ticks = {c.name: cpu_ticks_s(c.proc.proc.pid) for c in contenders}
    for i in range(turns):
        order = contenders[i % len(contenders) :] + contenders[: i % len(contenders)]
        before = {c.name: cpu_ns(c.proc.proc.pid) for c in contenders}
        for c in order:
            wall[c.name].append(await _turn(http, c, STEP_WORDS) * 1000)
            contexts[c.name].append(c.context)
        await asyncio.sleep(0.002)  # let the last one's background writes land in this round
        for c in contenders:
            cpu[c.name].append((cpu_ns(c.proc.proc.pid) - before[c.name]) / 1e6)
    ticks_ms = {
        c.name: (cpu_ticks_s(c.proc.proc.pid) - ticks[c.name]) * 1000 / turns for c in contenders
    }
    return CpuRow(
        target, {k: statistics.fmean(v) for k, v in contexts.items()}, cpu, wall, ticks_ms
    )


def cpu_table(
    rows: list[CpuRow], engine_latency_ms: float, loads: tuple[str, str], answer_words: int = 0
) -> object:
    names = list(rows[0].cpu_ms)
    answers = (
        f"answers of {answer_words} words of text and a tool call"
        if answer_words
        else "~50-token answers (a sentence and a tool call)"
    )
    title = (
        "CPU per turn of each recorder process (all threads, /proc/PID/task/*/schedstat), "
        f"median (mean) over turns; wall p50 includes the scripted engine's {engine_latency_ms:g} "
        f"ms per call; {answers}\nbefore the run: {loads[0]}; after: {loads[1]}"
    )
    if "slime" in names:
        title += (
            "\nslime = slime's agent middleware (its AnthropicAdapter, real code from --slime-src) "
            "in its own process: same engine, conversation and rotation"
        )
    if "floor" in names:
        title += (
            "\nfloor = the I/O any aiohttp middleware must do per turn (read and decode the body, "
            "/generate with pre-made id JSON, one durable SQLite row, one SSE write: "
            "tools/benchkit/floor.py)"
        )
    cols = ["context tok", "turns"]
    for n in names:
        cols += [f"{n} CPU ms", f"{n} wall p50"]
    cols += [f"{n}/ours CPU" for n in names[1:]]
    cols += ["ours CPU (stat ticks)"]
    cells = []
    for r in rows:
        med = {n: statistics.median(r.cpu_ms[n]) for n in names}
        cell = [f"{r.context['ours']:,.0f}", str(len(r.cpu_ms["ours"]))]
        for n in names:
            cell += [
                f"{med[n]:.2f} ({statistics.fmean(r.cpu_ms[n]):.2f})",
                f"{statistics.median(r.wall_ms[n]):.1f}",
            ]
        cell += [f"{med[n] / med['ours']:.1f}x" for n in names[1:]]
        cell += [f"{r.ticks_ms['ours']:.2f}"]
        cells.append(tuple(cell))
    return rich_table(title, tuple(cols), cells)


def prompt_note(check: PromptCheck) -> str:
    """One paragraph under the table: does slime send the engine what our chain sends?"""
    d = check.difference
    head = f"slime's rendering of ours' last request: {d.theirs:,} tokens, ours sent {d.ours:,}"
    if d.identical:
        return head + ": identical ids."
    return (
        f"{head}; the same but for tokens {d.head:,}..{d.ours - d.tail:,} of ours "
        f"({d.ours - d.tail - d.head} tokens: {check.ours_text!r}) against {d.head:,}.."
        f"{d.theirs - d.tail:,} of slime's ({d.theirs - d.tail - d.head} tokens: "
        f"{check.slime_text!r})."
    )
