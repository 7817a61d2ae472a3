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

Section 2, pure (no HTTP, no store, no engine): parse + plan in-process, the
chain path against parse + full render + full encode, median of repeats.

    python -m tools.bench_middleware [--contexts 1000,10000,100000] [--turns 30]
        [--section both|e2e|pure] [--engine-thread] [--engine-latency-ms 50]
        [--db-dir DIR] [--per-turn] [--repeat 30] [--dialect anthropic|openai-chat]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
from aiohttp import web
from rich.console import Console
from rich.table import Table

import recorder.server.turn as turn_module
from recorder.dialects.anthropic import Anthropic
from recorder.dialects.chat import ChatRequest
from recorder.dialects.openai_chat import OpenAIChat
from recorder.dialects.openai_responses import OpenAIResponses
from recorder.dialects.parse_cache import ParseCache
from recorder.dialects.translate import parse_request, response_message_digest
from recorder.log import events as ev
from recorder.log.store import open_store
from recorder.log.store.base import EventStore
from recorder.model.engine import EngineClient
from recorder.model.parsers import make_parser
from recorder.model.tokenizer import Tokenizer, load_tokenizer
from recorder.model.tokens import SessionChains, TurnPlan, commit_turn, full_input_ids, plan_turn
from recorder.server import RecorderServer, ServerConfig, make_context
from recorder.server.app import freeze_startup_heap
from replay.rules import load_rules
from tools.test_engine.core import EngineCore, build_app
from tools.test_engine.launch import free_port
from tools.test_engine.scripted import Reply, ScriptedBackend

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "tests" / "data" / "smollm2-tokenizer"
TEMPLATE = REPO / "recorder" / "model" / "templates" / "chatml-tools.jinja"


# ==========================================================================
# Synthetic content, and the pure section (parse + plan in-process)
# ==========================================================================

_VOCAB = (
    "def return self import class value result error file path test module function "
    "config None True False for in if else while try except raise assert len range "
    "print list dict str int data index token chain session event store async await"
)
_WORDS = _VOCAB.split()


def _text(rng: random.Random, n_words: int) -> str:
    lines, line = [], []
    for _ in range(n_words):
        line.append(rng.choice(_WORDS))
        if len(line) >= 12:
            lines.append("    " + " ".join(line))
            line = []
    lines.append(" ".join(line))
    return "\n".join(lines)


def _tools(n: int) -> list[dict[str, Any]]:
    return [
        {
            "name": f"Tool{i}",
            "description": f"Tool number {i}. " + "It does useful things with files. " * 6,
            "input_schema": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Absolute path."},
                    "mode": {"type": "string", "enum": ["read", "write", "append"]},
                    "limit": {"type": "integer", "minimum": 1},
                },
                "required": ["path"],
            },
            "cache_control": {"type": "ephemeral"},
        }
        for i in range(n)
    ]


