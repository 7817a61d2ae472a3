"""SGLang `/generate` client (token in, token out) and the abort/resume driver.

`EngineClient.generate` makes exactly one attempt and reports what the engine
said; `generate_with_resume` turns engine aborts (weight updates pause the
engine with mode "abort") into re-submissions of prompt + partial output and
stitches the pieces, calling back before and after every attempt so the
caller can record each one as an event. With several engines it also moves
a turn whose engine is gone (a refused connection, a dropped one and a failing
health check, or a failing health check while the engine holds the request)
to a live one, each engine at most once per turn: the failed
attempt has no output, so the stitched tokens are exactly the answered
attempts'. Text is never re-tokenized here: output tokens and their logprobs
come from the engine or the turn fails.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import time
import uuid
from array import array
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, Literal

import aiohttp
import msgspec
import numpy as np
import orjson

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "abort", "unknown"]
ErrorKind = Literal["unreachable", "http", "timeout", "protocol"]


# Sampling fields sent to SGLang only when they differ from their neutral value.
_NEUTRAL_PENALTIES = (
    ("min_p", 0.0),
    ("repetition_penalty", 1.0),
    ("frequency_penalty", 0.0),
    ("presence_penalty", 0.0),
)


class SamplingParams(msgspec.Struct, frozen=True):
    """Sampling settings; only keys SGLang knows (0.5.23 rejects unknown ones)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Trainer-forced settings (a session's `config.sampling`); sent only when set.
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # A JSON schema (as JSON text) the output must follow: SGLang's constrained decoding.
    json_schema: str | None = None

    def to_sglang(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            # Output must be the exact tokens: no trimming, no special-token games.
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "no_stop_trim": True,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.json_schema is not None:
            params["json_schema"] = self.json_schema
        for name, neutral in _NEUTRAL_PENALTIES:
            if (value := getattr(self, name)) != neutral:
                params[name] = value
        return params

    def with_max_new_tokens(self, n: int) -> SamplingParams:
        return msgspec.structs.replace(self, max_new_tokens=n)


class GenerateOutput(msgspec.Struct):
    """One `/generate` attempt's answer. `logprobs` is None when the engine sent
    none (or fewer than one per output token)."""

    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: FinishReason
    finish_detail: str
    weight_version: str
    prompt_tokens: int
    cached_tokens: int
    routed_experts: bytes | None
    latency_s: float


class EngineError(Exception):
    """The engine could not be reached or answered badly."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        status: int = 0,
        url: str = "",
        may_be_running: bool = False,
    ) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.status = status
        self.url = url
        self.message = message
        # The request reached the engine and may still be generating (the
        # connection dropped mid-request): its rid should be aborted.
        self.may_be_running = may_be_running

    def __str__(self) -> str:
        where = f" ({self.url})" if self.url else ""
        status = f" HTTP {self.status}" if self.status else ""
        return f"engine {self.kind}{status}{where}: {self.message}"


class MissingLogprobs(Exception):
    """The engine returned output tokens without one logprob each.

    The turn must fail: re-tokenizing the text would give tokens without
    logprobs (seed 003). Start SGLang so it returns logprobs
    (`return_logprob` must reach it) and check its version.
    """

    def __init__(self, rid: str, output_tokens: int) -> None:
        super().__init__(
            f"engine returned {output_tokens} output tokens without a logprob for each (rid "
            f"{rid}); the turn is aborted, its text is never re-tokenized"
        )
        self.rid = rid
        self.output_tokens = output_tokens


def new_rid() -> str:
    """A request id of fixed length (32 hex): SGLang aborts by rid prefix, so
    no rid may be a prefix of another."""
    return uuid.uuid4().hex


# --------------------------------------------------------------------------
# Parsing the engine's answer (pure)
# --------------------------------------------------------------------------


def parse_generate_response(
    body: Any, *, rid: str, latency_s: float, url: str = ""
) -> GenerateOutput:
    """Turn SGLang's `/generate` JSON into a GenerateOutput (raises EngineError(protocol))."""
    if isinstance(body, list) and len(body) == 1:
        body = body[0]
    if not isinstance(body, dict):
        raise EngineError("protocol", f"expected a JSON object, got {type(body).__name__}", url=url)
    if "error" in body:
        raise EngineError("http", _error_message(body), url=url)
    meta = body.get("meta_info")
    ids = body.get("output_ids")
    if not isinstance(meta, dict) or not isinstance(ids, list):
        raise EngineError(
            "protocol", "response lacks output_ids/meta_info (is this SGLang /generate?)", url=url
        )
    if not all(isinstance(i, int) for i in ids):
        raise EngineError("protocol", "output_ids must be integers", url=url)
    reason, detail = _finish(meta.get("finish_reason"))
    return GenerateOutput(
        output_ids=ids,
        logprobs=_logprobs(meta.get("output_token_logprobs"), ids, url),
        finish_reason=reason,
        finish_detail=detail,
        weight_version=str(meta.get("weight_version") or ""),
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        routed_experts=_routed_experts(meta.get("routed_experts"), url),
        latency_s=latency_s,
    )


def _finish(raw: Any) -> tuple[FinishReason, str]:
    if isinstance(raw, str):
        raw = {"type": raw}
    if not isinstance(raw, dict):
        return "unknown", ""
    kind = raw.get("type")
    if kind == "stop":
        matched = raw.get("matched")
        return "stop", "" if matched is None else str(matched)
    if kind == "length":
        return "length", str(raw.get("length", ""))
    if kind == "abort":
        return "abort", str(raw.get("message") or "")
    return "unknown", str(kind)


def _logprobs(raw: Any, ids: list[int], url: str) -> list[float] | None:
    """Logprob triples `[logprob, token_id, text]`, one per output id, or None."""
    if not ids:
        return []
    if not isinstance(raw, list) or len(raw) < len(ids):
        return None
    out: list[float] = []
    for i, (entry, token) in enumerate(zip(raw, ids, strict=False)):
        if not isinstance(entry, list | tuple) or len(entry) < 2:
            raise EngineError("protocol", f"output_token_logprobs[{i}] is not a triple", url=url)
        logprob, token_id = entry[0], entry[1]
        if logprob is None:
            return None
        if token_id != token:
            raise EngineError(
                "protocol",
                f"output_token_logprobs[{i}] is for token {token_id}, output_ids has {token}",
                url=url,
            )
        out.append(float(logprob))
    return out


def _routed_experts(raw: Any, url: str) -> bytes | None:
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise EngineError("protocol", "routed_experts must be a base64 string", url=url)
    try:
        return base64.b64decode(raw)
    except ValueError as exc:
        raise EngineError("protocol", f"routed_experts is not base64: {exc}", url=url) from exc


def _json_ids(ids: Sequence[int] | np.ndarray) -> list[int] | np.ndarray:
    """Token ids in a form orjson serializes at C speed, without copying them.

    Plans hold int32 `array`s (viewed as numpy here); lists pass through.
    Converting a 100k-token prompt between the two every turn would make the
    per-turn cost grow with the context.
    """
    if type(ids) is list:
        return ids
    if isinstance(ids, array) and ids.typecode == "i":
        return np.frombuffer(ids, dtype=np.int32) if len(ids) else np.zeros(0, np.int32)
    return np.asarray(ids, dtype=np.int32)


def _resumed(prompt: list[int] | np.ndarray, output: list[int]) -> list[int] | np.ndarray:
    """The prompt of a resumed attempt: the turn's input + its partial output so far."""
    if not output:
        return prompt
    if isinstance(prompt, list):
        return prompt + output
    return np.concatenate([prompt, np.asarray(output, dtype=np.int32)])


def _error_message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(body)


# --------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------


class EngineClient:
    """HTTP client for one or more SGLang servers (one pooled aiohttp session)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float = 3600,
        connect_timeout_s: float = 10,
        max_connections: int = 0,
        health_interval_s: float = 5.0,
        health_timeout_s: float = 10.0,
    ) -> None:
        if not urls:
            raise ValueError("EngineClient needs at least one engine URL")
        self.urls: tuple[str, ...] = tuple(u.rstrip("/") for u in urls)
        # Engines that failed a health check or a connection; `pick` avoids them until a
        # check passes again. With one engine there is nowhere to move: no checks.
        self.down: set[str] = set()
        # Per live engine watched by an attempt: set when it is marked down, so an
        # attempt in flight there stops waiting (a dead node may never reset the
        # connection). Present and set iff the engine is down.
        self._went_down: dict[str, asyncio.Event] = {}
        # Background work (aborts sent to engines marked down), cancelled by close().
        self._detached: set[asyncio.Task[None]] = set()
        self.health_interval_s = health_interval_s if len(self.urls) > 1 else 0.0
        self._checks: asyncio.Task[None] | None = None
        self.health_timeout_s = health_timeout_s
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        if self._session is None:
            sent = aiohttp.TraceConfig()
            sent.on_request_chunk_sent.append(_notify_sent)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                timeout=aiohttp.ClientTimeout(
                    total=self.timeout_s, sock_connect=self.connect_timeout_s
                ),
                trace_configs=[sent],
            )
        if self.health_interval_s > 0 and self._checks is None:
            self._checks = asyncio.create_task(self._check_forever(), name="engine-health")

    async def _check_forever(self) -> None:
        """Until closed, or until `health_interval_s` is set to 0."""
        while self.health_interval_s > 0:
            await self.check_engines()
            await asyncio.sleep(self.health_interval_s)

    async def check_engines(self) -> None:
        """GET /health of every engine; mark each live or down."""
        results = await asyncio.gather(*(self.health(url) for url in self.urls))
        for url, ok in zip(self.urls, results, strict=True):
            self.mark(url, ok)

    def mark(self, url: str, live: bool) -> None:
        if live and url in self.down:
            log.warning("engine %s is back", url)
            self.down.discard(url)
            self._went_down.pop(url, None)
        elif not live and url not in self.down:
            log.warning("engine %s is down: its sessions move to live engines", url)
            self.down.add(url)
            self._went_down.setdefault(url, asyncio.Event()).set()

    def live(self, url: str) -> bool:
        return url not in self.down

    def went_down(self, url: str) -> asyncio.Event:
        """An event set once `url` is marked down (already set while it is down)."""
        event = self._went_down.get(url)
        if event is None:
            event = self._went_down[url] = asyncio.Event()
            if url in self.down:
                event.set()
        return event

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
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> EngineClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def pick(self, session_id: str) -> str:
        """Stable engine choice per session (rendezvous hashing: adding an
        engine moves only the sessions that now prefer it). Engines marked down are
        skipped while another is live."""
        live = [u for u in self.urls if u not in self.down] or self.urls
        return _rendezvous(session_id, live)

    async def gone(self, url: str, exc: EngineError) -> bool:
        """Does `exc` say the engine at `url` is gone, not merely slow or failing?

        A refused connection does (`_request` marked the engine down); a dropped one
        does when the engine's `/health` fails too (its process died). A timeout or
        an HTTP error does not: the engine is there, and another would not help.
        """
        if exc.kind != "unreachable":
            return False
        if not self.live(url):
            return True
        if await self.health(url):
            return False
        self.mark(url, False)
        return True

    async def replacement(
        self, session_id: str, url: str, exc: EngineError, tried: Collection[str]
    ) -> str | None:
        """The engine a turn moves to after its attempt on `url` failed with `exc`.

        None when the engine is not gone, or when every live engine was already
        tried by this turn (the bound: each engine at most once per turn).
        """
        left = [u for u in self.urls if u not in self.down and u not in tried and u != url]
        if not left or not await self.gone(url, exc):
            return None
        return _rendezvous(session_id, left)

    async def generate(
        self,
        url: str,
        input_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        rid: str,
        *,
        return_routed_experts: bool = False,
        on_sent: Callable[[], None] | None = None,
    ) -> GenerateOutput:
        """One `/generate` attempt. Raises EngineError; an abort is a normal result.

        `on_sent` is called once the request body is handed to the socket: the
        engine is busy from then on, and the caller can start work that would
        otherwise compete with sending a long prompt.
        """
        body: dict[str, Any] = {
            "rid": rid,
            "input_ids": _json_ids(input_ids),
            "stream": False,
            "return_logprob": True,
            "logprob_start_len": -1,
            "top_logprobs_num": 0,
            "sampling_params": params.to_sglang(),
        }
        if return_routed_experts:
            body["return_routed_experts"] = True
        started = time.monotonic()
        status, answer = await self._request("POST", url, "/generate", body, on_sent=on_sent)
        latency = time.monotonic() - started
        if status != 200:
            raise EngineError("http", _error_message(answer), status=status, url=url)
        return parse_generate_response(answer, rid=rid, latency_s=latency, url=url)

    async def abort(self, url: str, rid: str) -> None:
        """Ask the engine to abort `rid` (a running request answers with its partial output)."""
        status, answer = await self._request(
            "POST", url, "/abort_request", {"rid": rid, "abort_all": False}, timeout_s=30
        )
        if status != 200:
            raise EngineError("http", _error_message(answer), status=status, url=url)

    async def model_info(self, url: str) -> dict[str, Any]:
        status, answer = await self._request("GET", url, "/model_info", timeout_s=30)
        if status != 200 or not isinstance(answer, dict):
            raise EngineError("http", _error_message(answer), status=status, url=url)
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

    async def _request(
        self,
        method: str,
        url: str,
        path: str,
        body: Any = None,
        *,
        timeout_s: float | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> tuple[int, Any]:
        if self._session is None:
            raise RuntimeError("EngineClient.start() was not called")
        target = url.rstrip("/") + path
        timeout = (
            aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
            if timeout_s is not None
            else None
        )
        kwargs: dict[str, Any] = {"timeout": timeout} if timeout else {}
        if on_sent is not None:
            kwargs["trace_request_ctx"] = _SentSignal(on_sent)
        if body is not None:
            kwargs["data"] = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
            kwargs["headers"] = {"Content-Type": "application/json"}
        try:
            async with self._session.request(method, target, **kwargs) as resp:
                raw = await resp.read()
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
        try:
            answer = msgspec.json.decode(raw) if raw else None
        except msgspec.DecodeError:
            if status == 200:
                raise EngineError(
                    "protocol", f"{path} answered non-JSON: {raw[:200]!r}", url=url
                ) from None
            answer = raw.decode(errors="replace")
        return status, answer


def _rendezvous(session_id: str, urls: Sequence[str]) -> str:
    """The engine `session_id` prefers among `urls` (highest hash of the pair)."""
    return max(
        urls, key=lambda u: hashlib.blake2b(f"{session_id}\x00{u}".encode(), digest_size=8).digest()
    )


class _SentSignal:
    """A request's `on_sent` callback, fired once (see `_notify_sent`)."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback: Callable[[], None] | None = callback

    def fire(self) -> None:
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


async def _notify_sent(
    _session: aiohttp.ClientSession,
    context: Any,
    _params: aiohttp.TraceRequestChunkSentParams,
) -> None:
    """aiohttp trace hook: a request body chunk was written (bytes bodies are one chunk)."""
    signal = context.trace_request_ctx
    if isinstance(signal, _SentSignal):
        signal.fire()


# --------------------------------------------------------------------------
# Abort / resume driver
# --------------------------------------------------------------------------


class Attempt(msgspec.Struct):
    """One `/generate` call of a turn, sent to the engine at `url`.
    `resumed_tokens` partial-output tokens were appended to the turn's input
    for this attempt."""

    attempt: int
    rid: str
    resumed_tokens: int
    max_new_tokens: int
    url: str = ""


class TurnOutput(msgspec.Struct):
    """A turn's stitched output.

    `finish_reason == "abort"` means the resume budget (attempts or time)
    ran out: the output is partial and the turn should be failed.
    """

    output_ids: list[int]
    logprobs: list[float]
    weight_versions: list[str]
    finish_reason: FinishReason
    finish_detail: str
    attempts: list[Attempt]
    results: list[GenerateOutput]

    @property
    def prompt_tokens(self) -> int:
        return self.results[0].prompt_tokens if self.results else 0

    @property
    def cached_tokens(self) -> int:
        return self.results[0].cached_tokens if self.results else 0


async def generate_with_resume(
    client: EngineClient,
    url: str,
    input_ids: Sequence[int] | np.ndarray,
    params: SamplingParams,
    *,
    max_attempts: int = 8,
    budget_s: float = 3600,
    on_attempt: Callable[[Attempt], Awaitable[None]],
    on_result: Callable[[Attempt, GenerateOutput], Awaitable[None]],
    on_sent: Callable[[], None] | None = None,
    return_routed_experts: bool = False,
    session_id: str | None = None,
    on_moved: Callable[[Attempt, EngineError, str], Awaitable[None]] | None = None,
) -> TurnOutput:
    """Generate one turn, resuming after engine aborts.

    Each attempt sends `input_ids` + all output so far with `max_new_tokens`
    reduced by what was already generated. Raises MissingLogprobs (after
    `on_result` saw the offending output), EngineError, or CancelledError
    (after asking the engine to abort the in-flight rid). `on_sent` is called
    each time an attempt's request has been sent (see `EngineClient.generate`).

    With `session_id`, an attempt whose engine is gone goes on as the next
    attempt on the live engine `EngineClient.replacement` names, after
    `on_moved(failed attempt, its error, new url)`; every engine is tried at
    most once per turn. `max_attempts` counts the attempts an engine answered.
    """
    prompt = _json_ids(input_ids)
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[str] = []
    attempts: list[Attempt] = []
    results: list[GenerateOutput] = []
    tried = {url}
    deadline = time.monotonic() + budget_s
    finish: FinishReason = "abort"
    detail = f"resume budget exhausted ({max_attempts} attempts, {budget_s:g}s)"
    while len(results) < max_attempts:
        remaining = params.max_new_tokens - len(ids)
        if remaining <= 0:
            finish, detail = "length", str(params.max_new_tokens)
            break
        time_left = deadline - time.monotonic()
        if time_left <= 0:
            break
        attempt = Attempt(
            attempt=len(attempts),
            rid=new_rid(),
            resumed_tokens=len(ids),
            max_new_tokens=remaining,
            url=url,
        )
        attempts.append(attempt)
        await on_attempt(attempt)
        try:
            out = await _one_attempt(
                client,
                url,
                _resumed(prompt, ids),
                params.with_max_new_tokens(remaining),
                attempt.rid,
                time_left,
                return_routed_experts,
                on_sent,
            )
        except EngineError as exc:
            moved = None
            if session_id is not None:
                moved = await client.replacement(session_id, url, exc, tried)
            if moved is None:
                raise
            if on_moved is not None:
                await on_moved(attempt, exc, moved)
            tried.add(moved)
            url = moved
            continue
        results.append(out)
        await on_result(attempt, out)
        if out.logprobs is None:
            raise MissingLogprobs(attempt.rid, len(out.output_ids))
        ids += out.output_ids
        logprobs += out.logprobs
        versions += [out.weight_version] * len(out.output_ids)
        if out.finish_reason != "abort":
            finish, detail = out.finish_reason, out.finish_detail
            break
    return TurnOutput(
        output_ids=ids,
        logprobs=logprobs,
        weight_versions=versions,
        finish_reason=finish,
        finish_detail=detail,
        attempts=attempts,
        results=results,
    )


async def _one_attempt(
    client: EngineClient,
    url: str,
    input_ids: list[int] | np.ndarray,
    params: SamplingParams,
    rid: str,
    time_left: float,
    return_routed_experts: bool,
    on_sent: Callable[[], None] | None,
) -> GenerateOutput:
    try:
        async with asyncio.timeout(time_left):
            return await _while_live(
                client,
                url,
                client.generate(
                    url,
                    input_ids,
                    params,
                    rid,
                    return_routed_experts=return_routed_experts,
                    on_sent=on_sent,
                ),
            )
    except asyncio.CancelledError:
        # The caller went away (client disconnect): free the engine's slot.
        await _abort(client, url, rid)
        raise
    except TimeoutError as exc:
        await _abort(client, url, rid)
        raise EngineError("timeout", f"turn time budget ran out (rid {rid})", url=url) from exc
    except EngineError as exc:
        if exc.kind == "timeout" or exc.may_be_running:
            await _abort(client, url, rid)
        raise


async def _while_live(
    client: EngineClient, url: str, request: Awaitable[GenerateOutput]
) -> GenerateOutput:
    """`request`, given up when `url` is marked down meanwhile (its health check failed).

    An engine whose node died may never reset the connection: without this the
    attempt would wait for the turn budget. Not watched when `url` is down already
    (the only engine left, or all down): nothing would be better.
    """
    if not client.live(url):
        return await request
    down = asyncio.ensure_future(client.went_down(url).wait())
    answer = asyncio.ensure_future(request)
    try:
        await asyncio.wait({answer, down}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        answer.cancel()
        raise
    finally:
        down.cancel()
    if answer.done():
        return answer.result()
    answer.cancel()
    await asyncio.wait({answer})
    raise EngineError(
        "unreachable", "failed its health check while generating", url=url, may_be_running=True
    )


async def _abort(client: EngineClient, url: str, rid: str) -> None:
    """Ask the engine to drop `rid`, not cut short by a cancel; for an engine marked
    down without waiting (a dead node may not answer for the whole request timeout)."""
    abort = client.detach(_abort_quietly(client, url, rid))
    if client.live(url):
        await asyncio.shield(abort)


async def _abort_quietly(client: EngineClient, url: str, rid: str) -> None:
    try:
        await client.abort(url, rid)
    except (EngineError, RuntimeError) as exc:
        log.warning("could not abort rid %s on %s: %s", rid, url, exc)
