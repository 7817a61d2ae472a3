"""The I/O floor: what any aiohttp middleware between an agent and SGLang must do per turn.

A contender of `bench_middleware --section cpu` (column "floor"), so the CPU per
turn of our recorder can be read against what cannot be removed without
leaving aiohttp and asyncio's transports, measured in the same run on the
same engine and conversation. Per streamed Messages request it:

  - reads the whole body and decodes it (msgspec, the fastest JSON decoder here);
  - sends `/generate` a prompt of about as many ids as our chain sends for the
    same body (`prompt_tokens`, calibrated on the bench's conversation), as
    pre-made JSON bytes (no serializing: the cheapest a cached prefix can be);
  - reads and decodes the engine's answer, cuts the tool call out of its text;
  - appends one row (output ids and logprobs) to SQLite and commits it durably
    (WAL, synchronous=FULL) on a writer thread before answering, as the
    recorder's durable-before-answer rule requires;
  - answers with one SSE write (message_start, a text and a tool_use block,
    message_delta with usage, message_stop).

It keeps no chain, tokenizes nothing, checks nothing and records no events
beyond that row: a lower bound, not a recorder. `python -m tools.benchkit.floor
--engine URL --port N --db FILE` serves it; `FloorProcess` runs it as a child.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import subprocess
import tempfile
import uuid
from pathlib import Path

import aiohttp
import msgspec
import orjson
from aiohttp import web

from tools.benchkit.procs import python_module
from tools.benchkit.wire import wait_healthy
from tools.test_engine.launch import free_port

ID_JSON = b"1000,"  # one id as JSON: every prompt id costs the bytes a 4-digit id does
# The bench's conversation (tools/benchkit/conversation.py) renders its ~3.1 kB
# first body (Claude Code's tools, system) to ~2,900 tokens, and what it adds at
# ~5.6 bytes of body per token (measured with the fixture tokenizer at 100k).
PREAMBLE_BYTES, PREAMBLE_TOKENS, BYTES_PER_TOKEN = 3_100, 2_900, 5.6
SAMPLING = b'"sampling_params":{"max_new_tokens":4096,"temperature":1.0},"return_logprob":true'


def prompt_tokens(body_bytes: int) -> int:
    """About how many tokens our chain sends for a body of the bench's conversation."""
    return PREAMBLE_TOKENS + max(0, int((body_bytes - PREAMBLE_BYTES) / BYTES_PER_TOKEN))


def generate_body(n_ids: int) -> bytes:
    """A `/generate` body of `n_ids` prompt ids, made by concatenating bytes."""
    ids = b"[" + ID_JSON * (n_ids - 1) + ID_JSON[:-1] + b"]"
    return b'{"input_ids":' + ids + b"," + SAMPLING + b"}"


def tool_call(text: str) -> tuple[str, dict[str, object] | None]:
    """(the text before the call, the call's JSON) of a Qwen-style `<tool_call>` answer."""
    start = text.find("<tool_call>")
    end = text.find("</tool_call>", start)
    if start < 0 or end < 0:
        return text, None
    call = msgspec.json.decode(text[start + len("<tool_call>") : end].strip())
    return text[:start].rstrip("\n"), call


def sse_answer(text: str, call: dict[str, object] | None, n_in: int, n_out: int) -> bytes:
    """A whole streamed Messages answer, as bytes for one write."""
    frames: list[tuple[str, object]] = [
        ("message_start", {"type": "message_start", "message": {
            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "content": [], "model": "floor", "usage": {"input_tokens": n_in, "output_tokens": 0},
        }}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": text}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ]  # fmt: skip
    if call is not None:
        frames += [
            ("content_block_start", {"type": "content_block_start", "index": 1, "content_block": {
                "type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                "name": call["name"], "input": {},
            }}),
            ("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {
                "type": "input_json_delta", "partial_json": orjson.dumps(call["arguments"]).decode(),
            }}),
            ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        ]  # fmt: skip
    stop = "tool_use" if call is not None else "end_turn"
    frames += [
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop},
                           "usage": {"input_tokens": n_in, "output_tokens": n_out}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    return b"".join(
        b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
        for name, data in frames
    )


class _Log:
    """One SQLite table, one durable commit per turn, on one writer thread."""

    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(path, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute("CREATE TABLE IF NOT EXISTS turns (id INTEGER PRIMARY KEY, row BLOB)")
        self.lock = asyncio.Lock()

    def _append(self, row: bytes) -> None:
        self.conn.execute("INSERT INTO turns (row) VALUES (?)", (row,))
        self.conn.commit()

    async def append(self, row: bytes) -> None:
        async with self.lock:
            await asyncio.to_thread(self._append, row)


def floor_app(engine_url: str, db: str) -> web.Application:
    app = web.Application(client_max_size=2**30)
    log = _Log(db)
    http: list[aiohttp.ClientSession] = []

    async def messages(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        msgspec.json.decode(raw)
        n_in = prompt_tokens(len(raw))
        async with http[0].post(
            engine_url + "/generate",
            data=generate_body(n_in),
            headers={"Content-Type": "application/json"},
        ) as resp:
            out = msgspec.json.decode(await resp.read())
        if resp.status != 200:
            return web.json_response(out, status=resp.status)
        meta = out["meta_info"]
        await log.append(orjson.dumps(meta["output_token_logprobs"]))
        text, call = tool_call(out["text"])
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        await answer.write(sse_answer(text, call, n_in, meta["completion_tokens"]))
        await answer.write_eof()
        return answer

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def start_client(app: web.Application) -> None:
        http.append(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)))

    async def stop_client(app: web.Application) -> None:
        await http[0].close()

    app.router.add_post("/v1/messages", messages)
    app.router.add_get("/health", health)
    app.on_startup.append(start_client)
    app.on_cleanup.append(stop_client)
    return app


class FloorProcess:
    """The floor server in a child process, served as the benchmarks serve a recorder."""

    def __init__(self, engine_url: str, db: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_file = Path(tempfile.mkstemp(prefix="bench_floor_", suffix=".log")[1])
        with self.log_file.open("wb") as out:
            self.proc = python_module(
                "tools.benchkit.floor", "--engine", engine_url, "--port", str(port), "--db", db,
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    async def wait_healthy(self, http: aiohttp.ClientSession) -> None:
        what = f"the floor server (its output: {self.log_file})"
        await wait_healthy(http, self.url, self.proc.poll, what)

    async def open_session(self, http: aiohttp.ClientSession) -> str:
        return f"floor-{uuid.uuid4().hex}"  # it keeps nothing per session

    async def stop(self) -> None:
        self.proc.terminate()
        await asyncio.to_thread(self.proc.wait, 60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--db", required=True)
    args = ap.parse_args()
    web.run_app(
        floor_app(args.engine.rstrip("/"), args.db),
        host="127.0.0.1",
        port=args.port,
        access_log=None,
        print=None,
    )


if __name__ == "__main__":
    main()