class Session:
    """A synthetic Claude Code session that grows by tool-use turns."""

    def __init__(self, context: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        # Claude Code's own preamble is ~15k tokens; scale it down for small contexts.
        self.tools = _tools(min(16, max(1, context // 2000)))
        self.instructions = _text(random.Random(1), min(2000, context // 50))
        self.messages: list[dict[str, Any]] = [
            {"role": "user", "content": "Fix the failing tests. " + _text(self.rng, 40)}
        ]
        self.turn = 0

    def body(self) -> bytes:
        self.turn += 1
        system = [
            {
                "type": "text",
                "text": f"x-anthropic-billing-header: cc_version=2.1; cch={self.turn:08x};",
            },
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": "Instructions. " + self.instructions},
        ]
        return json.dumps(
            {
                "model": "bench",
                "max_tokens": 32000,
                "stream": True,
                "system": system,
                "tools": self.tools,
                "messages": self.messages,
                "thinking": {"type": "adaptive"},
                "context_management": {"edits": []},
            }
        ).encode()

    def answer(self) -> list[dict[str, Any]]:
        k = len(self.messages)
        return [
            {"type": "text", "text": "Next I will look at another file."},
            {
                "type": "tool_use",
                "id": f"toolu_{k:06d}",
                "name": "Tool1",
                "input": {"path": f"/repo/src/file_{k}.py", "mode": "read"},
            },
        ]

    def add_answer(self, content: list[dict[str, Any]]) -> None:
        self.messages.append({"role": "assistant", "content": content})

    def add_tool_result(self, n_words: int) -> None:
        call_id = self.messages[-1]["content"][-1]["id"]
        block = {"type": "tool_result", "tool_use_id": call_id, "content": _text(self.rng, n_words)}
        self.messages.append({"role": "user", "content": [block]})


def _output_ids(tok: Tokenizer, content: list[dict[str, Any]]) -> list[int]:
    """What a model emits for this answer (template rendering of it, up to EOS)."""
    call = content[1]
    message = {
        "role": "assistant",
        "content": content[0]["text"],
        "tool_calls": [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["input"]},
            }
        ],
    }
    head = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    start = tok.render(head, None, True)
    return tok.encode(tok.render([*head, message], None, False)[len(start) :].rstrip("\n"))


def _build(tok: Tokenizer, context: int) -> tuple[Session, SessionChains, ParseCache]:
    """Grow a session turn by turn through the chain layer until ~`context` tokens."""
    session, chains, cache = Session(context), SessionChains(), ParseCache()
    while True:
        req = parse_request(session.body(), cache=cache)
        plan = plan_turn(chains, req, tok)
        content = session.answer()
        out = _output_ids(tok, content)
        commit_turn(chains, plan, out, response_message_digest(content))
        session.add_answer(content)
        if len(plan.input_ids) + len(out) >= context * 0.97:
            return session, chains, cache
        session.add_tool_result(n_words=min(600, max(20, context // 40)))


def _median_ms(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median wall time of each function, interleaved so machine load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm caches the same way for every side
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def measure(tok: Tokenizer, context: int, new_words: int, repeat: int) -> dict[str, float]:
    session, chains, cache = _build(tok, context)
    session.add_tool_result(new_words)
    body = session.body()
    req = parse_request(body, cache=cache)
    assert req == parse_request(body), "cached and uncached parse disagree"
    plan = plan_turn(chains, req, tok)
    assert plan.action == "extend", plan
    assert plan.input_ids.tolist() == full_input_ids(req, tok), "chain and full render disagree"
    ms = _median_ms(
        {
            # First after the previous repeat's "base", as "parse" was before the cache:
            # whatever runs there pays for the memory the full render freed and re-faults.
            "parse_uncached": lambda: parse_request(body),
            "parse": lambda: parse_request(body, cache=cache),
            "plan": lambda: plan_turn(chains, req, tok),
            "chain": lambda: plan_turn(chains, parse_request(body, cache=cache), tok),
            "base": lambda: full_input_ids(parse_request(body), tok),
        },
        repeat,
    )
    return {"context": plan.prefix_len, "new": plan.new_tokens, "body_kb": len(body) / 1024, **ms}


def pure_table(rows: list[dict[str, float]]) -> Table:
    table = Table(
        title="pure: middleware time per turn, median ms, no HTTP, no store, no engine\n"
        "chain = parse + plan (plan_turn); baseline = parse + full render + full encode\n"
        "parse = with the session's ParseCache (warm; repeats find the new message cached too);"
        " uncached = without"
    )
    cols = (
        "context tok", "new tok", "body KB", "parse", "uncached", "plan", "chain", "baseline",
        "ratio",
    )  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['context']:,}",
            f"{r['new']:,}",
            f"{r['body_kb']:.0f}",
            f"{r['parse']:.2f}",
            f"{r['parse_uncached']:.2f}",
            f"{r['plan']:.2f}",
            f"{r['chain']:.2f}",
            f"{r['base']:.2f}",
            f"{r['base'] / r['chain']:.1f}x",
        )
    return table


# ==========================================================================
# The end-to-end section: the real server, store and (scripted) engine
# ==========================================================================

_CC_TOOLS = [
    ("Read", "Reads a file from the local filesystem.", {"file_path": "string", "offset": "integer", "limit": "integer"}),
    ("Bash", "Executes a bash command in a persistent shell session.", {"command": "string", "timeout": "integer"}),
    ("Edit", "Performs exact string replacements in files.", {"file_path": "string", "old_string": "string", "new_string": "string"}),
    ("Grep", "A search tool built on ripgrep.", {"pattern": "string", "path": "string", "glob": "string"}),
]  # fmt: skip


def _cc_tools() -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "description": description,
            "input_schema": {
                "type": "object",
                "properties": {k: {"type": t} for k, t in props.items()},
                "required": [next(iter(props))],
            },
            "cache_control": {"type": "ephemeral"},
        }
        for name, description, props in _CC_TOOLS
    ]


class Conversation:
    """One session's side of a Claude-Code-shaped tool-use conversation.

    Every session built with the same seed gets the same tool results; the
    assistant turns are what the server answered, echoed back verbatim. The
    body is laid out as Claude Code 2.1.197 sends it: messages first, then
    system prompt, tools and the rest, with the billing header and metadata
    the same all session. `instructions_words` / `n_tools` scale the constant
    preamble (Claude Code's own is ~70 kB: ~2,000 words and ~20 tools here).
    """

    def __init__(
        self, seed: int = 7, *, instructions_words: int = 80, n_tools: int | None = None
    ) -> None:
        self.rng = random.Random(seed)
        self.instructions = _text(random.Random(1), instructions_words)
        self.tools = _cc_tools() if n_tools is None else _cc_tools() + _tools(n_tools)
        self.messages: list[dict[str, Any]] = [
            {"role": "user", "content": "Fix the failing tests. " + _text(self.rng, 20)}
        ]
        self.tag = f"{random.Random(seed).getrandbits(32):08x}"
        self.turn = 0

    def body(self) -> bytes:
        self.turn += 1
        system = [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.0df; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": "Instructions. " + self.instructions, "cache_control": {"type": "ephemeral"}},
        ]  # fmt: skip
        return json.dumps(
            {
                "model": "bench",
                "messages": self.messages,
                "system": system,
                "tools": self.tools,
                "metadata": {"user_id": json.dumps({"device_id": "bench", "session_id": self.tag})},
                "max_tokens": 4096,
                "thinking": {"type": "adaptive"},
                "stream": True,
            }
        ).encode()

    def add_answer(self, content: list[dict[str, Any]]) -> None:
        self.messages.append({"role": "assistant", "content": content})

    def add_tool_result(self, n_words: int) -> None:
        calls = [b for b in self.messages[-1]["content"] if b.get("type") == "tool_use"]
        if not calls:
            raise RuntimeError(f"the model answered without a tool call: {self.messages[-1]}")
        text = _text(self.rng, n_words)
        block = {"type": "tool_result", "tool_use_id": calls[-1]["id"], "content": text}
        self.messages.append({"role": "user", "content": [block]})


def tool_call_reply(tok: Tokenizer, n: int, k: int = 0) -> str:
    """The model's ~50-token turn: a sentence and a Read call, written the way
    the chat template renders it (so a full re-render reproduces its tokens).

    `k` numbers the engine's answers: every output differs, as a sampling
    model's would, so no turn's output arrays are already stored."""
    message = {
        "role": "assistant",
        "content": "I will read the next file to find the failing test.",
        "tool_calls": [
            {
                "id": "call",
                "type": "function",
                "function": {
                    "name": "Read",
                    "arguments": {"file_path": f"/repo/src/pkg/module_{n:06d}_{k % 10_000:04d}.py", "offset": 1, "limit": 400},
                },
            }
        ],
    }  # fmt: skip
    head = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    start = tok.render(head, None, True)
    text = tok.render([*head, message], None, False)[len(start) :].rstrip("\n")
    return text.removesuffix(tok.decode([tok.eos_token_ids[0]]))


# --------------------------------------------------------------------------
# Measuring probes: engine handler time, store calls, planner calls
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    start: float  # time.perf_counter()
    end: float
    cpu_s: float = 0.0


def engine_app(
    tok: Tokenizer,
    context_length: int,
    spans: list[Span],
    latency_s: float = 0.0,
    *,
    max_spans: int | None = None,
) -> web.Application:
    """The scripted engine answering tool calls, timing each `/generate` into `spans`.

    `latency_s` simulates the GPU's time per call (an idle sleep): it counts as
    engine time, and the server's background writes may overlap it as they
    would a real engine's.

    `GET /bench/spans` returns them (for an engine in another process:
    perf_counter is the system-wide monotonic clock, comparable across processes).
    `max_spans`: keep only the newest (a long run reads them as it goes). The
    engine keeps nothing else per request (no request list, no prefix cache).
    """
    count = itertools.count()
    backend = ScriptedBackend(
        tok,
        default_reply=lambda req: Reply(text=tool_call_reply(tok, len(req.input_ids), next(count))),
    )
    app = build_app(EngineCore(backend, tok, context_length=context_length, keep_history=False))

    @web.middleware
    async def timed(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != "/generate":
            return await handler(request)  # type: ignore[no-any-return]
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            if latency_s:
                await asyncio.sleep(latency_s)
            return await handler(request)  # type: ignore[no-any-return]
        finally:
            cpu = time.thread_time() - c0
            spans.append(Span(t0, time.perf_counter(), cpu + latency_s))
            if max_spans is not None and len(spans) > max_spans:
                del spans[: len(spans) - max_spans]

    async def get_spans(request: web.Request) -> web.Response:
        return web.json_response([[s.start, s.end, s.cpu_s] for s in spans])

    app.middlewares.insert(0, timed)
    app.router.add_get("/bench/spans", get_spans)
    return app


async def _serve_app(app: web.Application, port: int) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{bound}"


class EngineThread:
    """The scripted engine on its own event loop and thread of this process."""

    def __init__(self, tok: Tokenizer, context_length: int, latency_s: float = 0.0) -> None:
        self.tok = tok
        self.context_length = context_length
        self.latency_s = latency_s
        self.spans: list[Span] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        self._thread.start()

        async def serve() -> tuple[web.AppRunner, str]:  # built inside the engine's loop
            app = engine_app(self.tok, self.context_length, self.spans, self.latency_s)
            return await _serve_app(app, 0)

        future = asyncio.run_coroutine_threadsafe(serve(), self._loop)
        self._runner, self.url = await asyncio.wrap_future(future)
        return self.url

    async def fetch_spans(self) -> list[Span]:
        return list(self.spans)

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop)
            )
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join, 30)


class EngineProcess:
    """The same engine in a child process (`--serve-engine`): no GIL shared with the server."""

    def __init__(self, context_length: int, latency_s: float = 0.0) -> None:
        self.context_length = context_length
        self.latency_s = latency_s
        self.url = ""
        self._proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> str:
        port = free_port()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        args = ["--serve-engine", str(port), "--engine-context", str(self.context_length)]
        args += ["--engine-latency-ms", str(self.latency_s * 1000)]
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tools.bench_middleware", *args], cwd=REPO, env=env
        )
        self.url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            for _ in range(600):
                if self._proc.poll() is not None:
                    raise RuntimeError(f"the engine process exited with {self._proc.returncode}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(self.url + "/health") as resp:
                        if resp.status == 200:
                            return self.url
                await asyncio.sleep(0.1)
        raise RuntimeError("the engine process did not become healthy in 60 s")

    async def fetch_spans(self) -> list[Span]:
        async with aiohttp.ClientSession() as http, http.get(self.url + "/bench/spans") as resp:
            return [Span(*row) for row in await resp.json()]

    async def stop(self) -> None:
        if self._proc is not None:
            proc, self._proc = self._proc, None
            proc.terminate()
            await asyncio.to_thread(proc.wait, 30)


def serve_engine(port: int, context_length: int, latency_s: float = 0.0) -> None:
    """`--serve-engine PORT`: run the timed scripted engine until terminated."""
    tok = load_tokenizer(str(TOKENIZER), "chatml-tools")

    async def run() -> None:
        app = engine_app(tok, context_length, [], latency_s, max_spans=100_000)
        runner, _ = await _serve_app(app, port)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(run())


def time_store_calls(store: EventStore, spans: list[Span]) -> None:
    """Record every `append` / `put_array` call's interval (instance-level wrappers)."""
    for name in ("append", "put_array"):
        call = getattr(store, name)

        def timed(*args: Any, _call: Any = call, **kwargs: Any) -> Any:
            async def run() -> Any:
                t0 = time.perf_counter()
                try:
                    return await _call(*args, **kwargs)
                finally:
                    spans.append(Span(t0, time.perf_counter()))

            return run()

        setattr(store, name, timed)


def full_render_plan(chains: SessionChains, req: ChatRequest, tok: Tokenizer) -> TurnPlan:
    """The baseline planner: render and tokenize the whole conversation every turn.

    It returns the plan the chain path would have made (same chain, "extend",
    same prefix length), so everything after planning is identical; the
    re-rendered tokens must start with the chain's tokens for that to hold.
    """
    input_ids = full_input_ids(req, tok)
    main = chains.main
    if main is None:
        return plan_turn(chains, req, tok)  # the first request renders everything anyway
    n = len(main.tokens)
    if len(input_ids) <= n or main.tokens.tolist() != input_ids[:n]:
        raise RuntimeError(
            "baseline: the full re-render does not extend the chain's tokens, so no equivalent "
            "plan exists; the bench conversation must render stably"
        )
    return TurnPlan(
        chain_id=main.chain_id,
        action="extend",
        reason="extends",
        parent_chain_id=None,
        # As the tokenizer returns it (a list): the engine client sends lists as
        # they are, so the baseline pays no conversion to the chains' int32 array.
        input_ids=input_ids,  # type: ignore[arg-type]
        prefix_len=n,
        new_messages=len(req.messages) - main.boundaries[-1].n_input_messages - 1,
        main_line=main.main_line,
        request_digests=req.message_digests,
        system_digest=req.system_digest,
        render_digest=req.render_digest,
        eos_token_ids=tuple(tok.eos_token_ids),
    )


@dataclass
class PlanCall:
    mode: str
    seconds: float
    prompt_tokens: int
    new_tokens: int


class Planner:
    """Stands in for the server's `plan_turn`; `mode` picks ours or the baseline."""

    def __init__(self) -> None:
        self.mode = "ours"
        self.calls: list[PlanCall] = []
        self.parse_s: list[float] = []  # the server's parse_request, timed the same way

    def __call__(self, chains: SessionChains, req: ChatRequest, tok: Tokenizer) -> TurnPlan:
        fn = full_render_plan if self.mode == "baseline" else plan_turn
        t0 = time.perf_counter()
        plan = fn(chains, req, tok)
        seconds = time.perf_counter() - t0
        self.calls.append(PlanCall(self.mode, seconds, len(plan.input_ids), plan.new_tokens))
        return plan

    def timed_parse(self, original: Any) -> Any:
        """A dialect's `parse` (body -> ChatRequest, whatever the wire), timed."""

        async def parse(dialect: Any, body: bytes, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await original(dialect, body, **kwargs)
            finally:
                self.parse_s.append(time.perf_counter() - t0)

        return parse

    @contextlib.contextmanager
    def installed(self) -> Iterator[Planner]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(turn_module, "plan_turn", self))
            for cls in (Anthropic, OpenAIChat, OpenAIResponses):
                stack.enter_context(mock.patch.object(cls, "parse", self.timed_parse(cls.parse)))
            yield self


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
        if tool_result_words is not None:
            self.conversation.add_tool_result(tool_result_words)
        body = self.conversation.body()
        headers = {
            "x-api-key": self.session_id,
            "anthropic-version": "2023-06-01",
            "content-type": "application/json",
        }
        path = "/v1/messages?beta=true"
        if self.dialect == "openai-chat":
            body, path = chat_body(body), "/v1/chat/completions"
            headers = {"authorization": f"Bearer {self.session_id}", **headers}
        stack = self.stack
        stack.planner.mode = mode
        url = stack.server.url + path
        started = time.perf_counter()
        async with stack.http.post(url, data=body, headers=headers) as resp:
            raw = await resp.read()
            status = resp.status
        ended = time.perf_counter()
        if status != 200:
            raise RuntimeError(f"turn failed with HTTP {status}: {raw[:500]!r}")
        parse = parse_sse if self.dialect == "anthropic" else parse_chat_sse
        request_id, content, usage = parse(raw)
        self.conversation.add_answer(content)
        call = stack.planner.calls[-1]
        new_tokens = call.new_tokens + self.output_tokens  # the previous output joins the context
        self.prompt_tokens = call.prompt_tokens
        self.output_tokens = usage.get("output_tokens", 0)
        return TurnSample(
            mode,
            request_id,
            started,
            ended,
            call.prompt_tokens,
            new_tokens,
            call.seconds,
            stack.planner.parse_s[-1],
        )


def parse_sse(raw: bytes) -> tuple[str, list[dict[str, Any]], dict[str, int]]:
    """(message id, content blocks, final usage) of a streamed Messages answer."""
    message_id, usage = "", {}
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, list[str]] = {}
    for frame in raw.decode().split("\n\n"):
        data = next((line[6:] for line in frame.split("\n") if line.startswith("data: ")), None)
        if data is None:
            continue
        event = json.loads(data)
        kind = event["type"]
        if kind == "message_start":
            message_id = event["message"]["id"]
        elif kind == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
            partial[event["index"]] = []
        elif kind == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]].append(delta["partial_json"])
        elif kind == "message_delta":
            usage = event.get("usage", {})
        elif kind == "error":
            raise RuntimeError(f"the stream failed: {event}")
    for index, block in blocks.items():
        if block["type"] == "tool_use" and partial[index]:
            block["input"] = json.loads("".join(partial[index]))
    return message_id, [blocks[i] for i in sorted(blocks)], usage


