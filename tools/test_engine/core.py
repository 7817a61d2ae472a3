"""The HTTP side of the test engines: SGLang's `/generate` subset and controls.

A backend (scripted or tiny model) only produces the next token; this module
does everything else the way SGLang does: request validation (400 on unknown
sampling keys or a prompt that does not fit the context), max_new_tokens,
EOS / stop_token_ids / stop strings, abort by rid prefix (a running request
answers with its partial output), pause/continue with weight-version bumps,
cached-prefix accounting, and per-request fault injection.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import numpy as np
from aiohttp import web

from recorder.model.parsers import check_parser_names, parse_tool_calls, split_reasoning_for
from recorder.model.tokenizer import Tokenizer

from .contract import contract_error


class Fault(msgspec.Struct, kw_only=True):
    """A fault for the next matching `/generate` request.

    `match`: a substring of the decoded prompt (None: the next request).
    `times`: how many requests it applies to.
    """

    match: str | None = None
    times: int = 1
    status: int | None = None  # answer this HTTP status, generate nothing
    message: str = "injected fault"
    delay_s: float = 0.0  # wait before the first token (abortable)
    abort_after: int | None = None  # abort after this many output tokens
    logprobs: str = "ok"  # "ok" | "missing" (no output_token_logprobs) | "short" (one fewer)
    pause_after: int | None = None  # pause_generation(abort) after this many tokens...
    pause_s: float = 0.05  # ...then continue_generation after this long
    new_weight_version: str | None = None  # version set on that continue (None: +1)
    disconnect: bool = False  # close the connection without answering


class GenRequest(msgspec.Struct, kw_only=True):
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_logprob: bool = False
    return_routed_experts: bool = False
    json_schema: str | None = None  # taken (a scripted reply is not constrained by it)


class TokenSource(Protocol):
    """One request's token producer."""

    token_delay_s: float

    async def next_token(self) -> tuple[int, float] | None:
        """The next (token id, logprob), or None when the source has nothing more."""
        ...

    def finished(self, output_ids: list[int], finish_type: str) -> None:
        """Called once when the request ends (the scripted backend keeps aborted plans)."""
        ...


class Backend(Protocol):
    model_path: str

    def open(self, req: GenRequest, prompt_text: str | None) -> TokenSource: ...

    def needs_prompt_text(self) -> bool: ...


class BadRequest(Exception):
    pass


class _Running:
    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.abort = asyncio.Event()
        self.message = ""

    def cancel(self, message: str) -> None:
        if not self.abort.is_set():
            self.message = message
            self.abort.set()


class _PrefixTrie:
    """Longest previously seen token prefix (the engine's prefix cache, roughly)."""

    def __init__(self, max_nodes: int = 2_000_000) -> None:
        self._root: dict[int, Any] = {}
        self._nodes = 0
        self._max = max_nodes

    def longest(self, ids: Sequence[int]) -> int:
        node, n = self._root, 0
        for t in ids:
            node = node.get(t)
            if node is None:
                break
            n += 1
        return n

    def insert(self, ids: Sequence[int]) -> None:
        if self._nodes + len(ids) > self._max:
            self._root, self._nodes = {}, 0
        node = self._root
        for t in ids:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                self._nodes += 1
            node = nxt


