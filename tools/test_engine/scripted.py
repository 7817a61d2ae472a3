"""Scripted backend: deterministic replies from a script, token by token.

Each `/generate` takes the first queued `Reply` whose `match` occurs in the
decoded prompt (or that has no `match`); when none fits, a default reply is
derived from a hash of the prompt. Replies are tokenized with the engine's
tokenizer (plus EOS) or given as ids. Logprobs are a hash of (position,
token) unless scripted, so a resumed request gets the same logprobs a
single uninterrupted one would have. An aborted request's unsent tokens are
kept: a later request whose input is the aborted prompt + its partial output
continues the same reply (what resume-after-abort expects of a real model).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from recorder.model.tokenizer import Tokenizer

from .core import EngineCore, EngineServer, Fault, GenRequest

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
]


class Reply(msgspec.Struct, kw_only=True):
    """One scripted answer. Give `text` (tokenized, EOS appended when `eos`) or `ids`."""

    text: str | None = None
    ids: list[int] | None = None
    logprobs: list[float] | None = None
    eos: bool = True
    match: str | None = None
    token_delay_s: float | None = None


class Script(msgspec.Struct, kw_only=True):
    """A script file: replies, faults, and the default rule's length."""

    replies: list[Reply | str] = []
    faults: list[Fault] = []
    default_words: int = 12


_FLOAT32 = struct.Struct("<f")


def hashed_logprob(position: int, token: int) -> float:
    """A deterministic logprob in (-5, 0) for `token` at absolute `position`.

    A float32 value, as SGLang's are: it takes `log_softmax` of float32 logits
    (`sglang/srt/layers/logits_processor.py`) and sends the tensor's `tolist()`,
    doubles that are exactly float32s. (Rounded decimals, as this engine sent
    before, are doubles no engine sends: they made the log store logprobs at
    twice the bytes real ones take.)
    """
    h = hashlib.blake2b(f"{position}:{token}".encode(), digest_size=4).digest()
    value = -(int.from_bytes(h, "little") % 5000 + 1) / 1000.0
    return _FLOAT32.unpack(_FLOAT32.pack(value))[0]


def default_reply_text(prompt_ids: list[int], words: int) -> str:
    digest = hashlib.blake2b(repr(prompt_ids).encode(), digest_size=32).digest()
    picked = [WORDS[b % len(WORDS)] for b in digest[:words]]
    return "Scripted reply: " + " ".join(picked) + "."


class _Plan:
    """The tokens one reply will emit, from `start` (absolute position of the first)."""

    def __init__(self, ids: list[int], logprobs: list[float], delay: float) -> None:
        self.ids = ids
        self.logprobs = logprobs
        self.token_delay_s = delay


class _Source:
    def __init__(self, backend: ScriptedBackend, req: GenRequest, plan: _Plan) -> None:
        self._backend = backend
        self._req = req
        self._plan = plan
        self._pos = 0
        self.token_delay_s = plan.token_delay_s

    async def next_token(self) -> tuple[int, float] | None:
        if self._pos >= len(self._plan.ids):
            return None
        i = self._pos
        self._pos += 1
        return self._plan.ids[i], self._plan.logprobs[i]

    def finished(self, output_ids: list[int], finish_type: str) -> None:
        rest = _Plan(
            self._plan.ids[self._pos :], self._plan.logprobs[self._pos :], self._plan.token_delay_s
        )
        if finish_type == "abort" and rest.ids:
            self._backend.remember([*self._req.input_ids, *output_ids], rest)