def chat_body(messages_body: bytes) -> bytes:
    """The same request as Chat Completions (system, tool results as `tool` messages)."""
    req = json.loads(messages_body)
    system = "\n\n".join(
        b["text"] for b in req["system"] if not b["text"].startswith("x-anthropic-billing-header")
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for m in req["messages"]:
        if isinstance(m["content"], str):
            messages.append({"role": m["role"], "content": m["content"]})
        elif m["role"] == "assistant":
            text = "".join(b["text"] for b in m["content"] if b["type"] == "text")
            calls = [
                {
                    "id": b["id"],
                    "type": "function",
                    "function": {"name": b["name"], "arguments": json.dumps(b["input"])},
                }
                for b in m["content"]
                if b["type"] == "tool_use"
            ]
            messages.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        else:
            for b in m["content"]:
                messages.append(
                    {"role": "tool", "tool_call_id": b["tool_use_id"], "content": b["content"]}
                )
    tools = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t["input_schema"],
            },
        }
        for t in req["tools"]
    ]
    chat = {
        "model": req["model"],
        "messages": messages,
        "tools": tools,
        "max_completion_tokens": req["max_tokens"],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(chat).encode()


def parse_chat_sse(raw: bytes) -> tuple[str, list[dict[str, Any]], dict[str, int]]:
    """(id, Anthropic-shaped content blocks, usage) of a streamed Chat Completions answer."""
    message_id, text, usage = "", "", {}
    calls: dict[int, dict[str, Any]] = {}
    for frame in raw.decode().split("\n\n"):
        if not frame.startswith("data: ") or frame == "data: [DONE]":
            continue
        chunk = json.loads(frame[6:])
        if "error" in chunk:
            raise RuntimeError(f"the stream failed: {chunk}")
        message_id = chunk["id"]
        if chunk.get("usage"):
            usage = {"output_tokens": chunk["usage"]["completion_tokens"]}
        for choice in chunk["choices"]:
            delta = choice["delta"]
            text += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                calls[call["index"]] = call
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text.strip() else []
    for i in sorted(calls):
        call = calls[i]
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"]),
            }
        )
    return message_id, blocks, usage


