"""SGLang's `/generate` contract: sampling settings out, one attempt's answer in (pure).

What the engine client sends (`SamplingParams.to_sglang`) and how its answer
is read (`parse_generate_response`): exactly the output tokens and one
logprob each, or an error that says what was wrong. No I/O here.
"""

from __future__ import annotations

import base64
import os
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any, Literal

import msgspec
import numpy as np
import orjson
import xxhash

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


class _Meta(msgspec.Struct):
    """The `meta_info` fields a GenerateOutput takes, typed as SGLang sends them."""

    finish_reason: Any = None
    output_token_logprobs: list[tuple[float | None, int, Any]] | None = None
    weight_version: Any = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    routed_experts: Any = None


class _Answer(msgspec.Struct):
    output_ids: list[int]
    meta_info: _Meta
    error: Any = msgspec.UNSET  # any `error` at all: the untyped reading raises it


_ANSWER = msgspec.json.Decoder(_Answer)


def decode_generate_answer(
    raw: bytes, *, rid: str, latency_s: float, url: str = ""
) -> GenerateOutput | None:
    """`/generate`'s usual answer straight from its bytes into a GenerateOutput; None for
    any other shape (`parse_generate_response` then reads it and says what is wrong).

    Decoding into types checks every id and logprob in C: a thinking model's answer
    runs to thousands of tokens, each a list of three in the untyped JSON."""
    try:
        answer = _ANSWER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    if answer.error is not msgspec.UNSET:
        return None
    meta, ids = answer.meta_info, answer.output_ids
    triples = meta.output_token_logprobs
    logprobs: list[float] | None = []
    if ids:
        if triples is None or len(triples) < len(ids):
            logprobs = None
        else:
            if len(triples) > len(ids):
                triples = triples[: len(ids)]
            if [t[1] for t in triples] != ids:
                return None  # the untyped reading names the first wrong id
            values = [t[0] for t in triples]
            logprobs = None if None in values else values  # type: ignore[assignment]
    reason, detail = _finish(meta.finish_reason)
    return GenerateOutput(
        output_ids=ids,
        logprobs=logprobs,
        finish_reason=reason,
        finish_detail=detail,
        weight_version=str(meta.weight_version or ""),
        prompt_tokens=int(meta.prompt_tokens or 0),
        cached_tokens=int(meta.cached_tokens or 0),
        routed_experts=_routed_experts(meta.routed_experts, url),
        latency_s=latency_s,
    )


def parse_generate_response(
    body: Any, *, rid: str, latency_s: float, url: str = ""
) -> GenerateOutput:
    """Turn SGLang's `/generate` JSON into a GenerateOutput (raises EngineError(protocol))."""
    if isinstance(body, list) and len(body) == 1:
        body = body[0]
    if not isinstance(body, dict):
        raise EngineError("protocol", f"expected a JSON object, got {type(body).__name__}", url=url)
    if "error" in body:
        raise EngineError("http", error_message(body), url=url)
    meta = body.get("meta_info")
    ids = body.get("output_ids")
    if not isinstance(meta, dict) or not isinstance(ids, list):
        raise EngineError(
            "protocol", "response lacks output_ids/meta_info (is this SGLang /generate?)", url=url
        )
    if not all(map(isinstance, ids, repeat(int))):
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
    """Logprob triples `[logprob, token_id, text]`, one per output id, or None.

    A thinking model answers with thousands of tokens a turn, so the usual
    answer (well-formed triples, the same ids, float logprobs) is read with
    comprehensions and compared whole; anything else takes `_checked_logprobs`,
    which finds the first bad entry and decides as before.
    """
    if not ids:
        return []
    if not isinstance(raw, list) or len(raw) < len(ids):
        return None
    triples = raw if len(raw) == len(ids) else raw[: len(ids)]
    if all(map(isinstance, triples, repeat(list))):
        try:
            tokens = [t[1] for t in triples]
        except IndexError:
            tokens = None
        if tokens == ids:
            values = [t[0] for t in triples]
            if all(map(isinstance, values, repeat(float))):
                return values
    return _checked_logprobs(raw, ids, url)


def _checked_logprobs(raw: list[Any], ids: list[int], url: str) -> list[float] | None:
    """`_logprobs` entry by entry: the first malformed entry, None or other id decides."""
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


def json_ids(ids: Sequence[int] | np.ndarray) -> list[int] | np.ndarray:
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


def resumed_prompt(prompt: list[int] | np.ndarray, output: list[int]) -> list[int] | np.ndarray:
    """The prompt of a resumed attempt: the turn's input + its partial output so far."""
    if not output:
        return prompt
    if isinstance(prompt, list):
        return prompt + output
    return np.concatenate([prompt, np.asarray(output, dtype=np.int32)])


def error_message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(body)


# --------------------------------------------------------------------------
# /generate bodies, with the JSON of a session's token prefix kept (pure)
# --------------------------------------------------------------------------

_IDS_KEY = b'"input_ids":'
# A kept body unused this long may make room for a session that has none
# (`GenerateBodies`): longer than an agent's usual gap between turns (tools run).
BODY_IDLE_S = 120.0


