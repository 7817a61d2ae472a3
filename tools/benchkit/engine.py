"""The engine a benchmark runs against: the scripted engine, timing its own `/generate` calls.

The scripted engine answers every call with the model's ~50-token tool call
at once (`conversation.tool_call_reply`) and keeps nothing per request
(`keep_history=False`). Each call's span is recorded so a benchmark can take
the engine's own time out of a turn's wall time; `GET /bench/spans` serves
them to a benchmark in another process (perf_counter is the system-wide
monotonic clock, comparable across processes).

`EngineThread` runs it on its own loop and thread of this process (it then
shares the GIL and the garbage collector with whatever else runs here);
`EngineProcess` in a child (`python -m tools.benchkit.engine PORT`), as a real
engine runs. `start_test_engine` starts the test engine's own CLI as a subprocess.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from recorder.model.tokenizer import Tokenizer, load_tokenizer
from tools.benchkit.conversation import tool_call_reply
from tools.benchkit.procs import REPO, python_module
from tools.benchkit.stats import Span
from tools.benchkit.wire import wait_healthy
from tools.test_engine.core import EngineCore, build_app
from tools.test_engine.launch import free_port, start_subprocess
from tools.test_engine.scripted import Reply, ScriptedBackend

TOKENIZER = REPO / "tests" / "data" / "smollm2-tokenizer"


def fixture_tokenizer() -> Tokenizer:
    """The repository's small tokenizer with the chatml-tools template, as `recorder serve` loads it."""
    return load_tokenizer(str(TOKENIZER), "chatml-tools")


def start_test_engine(context_length: int) -> tuple[subprocess.Popen[bytes], str]:
    """The test engine's scripted backend in a subprocess, zero latency, no history kept."""
    return start_subprocess(
        [
            *("--backend", "scripted", "--context-length", str(context_length)),
            *("--no-keep-history", "--no-check-contract"),
        ]
    )


def engine_app(
    tok: Tokenizer,
    context_length: int,
    spans: list[Span],
    latency_s: float = 0.0,
    *,
    max_spans: int | None = None,
    answer_words: int = 0,
) -> web.Application:
    """The scripted engine answering tool calls, timing each `/generate` into `spans`.

    `latency_s` simulates the GPU's time per call (an idle sleep): it counts as
    engine time, and the server's background writes may overlap it as they
    would a real engine's. `max_spans`: keep only the newest (a long run reads
    them as it goes). `answer_words`: words of text before each answer's call.
    """
    count = itertools.count()
    backend = ScriptedBackend(
        tok,
        default_reply=lambda req: Reply(
            text=tool_call_reply(tok, len(req.input_ids), next(count), answer_words)
        ),
    )
    core = EngineCore(
        backend, tok, context_length=context_length, keep_history=False, check_contract=False
    )
    app = build_app(core)

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


async def serve_app(app: web.Application, port: int) -> tuple[web.AppRunner, str]:
    """Serve `app` on loopback (`port` 0: any free one); (runner, its URL)."""
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
            return await serve_app(app, 0)

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
    """The same engine in a child process: no GIL shared with the server."""

    def __init__(self, context_length: int, latency_s: float = 0.0, answer_words: int = 0) -> None:
        self.context_length = context_length
        self.latency_s = latency_s
        self.answer_words = answer_words
        self.url = ""
        self._proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> str:
        port = free_port()
        args = [str(port), "--context", str(self.context_length)]
        args += ["--latency-ms", str(self.latency_s * 1000)]
        args += ["--answer-words", str(self.answer_words)]
        proc = self._proc = python_module("tools.benchkit.engine", *args)
        self.url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            await wait_healthy(http, self.url, proc.poll, "the engine process", timeout_s=60)
        return self.url

    async def fetch_spans(self) -> list[Span]:
        async with aiohttp.ClientSession() as http, http.get(self.url + "/bench/spans") as resp:
            return [Span(*row) for row in await resp.json()]

    async def stop(self) -> None:
        if self._proc is not None:
            proc, self._proc = self._proc, None
            proc.terminate()
            await asyncio.to_thread(proc.wait, 30)


def serve_engine(
    port: int, context_length: int, latency_s: float = 0.0, answer_words: int = 0
) -> None:
    """Run the timed scripted engine on `port` until SIGTERM."""
    tok = fixture_tokenizer()
    serve_until_sigterm(
        lambda: engine_app(
            tok, context_length, [], latency_s, max_spans=100_000, answer_words=answer_words
        ),
        port,
    )


def serve_until_sigterm(make_app: Callable[[], web.Application], port: int) -> None:
    """Serve the app `make_app` builds (inside the loop) on `port` until SIGTERM."""

    async def run() -> None:
        runner, _ = await serve_app(make_app(), port)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="the timed scripted engine (EngineProcess's child)")
    ap.add_argument("port", type=int)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--latency-ms", type=float, default=0.0)
    ap.add_argument("--answer-words", type=int, default=0)
    args = ap.parse_args()
    serve_engine(args.port, args.context, args.latency_ms / 1000, args.answer_words)
