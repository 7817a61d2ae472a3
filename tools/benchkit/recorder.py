"""The recorder under test: `recorder serve` in a child process, or a `RecorderServer` here.

A child process is how users run it (its RSS and CPU are its own); the
in-process server lets a benchmark patch and time the server's own calls.
Both use the repository's fixture tokenizer, the chatml-tools template and
the qwen25 tool parser, and admin token `ADMIN`.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from recorder.log.store.base import EventStore
from recorder.model.engine import EngineClient
from recorder.model.parsers import make_parser
from recorder.model.tokenizer import Tokenizer
from recorder.server import RecorderServer, ServerConfig, make_context
from recorder.server.app import freeze_startup_heap
from replay.rules import load_rules
from tools.benchkit.engine import TOKENIZER
from tools.benchkit.memory import ProcessMemory
from tools.benchkit.procs import REPO, python_module
from tools.benchkit.wire import open_session, wait_healthy
from tools.test_engine.launch import free_port

ADMIN = "bench"


class RecorderProcess:
    """`recorder serve` on `db` in front of `engine_url`, in a child process.

    `peer`: the same command with the full re-render planner (`benchkit.peer`).
    `log`: write its output to a new temporary file (`log_file`) instead of ours.
    `root`: run another checkout's recorder (a before/after comparison in one run).
    `module`: run `python -m MODULE... SERVE_ARGS` instead (a server with a probe installed).
    `BENCH_PROFILE=FILE` in the environment runs it under cProfile into FILE.
    """

    def __init__(
        self,
        engine_url: str,
        db: str,
        extra: Sequence[str] = (),
        *,
        peer: bool = False,
        log: bool = False,
        root: Path = REPO,
        module: Sequence[str] = (),
    ) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        serve_args = [
            "--db", db, "--engine", engine_url, "--tokenizer", str(TOKENIZER),
            "--chat-template", "chatml-tools", "--tool-parser", "qwen25",
            "--port", str(port), "--admin-token", ADMIN, *extra,
        ]  # fmt: skip
        if not module:
            module = ["tools.benchkit.peer"] if peer else ["recorder.cli", "serve"]
        profile = os.environ.get("BENCH_PROFILE")
        if profile:
            module = ["cProfile", "-o", profile, "-m", *module]
        self.log_file: Path | None = None
        if log:
            self.log_file = Path(tempfile.mkstemp(prefix="bench_server_", suffix=".log")[1])
            with self.log_file.open("wb") as out:  # the child keeps its own descriptor
                self.proc = python_module(
                    module[0],
                    *module[1:],
                    *serve_args,
                    root=root,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
        else:
            self.proc = python_module(module[0], *module[1:], *serve_args, root=root)
        self.memory = ProcessMemory(self.proc.pid)

    async def wait_healthy(self, http: aiohttp.ClientSession) -> None:
        await wait_healthy(http, self.url, self.proc.poll, "the recorder")

    async def open_session(self, http: aiohttp.ClientSession) -> str:
        """A new session over the admin API (token `ADMIN`); its id is the client's API key."""
        return await open_session(http, self.url, ADMIN, {})

    def rss(self) -> int:
        return self.memory.rss()

    def anon(self) -> int:
        return self.memory.anon()

    def terminate(self) -> None:
        """Stop it (SIGTERM: a graceful shutdown) and wait."""
        self.proc.terminate()
        self.proc.wait(timeout=60)

    async def stop(self) -> None:
        self.proc.terminate()
        await asyncio.to_thread(self.proc.wait, 60)


async def start_server(
    store: EventStore, engine_url: str, tok: Tokenizer, context_length: int
) -> RecorderServer:
    """A `RecorderServer` in this process, set up as `recorder serve` sets it up."""
    client = EngineClient([engine_url])
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
    return server


async def idle_rss(engine_url: str, db: str, backend: str | None, root: Path = REPO) -> int:
    """RSS of a started, healthy, idle `recorder serve` of checkout `root` on `db`
    (`backend`: its --parser-backend; None: the default, SGLang's parsers when installed)."""
    extra = ["--log-level", "WARNING"] + (["--parser-backend", backend] if backend else [])
    recorder = RecorderProcess(engine_url, db, extra, root=root)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            await recorder.wait_healthy(http)
        await asyncio.sleep(1.0)
        return recorder.rss()
    finally:
        await recorder.stop()