def _overlap(a0: float, a1: float, spans: list[Span]) -> list[tuple[float, float]]:
    return [(max(a0, s.start), min(a1, s.end)) for s in spans if s.end > a0 and s.start < a1]


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def attribute(sample: TurnSample, engine: list[Span], store: list[Span]) -> None:
    """Engine CPU time and the store's unhidden in-flight time inside one turn."""
    inside = [s for s in engine if s.start >= sample.started and s.end <= sample.ended]
    if not inside:
        raise RuntimeError(
            f"no engine /generate span inside {sample.mode} turn {sample.request_id}: "
            "the engine's timing did not reach the bench"
        )
    sample.engine_s = sum(s.cpu_s for s in inside)
    stored = _overlap(sample.started, sample.ended, store)
    hidden = [iv for s in inside for iv in _overlap(s.start, s.end, [Span(*iv) for iv in stored])]
    sample.store_s = _union_length(stored) - _union_length(hidden)


async def start_stack(
    db: str,
    context_length: int,
    planner: Planner,
    engine_process: bool = False,
    engine_latency_s: float = 0.0,
) -> Stack:
    tok = load_tokenizer(str(TOKENIZER), "chatml-tools")
    engine: EngineThread | EngineProcess
    if engine_process:
        engine = EngineProcess(context_length, engine_latency_s)
    else:
        engine_tok = load_tokenizer(str(TOKENIZER), "chatml-tools")
        engine = EngineThread(engine_tok, context_length, engine_latency_s)
    await engine.start()
    store = await open_store(db, create=True)
    spans: list[Span] = []
    time_store_calls(store, spans)
    client = EngineClient([engine.url])
    await client.start()
    ctx = make_context(
        config=ServerConfig(context_length=context_length, model_name="bench"),
        store=store,
        engine=client,
        tokenizer=tok,
        parser=make_parser("qwen25", None, "builtin"),
        rules=load_rules(None),
    )
    server = RecorderServer(ctx)
    await server.start()
    freeze_startup_heap()  # as `recorder serve` does
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
    return Stack(server, engine, store, http, planner, spans)