class EngineCore:
    """Shared `/generate` semantics and control endpoints over a Backend."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        *,
        context_length: int = 32768,
        weight_version: str = "0",
        tool_call_parser: str = "qwen25",
        reasoning_parser: str = "qwen3",
        routed_experts_shape: tuple[int, int] = (2, 2),
        keep_history: bool = True,
        check_contract: bool = True,
    ) -> None:
        """`keep_history=False`: keep nothing per request (no `requests` list, no
        prefix cache, `cached_tokens` always 0), so a long benchmark measures the
        recorder's memory, not the stand-in engine's (its trie holds a dict per token).

        `check_contract=False` (benchmarks only): skip SGLang's own request
        validation (pydantic, ~22 ms for 100k input ids) and read the body with
        msgspec into typed fields (input ids still checked as ints, in C). A real
        SGLang validates on its own host; on a shared 2-core benchmark box that
        cost would be charged to the machine the recorder is measured on."""
        self.check_contract = check_contract
        self.backend = backend
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.weight_version = weight_version
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.routed_experts_shape = routed_experts_shape
        self.keep_history = keep_history
        self.healthy = True
        # What the engine saw, for assertions in tests.
        self.requests: list[GenRequest] = []
        self.aborts: list[str] = []
        self.faults: list[Fault] = []
        self._running: dict[str, _Running] = {}
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._pause_mode = ""
        self._cache = _PrefixTrie()
        self._background: set[asyncio.Task[None]] = set()

    # -- controls (also callable in-process) --------------------------------

    def inject(self, *faults: Fault) -> None:
        self.faults.extend(faults)

    @property
    def running(self) -> list[str]:
        return list(self._running)

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    def abort(self, rid: str = "", *, abort_all: bool = False, message: str = "aborted") -> int:
        """`/abort_request`: abort running (and paused-queued) requests whose rid
        starts with `rid` (recorded in `aborts`, "*" for abort_all)."""
        self.aborts.append("*" if abort_all else rid)
        return self.cancel(rid, abort_all=abort_all, message=message)

    def cancel(self, rid: str = "", *, abort_all: bool = False, message: str) -> int:
        hit = 0
        for running in list(self._running.values()):
            if abort_all or (rid and running.rid.startswith(rid)):
                running.cancel(message)
                hit += 1
        return hit

    def pause(self, mode: str = "abort") -> None:
        self._unpaused.clear()
        self._pause_mode = mode
        if mode == "abort":
            self.cancel(abort_all=True, message="pause_generation (abort)")

    def resume(self, new_weight_version: str | None = None) -> None:
        if new_weight_version is not None:
            self.weight_version = new_weight_version
        self._pause_mode = ""
        self._unpaused.set()

    def bump_weight_version(self) -> str:
        try:
            self.weight_version = str(int(self.weight_version) + 1)
        except ValueError:
            self.weight_version = self.weight_version + "+1"
        return self.weight_version

    # -- /generate ----------------------------------------------------------

    def parse_raw(self, raw: bytes) -> GenRequest:
        """`parse_request` of a raw body; without the contract check, a typed msgspec read."""
        if self.check_contract:
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise BadRequest(f"body is not JSON: {exc}") from exc
            return self.parse_request(body)
        try:
            lean = msgspec.json.decode(raw, type=_LeanGenerate)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"body is not a /generate request: {exc}") from exc
        return self._request(msgspec.structs.asdict(lean))

    def parse_request(self, body: Any) -> GenRequest:
        """The request, or BadRequest for what SGLang refuses (its contract, see contract.py)
        and for what a test engine cannot do (text prompts, streaming)."""
        error = contract_error(body)
        if error is not None:
            raise BadRequest(error)
        ids = body.get("input_ids")
        if isinstance(ids, list) and not all(isinstance(i, int) for i in ids):
            raise BadRequest("the test engine takes one prompt: input_ids as a list of ints")
        return self._request(body)

    def _request(self, body: dict[str, Any]) -> GenRequest:
        if body.get("text") is not None and body.get("input_ids") is None:
            raise BadRequest("the test engine takes input_ids, not text")
        ids = body.get("input_ids")
        if not isinstance(ids, list):
            raise BadRequest("the test engine takes one prompt: input_ids as a list of ints")
        if body.get("stream"):
            raise BadRequest("the test engine does not stream; send stream=false")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise BadRequest("the test engine takes one sampling_params object")
        # `null` means SGLang's default, as the contract says.
        stop = sp.get("stop") or ()
        return GenRequest(
            rid=str(body.get("rid") or uuid.uuid4().hex),
            input_ids=ids,
            max_new_tokens=_given(sp, "max_new_tokens", 128),
            temperature=float(_given(sp, "temperature", 1.0)),
            top_p=float(_given(sp, "top_p", 1.0)),
            top_k=_given(sp, "top_k", -1),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
            ignore_eos=_given(sp, "ignore_eos", False),
            return_logprob=bool(body.get("return_logprob")),
            return_routed_experts=bool(body.get("return_routed_experts")),
            json_schema=sp.get("json_schema"),
        )

    def check_context(self, req: GenRequest) -> None:
        n = len(req.input_ids)
        if n >= self.context_length:
            raise BadRequest(
                f"The input ({n} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )
        if n + req.max_new_tokens > self.context_length:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_length} tokens. You requested a total of "
                f"{n + req.max_new_tokens} tokens: {n} tokens from the input messages and "
                f"{req.max_new_tokens} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )

    def _take_fault(self, prompt_text: str | None) -> Fault | None:
        for i, fault in enumerate(self.faults):
            if fault.match is None or (prompt_text is not None and fault.match in prompt_text):
                fault.times -= 1
                if fault.times <= 0:
                    del self.faults[i]
                return fault
        return None

    def _needs_prompt_text(self) -> bool:
        return self.backend.needs_prompt_text() or any(f.match for f in self.faults)

    async def generate(self, req: GenRequest) -> tuple[int, dict[str, Any], Fault | None]:
        """(HTTP status, JSON body, fault applied) for one request."""
        if self.keep_history:
            self.requests.append(req)
        self.check_context(req)
        prompt_text = self.tokenizer.decode(req.input_ids) if self._needs_prompt_text() else None
        fault = self._take_fault(prompt_text)
        if fault and fault.status:
            return fault.status, {"error": {"message": fault.message}}, fault
        if fault and fault.disconnect:
            return 0, {}, fault
        started = time.monotonic()
        running = _Running(req.rid)
        self._running[req.rid] = running
        source: TokenSource | None = None
        try:
            await self._wait_unpaused(running)
            if fault and fault.delay_s and not running.abort.is_set():
                await _sleep_unless(running.abort, fault.delay_s)
            cached = self._cache.longest(req.input_ids) if self.keep_history else 0
            source = self.backend.open(req, prompt_text)
            out, logprobs, finish = await self._decode(req, source, running, fault)
        except BaseException:
            if source is not None:  # the HTTP request was cancelled: free the backend
                source.finished([], "cancelled")
            raise
        finally:
            self._running.pop(req.rid, None)
        source.finished(out, finish["type"])
        if self.keep_history:
            self._cache.insert([*req.input_ids, *out])
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(out),
            "cached_tokens": cached,
            "finish_reason": finish,
            "weight_version": self.weight_version,
            "e2e_latency": time.monotonic() - started,
        }
        if req.return_logprob and (fault is None or fault.logprobs != "missing"):
            triples = [[lp, t, None] for t, lp in zip(out, logprobs, strict=True)]
            if fault is not None and fault.logprobs == "short" and triples:
                triples = triples[:-1]
            meta["output_token_logprobs"] = triples
        if req.return_routed_experts:
            meta["routed_experts"] = self._routed_experts(req.input_ids, out)
        return (
            200,
            {"text": self.tokenizer.decode(out), "output_ids": out, "meta_info": meta},
            fault,
        )

    async def _wait_unpaused(self, running: _Running) -> None:
        while not self._unpaused.is_set() and not running.abort.is_set():
            waiter = asyncio.ensure_future(self._unpaused.wait())
            aborted = asyncio.ensure_future(running.abort.wait())
            try:
                await asyncio.wait({waiter, aborted}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                aborted.cancel()

    async def _decode(
        self, req: GenRequest, source: TokenSource, running: _Running, fault: Fault | None
    ) -> tuple[list[int], list[float], dict[str, Any]]:
        out: list[int] = []
        logprobs: list[float] = []
        stops = set(req.stop_token_ids)
        if not req.ignore_eos:
            stops.update(self.tokenizer.eos_token_ids)
        max_stop = max((len(s) for s in req.stop), default=0)
        while True:
            if running.abort.is_set():
                return out, logprobs, {"type": "abort", "message": running.message}
            if len(out) >= req.max_new_tokens:
                return out, logprobs, {"type": "length", "length": len(out)}
            if self._pause_mode and self._pause_mode != "abort":
                await self._wait_unpaused(running)
                continue
            if source.token_delay_s > 0:
                await _sleep_unless(running.abort, source.token_delay_s)
                if running.abort.is_set():
                    continue
            produced = await source.next_token()
            if produced is None:
                return out, logprobs, {"type": "stop", "matched": None}
            token, logprob = produced
            out.append(token)
            logprobs.append(logprob)
            if token in stops:
                return out, logprobs, {"type": "stop", "matched": token}
            if max_stop:
                tail = self.tokenizer.decode(out[-(max_stop + 2) :])
                hit = next((s for s in req.stop if s in tail), None)
                if hit is not None:
                    return out, logprobs, {"type": "stop", "matched": hit}
            if fault is not None:
                self._fault_after_token(fault, len(out), running)

    def _fault_after_token(self, fault: Fault, produced: int, running: _Running) -> None:
        if fault.abort_after is not None and produced >= fault.abort_after:
            running.cancel(fault.message)
        if fault.pause_after is not None and produced == fault.pause_after:
            self.pause("abort")
            self._spawn(self._continue_later(fault))

    async def _continue_later(self, fault: Fault) -> None:
        await asyncio.sleep(fault.pause_s)
        self.resume(fault.new_weight_version or self.bump_weight_version())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _routed_experts(self, prompt: list[int], out: list[int]) -> str:
        """Deterministic fake routing: (tokens, layers, top-k) int32, base64."""
        layers, topk = self.routed_experts_shape
        ids = np.asarray([*prompt, *out], dtype=np.int64)
        grid = (ids[:, None, None] + np.arange(layers)[None, :, None] * 7 + np.arange(topk)) % 64
        return base64.b64encode(grid.astype(np.int32).tobytes()).decode()

    # -- info ---------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.backend.model_path,
            "tokenizer_path": self.tokenizer.identity.name_or_path,
            "is_generation": True,
            "weight_version": self.weight_version,
            "tool_call_parser": self.tool_call_parser,
            "reasoning_parser": self.reasoning_parser,
            "context_length": self.context_length,
        }

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.backend.model_path,
                    "object": "model",
                    "owned_by": "sglang",
                    "root": self.backend.model_path,
                    "max_model_len": self.context_length,
                }
            ],
        }


async def _sleep_unless(event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)


def _given(params: dict[str, Any], key: str, default: Any) -> Any:
    value = params.get(key)
    return default if value is None else value


# --------------------------------------------------------------------------
# aiohttp application
# --------------------------------------------------------------------------


class _LeanGenerate(msgspec.Struct):
    """The `/generate` fields the test engine reads (`check_contract=False`)."""

    input_ids: list[int] | None = None
    text: Any = None
    rid: str | None = None
    stream: bool = False
    sampling_params: dict[str, Any] | None = None
    return_logprob: bool = False
    return_routed_experts: bool = False


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json(loads=json.loads)
    except ValueError as exc:
        raise BadRequest(f"body is not JSON: {exc}") from exc


class _Endpoints:
    """SGLang's HTTP endpoints (the ones the recorder and its tests use) over one core."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            req = self.core.parse_raw(await request.read())
            status, body, fault = await self.core.generate(req)
        except BadRequest as exc:
            return _error(400, str(exc))
        if fault is not None and fault.disconnect:
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)
        return web.json_response(body, status=status)

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
        except BadRequest as exc:
            return _error(400, str(exc))
        self.core.abort(str(body.get("rid") or ""), abort_all=bool(body.get("abort_all")))
        return web.Response(status=200)

    # -- pausing and weight versions ----------------------------------------

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _json_body(request) if request.can_read_body else {}
        mode = str(body.get("mode") or "abort")
        if mode not in ("abort", "in_place", "retract"):
            return _error(400, f"unknown pause mode {mode!r}")
        self.core.pause(mode)
        return web.json_response({"success": True})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.core.resume()
        return web.json_response({"success": True})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        core = self.core
        if body.get("abort_all_requests"):
            core.cancel(abort_all=True, message="weight version update")
        core.weight_version = str(body.get("new_version") or core.bump_weight_version())
        return web.json_response({"success": True, "weight_version": core.weight_version})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _json_body(request) if request.can_read_body else {}
        version = body.get("weight_version")
        core = self.core
        core.weight_version = str(version) if version else core.bump_weight_version()
        return web.json_response(
            {"success": True, "message": "weights updated", "weight_version": core.weight_version}
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.core.weight_version})

    # -- info -----------------------------------------------------------------

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.core.model_info())

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(self.core.models())

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.core.healthy else 503)

    # -- output parsers ---------------------------------------------------------

    async def parse_function_call(self, request: web.Request) -> web.Response:
        """SGLang's raw split (text before the calls, calls of known tools); policy is the
        recorder's job (recorder.model.parse_policy)."""
        body = await _json_body(request)
        tools = body.get("tools") or []
        parser = body.get("tool_call_parser") or self.core.tool_call_parser or "hermes"
        check_parser_names(parser, None, "builtin")
        normal, raw = parse_tool_calls(str(body.get("text") or ""), parser)
        index = {name: i for i, name in enumerate(_tool_name_list(tools))}
        calls = [
            {"tool_index": index[name], "name": name, "parameters": json.dumps(args)}
            for name, args in raw
            if isinstance(name, str) and name in index
        ]
        return web.json_response({"normal_text": normal.strip(), "calls": calls})

    async def separate_reasoning(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        name = body.get("reasoning_parser") or self.core.reasoning_parser
        check_parser_names(None, name, "builtin")
        reasoning, text = split_reasoning_for(name, str(body.get("text") or ""))
        return web.json_response({"reasoning_text": reasoning or "", "text": text})


def build_app(core: EngineCore) -> web.Application:
    e = _Endpoints(core)
    app = web.Application(client_max_size=1 << 30)
    app.add_routes(
        [
            web.post("/generate", e.generate),
            web.post("/abort_request", e.abort_request),
            web.post("/pause_generation", e.pause_generation),
            web.post("/continue_generation", e.continue_generation),
            web.post("/update_weight_version", e.update_weight_version),
            web.post("/update_weights_from_disk", e.update_weights_from_disk),
            web.get("/get_weight_version", e.get_weight_version),
            web.get("/model_info", e.model_info),
            web.get("/get_model_info", e.model_info),
            web.get("/v1/models", e.models),
            web.get("/health", e.health),
            web.get("/health_generate", e.health),
            web.post("/parse_function_call", e.parse_function_call),
            web.post("/separate_reasoning", e.separate_reasoning),
        ]
    )
    app.middlewares.append(_bad_request_middleware)
    return app


def _tool_name_list(tools: list[Any]) -> list[str]:
    names = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        fn = fn if isinstance(fn, dict) else tool if isinstance(tool, dict) else {}
        names.append(str(fn.get("name", "")))
    return names


@web.middleware
async def _bad_request_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        return _error(400, str(exc))
    except ValueError as exc:  # e.g. an unknown parser name
        return _error(400, str(exc))


class EngineServer:
    """Runs an EngineCore's app on 127.0.0.1 in the current event loop."""

    def __init__(self, core: EngineCore, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.core = core
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        self._runner = web.AppRunner(build_app(self.core), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            self.core.cancel(abort_all=True, message="engine shutting down")
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> EngineServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
