"""A scripted engine whose `/generate` costs next to nothing, for throughput runs.

At 100k tokens of context the test engine's `/generate` took ~10 ms of CPU a call:
it decodes ~450 kB of input ids into a list and hashes the whole prompt to pick its
reply. Beside a recorder that spends ~4 ms a turn, on the same two cores, that
engine was what `bench_server` measured. This one answers every call with the same
reply tokens and reads of the request only what the answer needs: its `rid`, how
many input ids it has (the commas in their JSON, never decoded), `max_new_tokens`,
its stop token ids and whether it wants logprobs. The answer has the test engine's
shape (`output_ids`, `meta_info` with `prompt_tokens`, `finish_reason`,
`weight_version`, `output_token_logprobs`), so the recorder does the same work on
it. Every other route (`/model_info`, `/health`, `/abort_request`, ...) is the test
engine's own.

    python -m tools.benchkit.lean_engine PORT --context N
"""

from __future__ import annotations

import argparse
import subprocess
import time
from typing import Any

import msgspec
import numpy as np
import orjson
from aiohttp import web

from recorder.model.tokenizer import Tokenizer
from tools.benchkit.engine import fixture_tokenizer, serve_until_sigterm
from tools.benchkit.procs import python_module
from tools.test_engine.core import EngineCore, build_app
from tools.test_engine.launch import free_port, wait_until_healthy
from tools.test_engine.scripted import ScriptedBackend, hashed_logprob

REPLY = "Scripted reply: the lean engine answers every call with these words."


_IDS_KEY = b'"input_ids":'


class _Request(msgspec.Struct):
    input_ids: list[int] = []  # emptied by `split_input_ids` (its count is kept)
    rid: str | None = None
    sampling_params: dict[str, Any] | None = None
    return_logprob: bool = False


class CannedGenerate:
    """`/generate` answered with `reply_ids` (cut at `max_new_tokens` or a stop id)."""

    def __init__(self, core: EngineCore, reply_ids: list[int]) -> None:
        self.core = core
        self.reply_ids = reply_ids
        self.reply_text = core.tokenizer.decode(reply_ids)

    async def __call__(self, request: web.Request) -> web.Response:
        started = time.monotonic()
        try:
            rest, n = split_input_ids(await request.read())
            req = msgspec.json.decode(rest, type=_Request)
        except (ValueError, msgspec.DecodeError) as exc:
            return _error(400, f"body is not a /generate request: {exc}")
        sp = req.sampling_params or {}
        max_new = sp.get("max_new_tokens")
        max_new = 128 if max_new is None else int(max_new)
        if n + max_new > self.core.context_length:
            return _error(400, f"{n} + {max_new} tokens exceed the context length")
        out, finish = self._output(max_new, set(sp.get("stop_token_ids") or ()))
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": n,
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "finish_reason": finish,
            "weight_version": self.core.weight_version,
            "e2e_latency": time.monotonic() - started,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [
                [hashed_logprob(n + i, t), t, None] for i, t in enumerate(out)
            ]
        text = self.reply_text if len(out) == len(self.reply_ids) else ""
        body = {"text": text, "output_ids": out, "meta_info": meta}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    def _output(self, max_new: int, stop_ids: set[int]) -> tuple[list[int], dict[str, Any]]:
        stops = stop_ids | set(self.core.tokenizer.eos_token_ids)
        out: list[int] = []
        for token in self.reply_ids:
            if len(out) >= max_new:
                return out, {"type": "length", "length": len(out)}
            out.append(token)
            if token in stops:
                return out, {"type": "stop", "matched": token}
        return out, {"type": "stop", "matched": None}


def split_input_ids(body: bytes) -> tuple[bytes, int]:
    """(`body` with its `input_ids` array emptied, how many ids the array held).

    The array is found by its key and brackets and its ids counted by their commas
    (a vectorised count, ~0.05 ms for 100k ids) without being decoded: decoding
    ~450 kB of JSON into a Raw and counting with `bytes.count` was ~0.6 ms a call,
    half of this engine's CPU. What is left, a few hundred bytes, is decoded and
    checked as usual: a nested array or a "]" in a string leaves it no valid JSON.
    Raises ValueError for an `input_ids` that is no array.
    """
    at = body.find(_IDS_KEY)
    if at < 0:
        return body, 0
    start = at + len(_IDS_KEY)
    while start < len(body) and body[start] in b" \t\r\n":
        start += 1
    end = body.find(b"]", start)
    if start >= len(body) or body[start] != ord("[") or end < 0:
        raise ValueError("input_ids is not a JSON array of token ids")
    inside = np.frombuffer(body, np.uint8, count=end - start - 1, offset=start + 1)
    commas = int(np.count_nonzero(inside == ord(",")))
    empty = commas == 0 and not body[start + 1 : end].strip()
    return body[: start + 1] + body[end:], 0 if empty else commas + 1


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def lean_app(tok: Tokenizer, context_length: int) -> web.Application:
    """The test engine's app (scripted, no history) with `CannedGenerate` as `/generate`."""
    core = EngineCore(
        ScriptedBackend(tok),
        tok,
        context_length=context_length,
        keep_history=False,
        check_contract=False,
    )
    generate = CannedGenerate(core, [*tok.encode(REPLY), *tok.eos_token_ids[:1]])
    app = build_app(core)

    @web.middleware
    async def canned(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/generate" and request.method == "POST":
            return await generate(request)
        return await handler(request)  # type: ignore[no-any-return]

    app.middlewares.insert(0, canned)
    return app


def start_lean_engine(context_length: int) -> tuple[subprocess.Popen[bytes], str]:
    """The lean engine in a child process (its own GIL, as a real engine); (process, url)."""
    port = free_port()
    proc = python_module("tools.benchkit.lean_engine", str(port), "--context", str(context_length))
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, what="the lean engine")
    return proc, url


def serve(port: int, context_length: int) -> None:
    """Run the lean engine on `port` until SIGTERM."""
    tok = fixture_tokenizer()
    serve_until_sigterm(lambda: lean_app(tok, context_length), port)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--context", type=int, default=32768)
    args = parser.parse_args()
    serve(args.port, args.context)