async def stop_stack(stack: Stack) -> None:
    await stack.http.close()
    await stack.server.stop(grace_s=5)
    await stack.store.close()
    await stack.engine.stop()


async def open_session(stack: Stack, dialect: str = "anthropic") -> LiveSession:
    auth = {"Authorization": f"Bearer {stack.server.ctx.config.admin_token}"}
    async with stack.http.post(
        stack.server.url + "/sessions", json={"bench": True}, headers=auth
    ) as resp:
        data = await resp.json()
        if resp.status != 201:
            raise RuntimeError(f"could not open a session: {data}")
    return LiveSession(stack, data["session_id"], dialect)


def _words_per_token(tok: Tokenizer) -> float:
    sample = _text(random.Random(3), 2000)
    return 2000 / len(tok.encode(sample))


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
    words_per_token = _words_per_token(tok)
    # ~50 tokens are the model's call and ~15 the template's tool-result wrapping.
    step_words = max(1, round((new_tokens - 65) * words_per_token))
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
    step_words = max(1, step_words + round((new_tokens - grown) * words_per_token))
    ours = await open_session(stack)
    base = await open_session(stack, "anthropic" if peer == "baseline" else dialect)
    for session in (ours, base):
        await session.turn("ours", None)
    checkpoints = []
    for target in sorted(contexts):
        # Grow fast (both sessions, chain path) until the measured turns centre on `target`.
        start_at = target - turns * new_tokens // 2
        while ours.prompt_tokens + ours.output_tokens + new_tokens < start_at:
            missing = start_at - ours.prompt_tokens - ours.output_tokens - 65
            words = max(step_words, min(round(missing * words_per_token), 6000))
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
        return statistics.fmean(key(s) for s in samples) * 1000

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
        ours_p50_ms=statistics.median(s.middleware_s for s in ours) * 1000,
        base_p50_ms=statistics.median(s.middleware_s for s in base) * 1000,
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
    table = Table(
        title="end to end: middleware ms per turn = client wall - engine time; mean and p50 over turns\n"
        f"real server + {backend} store + scripted engine ({engine_latency_ms:g} ms simulated GPU "
        f"time per call); ours = Messages, chain reuse; {vs}"
    )
    cols = (
        "context tok", "new/turn", "turns", "engine ms", "ours ms", "ours p50",
        "ours parse", "ours plan", "ours store", "base ms", "base p50", "base parse",
        "base plan", "base store",
        "ratio", "ratio p50",
    )  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r.context:,.0f}",
            f"{r.new_tokens:.0f}",
            f"{r.turns}",
            f"{r.engine_ms:.1f}",
            f"{r.ours_ms:.1f}",
            f"{r.ours_p50_ms:.1f}",
            f"{r.ours_parse_ms:.1f}",
            f"{r.ours_plan_ms:.1f}",
            f"{r.ours_store_ms:.1f}",
            f"{r.base_ms:.1f}",
            f"{r.base_p50_ms:.1f}",
            f"{r.base_parse_ms:.1f}",
            f"{r.base_plan_ms:.1f}",
            f"{r.base_store_ms:.1f}",
            f"{r.ratio:.1f}x",
            f"{r.ratio_p50:.1f}x",
        )
    return table