class _SentIds(msgspec.Struct):
    """The last body sent for a key, and where its `input_ids` JSON array lies in it."""

    body: bytes
    start: int  # offset of the array's "["
    end: int  # offset just past its "]"
    n: int  # how many ids it holds
    digest: bytes  # keyed xxh3-128 of those ids as int32
    used_at: float  # when it was kept (the session's last turn), on the cache's clock


class GenerateBodies:
    """Builds `/generate` bodies, reusing the JSON of the ids the previous body of the
    same session began with.

    A chain's input is its previous input + output + the new messages' tokens,
    so all but a few hundred of a 100k-token input were encoded last turn:
    encoding them again is ~0.6 ms of CPU per 100k tokens every turn. The
    previous body's array is reused when the new input starts with exactly its
    ids (a keyed 128-bit hash of them, ~10 us per 100k; the seed is random per
    process and never leaves it, so no client can aim at a collision); a fork,
    a reset or a retry of a shorter input is encoded whole. Every body is byte
    for byte `orjson.dumps` of the same dict.

    Bodies are kept per key (the session) up to `budget_bytes` in all (0:
    nothing kept). When the budget is reached, a session that had a body kept
    keeps it (the least recently used bodies make room), but a session that
    had none only takes the room of a body unused for `idle_s`: sessions take
    turns in rotation, and with more of them than the budget holds, plain LRU
    drops each body just before its session comes back (no turn would ever
    find its body). This way the sessions that fit keep theirs; a session
    that went away without `forget` gives its room up after `idle_s`.
    """

    def __init__(
        self,
        budget_bytes: int,
        *,
        idle_s: float = BODY_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.held_bytes = 0
        self.idle_s = idle_s
        self._clock = clock
        self._sent: OrderedDict[str, _SentIds] = OrderedDict()
        self._seed = int.from_bytes(os.urandom(8), "little")

    def __len__(self) -> int:
        return len(self._sent)

    def __contains__(self, key: str) -> bool:
        return key in self._sent

    def build(self, key: str | None, fields: dict[str, Any], ids: np.ndarray) -> bytes:
        """`orjson.dumps(fields)` with `fields["input_ids"]` = `ids` (int32), kept for `key`.

        `fields` must hold `"input_ids"` (any placeholder value): its position
        is the array's position in the body.
        """
        before, after = _split_fields(fields)
        head = before + _IDS_KEY
        previous = self._take(key)
        array = self._array(previous, ids)
        body = b"".join((head, *array, after))
        if key is not None:
            end = len(body) - len(after)
            entry = _SentIds(body, len(head), end, len(ids), self._hash(ids), self._clock())
            self._keep(key, entry, had_one=previous is not None)
        return body

    def forget(self, key: str) -> None:
        entry = self._sent.pop(key, None)
        if entry is not None:
            self.held_bytes -= len(entry.body)

    def _array(self, previous: _SentIds | None, ids: np.ndarray) -> tuple[bytes | memoryview, ...]:
        """The JSON array of `ids`, as pieces (the previous body's array reused when it fits)."""
        n = len(ids)
        if previous is None or previous.n == 0 or previous.n > n:
            return (orjson.dumps(ids, option=orjson.OPT_SERIALIZE_NUMPY),)
        if self._hash(ids[: previous.n]) != previous.digest:
            return (orjson.dumps(ids, option=orjson.OPT_SERIALIZE_NUMPY),)
        known = memoryview(previous.body)[previous.start : previous.end - 1]  # without "]"
        if previous.n == n:
            return (known, b"]")
        tail = orjson.dumps(ids[previous.n :], option=orjson.OPT_SERIALIZE_NUMPY)
        return (known, b",", memoryview(tail)[1:])  # the tail's "[" dropped

    def _hash(self, ids: np.ndarray) -> bytes:
        return xxhash.xxh3_128_digest(np.ascontiguousarray(ids, dtype=np.int32), seed=self._seed)

    def _take(self, key: str | None) -> _SentIds | None:
        if key is None:
            return None
        entry = self._sent.pop(key, None)
        if entry is not None:
            self.held_bytes -= len(entry.body)
        return entry

    def _keep(self, key: str, entry: _SentIds, *, had_one: bool) -> None:
        size = len(entry.body)
        if size > self.budget_bytes:
            return
        while self.held_bytes + size > self.budget_bytes:
            oldest = next(iter(self._sent.values()))
            if not had_one and entry.used_at - oldest.used_at < self.idle_s:
                return  # every kept body is in use: a newcomer does not push one out
            _, dropped = self._sent.popitem(last=False)
            self.held_bytes -= len(dropped.body)
        self._sent[key] = entry
        self.held_bytes += size


def _split_fields(fields: dict[str, Any]) -> tuple[bytes, bytes]:
    """(JSON of `fields` up to and including the "," before "input_ids", the rest after
    its value), so that before + `"input_ids":` + array + rest is the whole object."""
    keys = list(fields)
    at = keys.index("input_ids")
    head = {k: fields[k] for k in keys[:at]}
    rest = {k: fields[k] for k in keys[at + 1 :]}
    before = orjson.dumps(head)[:-1] + (b"," if head else b"")
    after = (b"," + orjson.dumps(rest)[1:]) if rest else b"}"
    return before, after