class ScriptedBackend:
    model_path = "scripted"

    def __init__(
        self,
        tokenizer: Tokenizer,
        replies: list[Reply | str] | None = None,
        *,
        token_delay_s: float = 0.0,
        default_words: int = 12,
        default_reply: Callable[[GenRequest], Reply] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.replies: list[Reply] = [_as_reply(r) for r in replies or []]
        self.token_delay_s = token_delay_s
        self.default_words = default_words
        self.default_reply = default_reply
        self._continuations: OrderedDict[bytes, _Plan] = OrderedDict()

    def push(self, *replies: Reply | str) -> None:
        self.replies.extend(_as_reply(r) for r in replies)

    def needs_prompt_text(self) -> bool:
        return any(r.match for r in self.replies)

    def remember(self, sequence: list[int], plan: _Plan) -> None:
        self._continuations[_key(sequence)] = plan
        while len(self._continuations) > 10_000:
            self._continuations.popitem(last=False)

    def open(self, req: GenRequest, prompt_text: str | None) -> _Source:
        # Hashing a long prompt costs ~0.3 ms per 5k tokens: only when something is kept.
        plan = self._continuations.pop(_key(req.input_ids), None) if self._continuations else None
        if plan is None:
            plan = self._plan(self._choose(req, prompt_text), len(req.input_ids))
        return _Source(self, req, plan)

    def _choose(self, req: GenRequest, prompt_text: str | None) -> Reply:
        for i, reply in enumerate(self.replies):
            if reply.match is None or (prompt_text is not None and reply.match in prompt_text):
                return self.replies.pop(i)
        if self.default_reply is not None:
            return self.default_reply(req)
        return Reply(text=default_reply_text(req.input_ids, self.default_words))

    def _plan(self, reply: Reply, start: int) -> _Plan:
        if reply.ids is not None:
            ids = list(reply.ids)
        else:
            ids = self.tokenizer.encode(reply.text or "")
            if reply.eos and self.tokenizer.eos_token_ids:
                ids.append(self.tokenizer.eos_token_ids[0])
        if reply.logprobs is not None:
            if len(reply.logprobs) != len(ids):
                raise ValueError(
                    f"scripted reply has {len(ids)} tokens but {len(reply.logprobs)} logprobs"
                )
            logprobs = list(reply.logprobs)
        else:
            logprobs = [hashed_logprob(start + i, t) for i, t in enumerate(ids)]
        delay = self.token_delay_s if reply.token_delay_s is None else reply.token_delay_s
        return _Plan(ids, logprobs, delay)


def _as_reply(item: Reply | str) -> Reply:
    return Reply(text=item) if isinstance(item, str) else item


def _key(ids: list[int]) -> bytes:
    return hashlib.blake2b(repr(ids).encode(), digest_size=16).digest()


def load_script(path: str | Path) -> Script:
    """A JSON script: a list of replies (strings or Reply objects) or a Script object."""
    raw: Any = json.loads(Path(path).read_text())
    if isinstance(raw, list):
        raw = {"replies": raw}
    return msgspec.convert(raw, Script)


class ScriptedEngine:
    """A scripted SGLang stand-in for tests, run in the current event loop.

    >>> engine = ScriptedEngine(tokenizer, replies=["Hello!"])
    >>> url = await engine.start()      # http://127.0.0.1:<free port>
    >>> engine.push(Reply(text="..."), ...); engine.inject(Fault(abort_after=3))
    >>> await engine.stop()
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        replies: list[Reply | str] | None = None,
        *,
        token_delay_s: float = 0.0,
        context_length: int = 32768,
        weight_version: str = "0",
        default_words: int = 12,
        default_reply: Callable[[GenRequest], Reply] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.backend = ScriptedBackend(
            tokenizer,
            replies,
            token_delay_s=token_delay_s,
            default_words=default_words,
            default_reply=default_reply,
        )
        self.core = EngineCore(
            self.backend, tokenizer, context_length=context_length, weight_version=weight_version
        )
        self.server = EngineServer(self.core, host=host, port=port)

    @classmethod
    def from_script(cls, tokenizer: Tokenizer, script: Script, **kwargs: Any) -> ScriptedEngine:
        engine = cls(tokenizer, script.replies, default_words=script.default_words, **kwargs)
        engine.inject(*script.faults)
        return engine

    @property
    def url(self) -> str:
        return self.server.url

    async def start(self) -> str:
        return await self.server.start()

    async def stop(self) -> None:
        await self.server.stop()

    async def __aenter__(self) -> ScriptedEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # Shortcuts to the backend and core controls.
    def push(self, *replies: Reply | str) -> None:
        self.backend.push(*replies)

    def inject(self, *faults: Fault) -> None:
        self.core.inject(*faults)

    def pause(self, mode: str = "abort") -> None:
        self.core.pause(mode)

    def resume(self, new_weight_version: str | None = None) -> None:
        self.core.resume(new_weight_version)

    @property
    def requests(self) -> list[GenRequest]:
        return self.core.requests

    @property
    def aborts(self) -> list[str]:
        return self.core.aborts