def per_turn_table(points: list[Checkpoint]) -> Table:
    table = Table(title="end to end, every measured turn (ms)")
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
    for col in cols:
        table.add_column(col, justify="right")
    for point in points:
        for s in point.samples:
            table.add_row(
                s.mode,
                f"{s.prompt_tokens:,}",
                f"{s.new_tokens}",
                f"{(s.ended - s.started) * 1000:.1f}",
                f"{s.engine_s * 1000:.1f}",
                f"{s.middleware_s * 1000:.1f}",
                f"{s.parse_s * 1000:.1f}",
                f"{s.plan_s * 1000:.1f}",
                f"{s.store_s * 1000:.1f}",
            )
    return table


# ==========================================================================
# Command line
# ==========================================================================


@dataclass
class Results:
    e2e: list[E2eRow] = field(default_factory=list)
    pure: list[dict[str, float]] = field(default_factory=list)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> Results:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--section", choices=("both", "e2e", "pure"), default="both")
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
    ap.add_argument("--serve-engine", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engine-context", type=int, default=131072, help=argparse.SUPPRESS)
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
    if args.serve_engine is not None:
        serve_engine(args.serve_engine, args.engine_context, args.engine_latency_ms / 1000)
        return Results()
    console = Console(width=200)
    results = Results()
    contexts = _ints(args.contexts)
    if args.section in ("both", "e2e"):
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
        console.print(e2e_table(results.e2e, args.engine_latency_ms, backend, peer))
        if args.per_turn:
            console.print(per_turn_table(points))
    if args.section in ("both", "pure"):
        tok = load_tokenizer(str(TOKENIZER), chat_template=str(TEMPLATE))
        for context in contexts:
            for new_words in _ints(args.new_words):
                results.pure.append(measure(tok, context, new_words, args.repeat))
        console.print(pure_table(results.pure))
    return results


if __name__ == "__main__":
    main()
