"""SGLang `/generate` client (token in, token out): one attempt per call.

`EngineClient.generate` makes exactly one attempt and reports what the engine
said (`recorder.model.engine_wire` reads it); the turn's attempts, resumed
after aborts and moved off engines that are gone, are
`recorder.model.resume`'s; which engine a session uses is
`recorder.model.failover`'s. Text is never re-tokenized here: output tokens
and their logprobs come from the engine or the turn fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import msgspec
import numpy as np
import orjson

from recorder.model.engine_http import BadAnswer, CannotConnect, ConnectionLost, LeanPool
from recorder.model.engine_wire import (
    EngineError,
    GenerateBodies,
    GenerateOutput,
    SamplingParams,
    decode_generate_answer,
    error_message,
    json_ids,
    parse_generate_response,
)
from recorder.model.failover import DEFAULT_HEALTH_TIMEOUT_S, EnginePool

log = logging.getLogger(__name__)

# Last /generate bodies kept for their sessions' next ones (`GenerateBodies`): ~6 bytes
# per context token, so 64 MB covers ~100 sessions at 100k tokens.
DEFAULT_BODY_CACHE_BYTES = 64 << 20


class EngineClient(EnginePool):
    """HTTP client for one or more SGLang servers (one pooled aiohttp session).

    The engine choice and health bookkeeping are `EnginePool`'s (recorder.model.failover).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float = 3600,
        connect_timeout_s: float = 10,
        max_connections: int = 0,
        health_interval_s: float = 5.0,
        health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S,
        body_cache_bytes: int = DEFAULT_BODY_CACHE_BYTES,
    ) -> None:
        """`body_cache_bytes`: memory for the last `/generate` body of each session, whose
        token ids' JSON the session's next body reuses (`GenerateBodies`)."""
        super().__init__(urls, health_interval_s=health_interval_s)
        self.bodies = GenerateBodies(body_cache_bytes)
        # Background work (aborts sent to engines marked down), cancelled by close().
        self._detached: set[asyncio.Task[None]] = set()
        self._checks: asyncio.Task[None] | None = None
        self.health_timeout_s = health_timeout_s
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        # `/generate` to a plain-HTTP engine: its own keep-alive connections (engine_http).
        self._lean = LeanPool(limit=max_connections, connect_timeout_s=connect_timeout_s)

    async def start(self) -> None:
        if self._session is None:
            # No trace configs: with any, aiohttp awaits a signal at every step of
            # every request. `on_sent` rides on the request's body (`_SentBody`).
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                timeout=aiohttp.ClientTimeout(
                    total=self.timeout_s, sock_connect=self.connect_timeout_s
                ),
            )
        if self.health_interval_s > 0 and self._checks is None:
            self._checks = asyncio.create_task(self._check_forever(), name="engine-health")

    def detach(self, work: Awaitable[None]) -> asyncio.Task[None]:
        """Run `work` as a task this client keeps until it ends (close() cancels it)."""
        task = asyncio.ensure_future(work)
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)
        return task

    async def close(self) -> None:
        for task in list(self._detached):
            task.cancel()
        if self._detached:
            await asyncio.wait(self._detached)
        if self._checks is not None:
            self._checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checks
            self._checks = None
        self._lean.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> EngineClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def generate(
        self,
        url: str,
        input_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        rid: str,
        *,
        return_routed_experts: bool = False,
        on_sent: Callable[[], None] | None = None,
        cache_key: str | None = None,
    ) -> GenerateOutput:
        """One `/generate` attempt. Raises EngineError; an abort is a normal result.

        `on_sent` is called once the request body is handed to the socket: the
        engine is busy from then on, and the caller can start work that would
        otherwise compete with sending a long prompt. `cache_key` (the session):
        the body's token ids reuse the JSON of this key's previous body where
        they start with its ids (`GenerateBodies`).
        """
        body: dict[str, Any] = {
            "rid": rid,
            "input_ids": None,  # placed by GenerateBodies
            "stream": False,
            "return_logprob": True,
            "logprob_start_len": -1,
            "top_logprobs_num": 0,
            "sampling_params": params.to_sglang(),
        }
        if return_routed_experts:
            body["return_routed_experts"] = True
        ids = np.asarray(json_ids(input_ids), dtype=np.int32)
        raw = self.bodies.build(cache_key, body, ids)
        started = time.monotonic()
        status, data = await self._post_raw(url, "/generate", raw, on_sent)
        latency = time.monotonic() - started
        if status != 200:
            answer = _decoded("/generate", status, data, url)
            raise EngineError("http", error_message(answer), status=status, url=url)
        typed = decode_generate_answer(data, rid=rid, latency_s=latency, url=url)
        if typed is not None:
            return typed
        answer = _decoded("/generate", status, data, url)
        return parse_generate_response(answer, rid=rid, latency_s=latency, url=url)

    async def abort(self, url: str, rid: str) -> None:
        """Ask the engine to abort `rid` (a running request answers with its partial output)."""
        status, answer = await self._request(
            "POST", url, "/abort_request", {"rid": rid, "abort_all": False}, timeout_s=30
        )
        if status != 200:
            raise EngineError("http", error_message(answer), status=status, url=url)

    async def model_info(self, url: str) -> dict[str, Any]:
        status, answer = await self._request("GET", url, "/model_info", timeout_s=30)
        if status != 200 or not isinstance(answer, dict):
            raise EngineError("http", error_message(answer), status=status, url=url)
        return answer

    async def context_length(self, url: str) -> int | None:
        """The engine's context length from /v1/models (max_model_len) or /model_info."""
        with contextlib.suppress(EngineError):
            status, answer = await self._request("GET", url, "/v1/models", timeout_s=30)
            if status == 200 and isinstance(answer, dict):
                for model in answer.get("data") or []:
                    if isinstance(model, dict) and isinstance(model.get("max_model_len"), int):
                        return model["max_model_len"]
        with contextlib.suppress(EngineError):
            info = await self.model_info(url)
            for key in ("context_length", "max_model_len", "max_context_length"):
                if isinstance(info.get(key), int):
                    return info[key]
        return None

    async def health(self, url: str) -> bool:
        try:
            status, _ = await self._request("GET", url, "/health", timeout_s=self.health_timeout_s)
        except EngineError:
            return False
        return status == 200

    async def _post_raw(
        self, url: str, path: str, raw: bytes, on_sent: Callable[[], None] | None
    ) -> tuple[int, bytes]:
        """(status, the answer's bytes) of a POST of `raw`; over `LeanPool` when the engine
        speaks plain HTTP (~130 us less CPU a request), with `_request`'s errors."""
        origin = self._lean.origin(url)
        if origin is None:
            return await self._exchange("POST", url, path, raw=raw, on_sent=on_sent)
        if self._session is None:
            raise RuntimeError("EngineClient.start() was not called")
        try:
            async with asyncio.timeout(self.timeout_s or None):
                status, data = await self._lean.post(origin, path, raw, on_sent=on_sent)
        except TimeoutError as exc:
            raise EngineError("timeout", f"POST {path} timed out", url=url) from exc
        except CannotConnect as exc:
            self.mark(url, False)  # refused: the next turn goes elsewhere, before any check
            raise EngineError("unreachable", f"cannot connect: {exc}", url=url) from exc
        except ConnectionLost as exc:
            raise EngineError(
                "unreachable", f"connection lost: {exc}", url=url, may_be_running=True
            ) from exc
        except BadAnswer as exc:
            raise EngineError("protocol", f"BadAnswer: {exc}", url=url) from exc
        return status, data

    async def _request(
        self,
        method: str,
        url: str,
        path: str,
        body: Any = None,
        *,
        timeout_s: float | None = None,
        on_sent: Callable[[], None] | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, Any]:
        """(status, decoded JSON answer); the body is `body` as JSON, or `raw` JSON bytes."""
        if body is not None:
            raw = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        status, data = await self._exchange(
            method, url, path, timeout_s=timeout_s, on_sent=on_sent, raw=raw
        )
        return status, _decoded(path, status, data, url)

    async def _exchange(
        self,
        method: str,
        url: str,
        path: str,
        *,
        timeout_s: float | None = None,
        on_sent: Callable[[], None] | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, bytes]:
        """(status, the answer's bytes) over aiohttp; the body is `raw` JSON bytes."""
        if self._session is None:
            raise RuntimeError("EngineClient.start() was not called")
        target = url.rstrip("/") + path
        timeout = (
            aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
            if timeout_s is not None
            else None
        )
        kwargs: dict[str, Any] = {"timeout": timeout} if timeout else {}
        if raw is not None:
            kwargs["data"] = raw if on_sent is None else _SentBody(raw, on_sent)
            kwargs["headers"] = _JSON_HEADERS
        try:
            async with self._session.request(method, target, **kwargs) as resp:
                data = await resp.read()
                status = resp.status
        except TimeoutError as exc:
            raise EngineError("timeout", f"{method} {path} timed out", url=url) from exc
        except aiohttp.ClientConnectorError as exc:
            self.mark(url, False)  # refused: the next turn goes elsewhere, before any check
            raise EngineError("unreachable", f"cannot connect: {exc}", url=url) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise EngineError(
                "unreachable", f"connection lost: {exc}", url=url, may_be_running=True
            ) from exc
        except aiohttp.ClientError as exc:
            raise EngineError("protocol", f"{type(exc).__name__}: {exc}", url=url) from exc
        return status, data


def _decoded(path: str, status: int, raw: bytes, url: str) -> Any:
    """The answer's JSON; a non-JSON error answer as text (non-JSON with 200: EngineError)."""
    try:
        return msgspec.json.decode(raw) if raw else None
    except msgspec.DecodeError:
        if status == 200:
            raise EngineError(
                "protocol", f"{path} answered non-JSON: {raw[:200]!r}", url=url
            ) from None
        return raw.decode(errors="replace")


_JSON_HEADERS = {"Content-Type": "application/json"}


class _SentBody(aiohttp.BytesPayload):
    """A request body that calls `on_sent` once, when it has been handed to the socket."""

    def __init__(self, raw: bytes, on_sent: Callable[[], None]) -> None:
        super().__init__(raw, content_type=_JSON_HEADERS["Content-Type"])
        self._on_sent: Callable[[], None] | None = on_sent

    async def write(self, writer: Any) -> None:
        await super().write(writer)
        self._sent()

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        await super().write_with_length(writer, content_length)
        self._sent()

    def _sent(self) -> None:
        callback, self._on_sent = self._on_sent, None
        if callback is not None:
            callback()
