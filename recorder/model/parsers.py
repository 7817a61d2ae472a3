"""Split a model's output text into reasoning, plain text and tool calls.

Three backends behind one protocol, chosen explicitly (`make_parser`):
- `sglang`: SGLang's own parsers in-process (recorder.model.sglang_compat), every
  format SGLang knows;
- `http`: the engine's `/separate_reasoning` and `/parse_function_call`;
- `builtin`: hermes/qwen25 `<tool_call>{json}</tool_call>` and the `<think>`
  reasoning family, written here so the recorder works without SGLang.

Each backend only finds its raw split; recorder.model.parse_policy decides what the
agent gets, so the same output gives the same answer on every backend (proven
by tests/engine/test_sglang_parsers.py). Parsing never raises on model output.
Pass the output text without its final EOS token, decoded from whole tokens.
"""

from __future__ import annotations

import json
import logging
import operator
import re
from typing import Any, Literal, Protocol

import aiohttp

from recorder.model import sglang_compat
from recorder.model.parse_policy import (
    ParsedOutput,
    ToolCall,
    settle_calls,
    settle_reasoning,
    tool_names,
)

__all__ = [
    "BuiltinParser",
    "HttpParser",
    "OutputParser",
    "ParsedOutput",
    "ParserError",
    "SglangParser",
    "ToolCall",
    "check_parser_names",
    "default_backend",
    "make_parser",
    "parse_tool_calls",
    "prefills_reasoning",
    "split_reasoning",
    "split_reasoning_for",
    "tool_names",
]

log = logging.getLogger("recorder.model.parsers")

Backend = Literal["builtin", "http", "sglang"]
BACKENDS: tuple[Backend, ...] = ("builtin", "http", "sglang")

BUILTIN_TOOL_PARSERS = ("qwen25", "qwen", "hermes")
BUILTIN_REASONING_PARSERS = ("qwen3", "qwen3-thinking", "deepseek-r1")
# SGLang 0.5.23's parser names, so that names are checked at startup whatever the
# backend, without importing SGLang (the SGLang tier checks these against it).
SGLANG_VERSION = "0.5.23"
SGLANG_TOOL_PARSERS = (
    "apertus2509", "beam", "cohere_command4", "deepseekv3", "deepseekv31", "deepseekv32",
    "deepseekv4", "deepseekv41", "dots", "glm", "glm45", "glm47", "gpt-oss", "k2_horizon",
    "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3", "mimo", "minicpm5", "mistral", "muse",
    "poolside_v1", "pythonic", "qwen", "qwen25", "qwen3_coder", "spark25", "step3", "step3p5",
    "minimax-m2", "minimax-m3", "nanbeige", "trinity", "interns1", "hermes", "hunyuan",
    "gigachat3", "gigachat35", "gemma4", "inkling", "iquest_q1", "response_template",
)  # fmt: skip
SGLANG_REASONING_PARSERS = (
    "apertus2509", "beam", "deepseek-r1", "deepseek-v3", "deepseek-v4", "deepseek-v41", "dots",
    "glm45", "ling3", "hunyuan", "gpt-oss", "k2_horizon", "kimi", "kimi_k2", "kimi_k3", "mimo",
    "muse", "poolside_v1", "qwen3", "qwen3-thinking", "minimax", "minimax-append-think",
    "minimax-m3", "nanbeige", "step3", "step3p5", "mistral", "nemotron_3",
    "granite_thinking_parser", "interns1", "gemma4", "inkling", "iquest_q1", "cohere_command4",
    "gigachat35", "response_template",
)  # fmt: skip


class ParserError(RuntimeError):
    """The parser backend itself failed (not the model's output): e.g. the engine is down."""


class OutputParser(Protocol):
    # Which parser answers, for the log: backend, version and names.
    label: str

    async def parse(self, text: str, tools: list[dict[str, Any]]) -> ParsedOutput: ...


def prefills_reasoning(render_generation_prompt: str) -> bool:
    """Whether a rendered generation prompt leaves the model inside `<think>`."""
    tail = render_generation_prompt.rstrip("\n")
    return tail.endswith("<think>")


def check_parser_names(
    tool_parser: str | None, reasoning_parser: str | None, backend: Backend
) -> None:
    """Raise ValueError naming the valid parsers when a name is unknown to `backend`.

    The `builtin` backend knows its own few formats; `sglang` and `http` know
    SGLang's (an engine is SGLang), so a typo fails at startup, not at the
    first request.
    """
    if backend == "builtin":
        tools, reasoning = BUILTIN_TOOL_PARSERS, BUILTIN_REASONING_PARSERS
        fix = "; use backend 'sglang' (or 'http') for SGLang's other formats"
    else:
        tools, reasoning = SGLANG_TOOL_PARSERS, SGLANG_REASONING_PARSERS
        fix = f" (SGLang {SGLANG_VERSION})"
    if tool_parser and tool_parser not in tools:
        raise ValueError(
            f"unknown tool parser {tool_parser!r} for the {backend} parser backend; "
            f"valid: {', '.join(sorted(tools))}{fix}"
        )
    if reasoning_parser and reasoning_parser not in reasoning:
        raise ValueError(
            f"unknown reasoning parser {reasoning_parser!r} for the {backend} parser backend; "
            f"valid: {', '.join(sorted(reasoning))}{fix}"
        )


def _label(backend: str, version: str, tool_parser: str | None, reasoning: str | None) -> str:
    names = f"tool={tool_parser or '-'} reasoning={reasoning or '-'}"
    return f"{backend}{' ' + version if version else ''} {names}"


# --------------------------------------------------------------------------
# Built-in parsers (pure)
# --------------------------------------------------------------------------

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
# SGLang always forces these (their model starts inside its reasoning).
_ALWAYS_FORCED = ("qwen3-thinking", "deepseek-r1")
# A call opening inside unfinished reasoning ends it (SGLang's qwen3 rule; not deepseek-r1).
_TOOL_START = {"qwen3": CALL_START, "qwen3-thinking": CALL_START}


def split_reasoning(
    text: str, *, force_reasoning: bool = False, tool_start: str | None = None
) -> tuple[str | None, str]:
    """(raw reasoning, rest) for `<think>...</think>` output, by SGLang's rule.

    The output is in reasoning when forced (the prompt pre-filled `<think>`)
    or when it holds `<think>` anywhere; leading `<think>` tags are dropped.
    Without `</think>` it is all reasoning, unless `tool_start` opens a call.
    """
    if not force_reasoning and THINK_START not in text:
        return None, text
    body = text
    while body.startswith(THINK_START):
        body = body[len(THINK_START) :]
    if THINK_END in body:
        reasoning, rest = body.split(THINK_END, 1)
        return reasoning, rest
    at = body.find(tool_start) if tool_start else -1
    if at != -1:
        return body[:at], body[at:]
    return body, ""


def split_reasoning_for(
    reasoning_parser: str, text: str, *, force_reasoning: bool | None = None
) -> tuple[str | None, str]:
    """`split_reasoning` with the rules SGLang applies to a built-in parser name."""
    return split_reasoning(
        text,
        force_reasoning=bool(force_reasoning) or reasoning_parser in _ALWAYS_FORCED,
        tool_start=_TOOL_START.get(reasoning_parser),
    )


# Where a call begins and ends, per name: SGLang's qwen25 detector wants the newlines.
_CALL_MARKERS = {
    "qwen25": (CALL_START + "\n", "\n" + CALL_END),
    "qwen": (CALL_START + "\n", "\n" + CALL_END),
    "hermes": (CALL_START, CALL_END),
}


def parse_tool_calls(text: str, tool_parser: str = "hermes") -> tuple[str, list[tuple[Any, Any]]]:
    """(text before the first call, raw calls) for hermes/qwen25 `<tool_call>{json}</tool_call>`.

    Raw calls are (name, arguments) as written; a block that is not a JSON
    object with a name is skipped (recorder.model.parse_policy then keeps the text).
    """
    start, end = _CALL_MARKERS[tool_parser]
    first = text.find(start)
    if first == -1:
        return text, []
    calls: list[tuple[Any, Any]] = []
    for body in re.findall(re.escape(start) + r"(.*?)" + re.escape(end), text, re.DOTALL):
        try:
            obj = json.loads(body)
        except ValueError:
            continue
        if isinstance(obj, dict) and "name" in obj:
            # `parameters` first, as SGLang reads it.
            calls.append((obj["name"], obj.get("parameters") or obj.get("arguments", {})))
    return text[:first], calls


class BuiltinParser:
    """hermes/qwen25 tool calls and `<think>` reasoning, no dependencies."""

    def __init__(
        self,
        tool_parser: str | None,
        reasoning_parser: str | None,
        *,
        force_reasoning: bool | None = None,
    ) -> None:
        check_parser_names(tool_parser, reasoning_parser, "builtin")
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.force_reasoning = force_reasoning
        self.label = _label("builtin", "", tool_parser, reasoning_parser)

    def parse_sync(self, text: str, tools: list[dict[str, Any]] | None) -> ParsedOutput:
        reasoning: str | None = None
        if self.reasoning_parser:
            raw, rest = split_reasoning_for(
                self.reasoning_parser, text, force_reasoning=self.force_reasoning
            )
            reasoning, text = settle_reasoning(raw, rest, THINK_START, output=text)
        calls: list[ToolCall] = []
        if self.tool_parser and tools:
            normal, raw = parse_tool_calls(text, self.tool_parser)
            text, calls = settle_calls(self.tool_parser, text, normal, raw, tools)
        return ParsedOutput(reasoning=reasoning, text=text, tool_calls=calls)

    async def parse(self, text: str, tools: list[dict[str, Any]]) -> ParsedOutput:
        return self.parse_sync(text, tools)


# --------------------------------------------------------------------------
# Engine HTTP parsers
# --------------------------------------------------------------------------


class HttpParser:
    """The engine's `/separate_reasoning` then `/parse_function_call`."""

    def __init__(
        self,
        engine_url: str,
        tool_parser: str | None,
        reasoning_parser: str | None,
        *,
        timeout_s: float = 30,
    ) -> None:
        check_parser_names(tool_parser, reasoning_parser, "http")
        self.engine_url = engine_url.rstrip("/")
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.label = _label(f"http {self.engine_url}", "", tool_parser, reasoning_parser)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def parse(self, text: str, tools: list[dict[str, Any]]) -> ParsedOutput:
        reasoning: str | None = None
        if self.reasoning_parser:
            answer = await self._post(
                "/separate_reasoning", {"text": text, "reasoning_parser": self.reasoning_parser}
            )
            reasoning, text = settle_reasoning(
                answer.get("reasoning_text"),
                str(answer.get("text") or ""),
                THINK_START,
                output=text,
            )
        calls: list[ToolCall] = []
        if self.tool_parser and tools:
            answer = await self._post(
                "/parse_function_call",
                {"text": text, "tools": _openai_tools(tools), "tool_call_parser": self.tool_parser},
            )
            raw = [(c.get("name"), c.get("parameters")) for c in answer.get("calls") or []]
            normal = str(answer.get("normal_text") or "")
            text, calls = settle_calls(self.tool_parser, text, normal, raw, tools)
        return ParsedOutput(reasoning=reasoning, text=text, tool_calls=calls)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.post(self.engine_url + path, json=body) as resp:
                answer = await resp.json(content_type=None)
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ParserError(f"engine parser {path} failed: {exc}") from exc
        if status != 200 or not isinstance(answer, dict):
            raise ParserError(f"engine parser {path} answered HTTP {status}: {answer}")
        return answer


def _openai_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """SGLang wants `{"type": "function", "function": {...}}`; accept Anthropic-style too."""
    out = []
    for tool in tools:
        if isinstance(tool.get("function"), dict):
            out.append(tool)
        else:
            out.append(
                {
                    "type": "function",
                    "function": {
                        "name": tool.get("name", ""),
                        "description": tool.get("description", ""),
                        "parameters": tool.get("input_schema", tool.get("parameters", {})),
                    },
                }
            )
    return out


# --------------------------------------------------------------------------
# SGLang in-process parsers
# --------------------------------------------------------------------------


# Tool lists whose SGLang models one parser keeps (a session's tools, its subagents').
_MAX_TOOL_MODELS = 64


class SglangParser:
    """SGLang's FunctionCallParser / ReasoningParser, imported without `sglang/__init__`."""

    def __init__(
        self,
        tool_parser: str | None,
        reasoning_parser: str | None,
        *,
        force_reasoning: bool | None = None,
    ) -> None:
        check_parser_names(tool_parser, reasoning_parser, "sglang")
        # Only the modules this parser uses: the reasoning module alone imports
        # transformers (~25 MB of a server's RSS), the tool-call ones pydantic's
        # OpenAI protocol models (~40 MB).
        self._fc_cls: Any = None
        self._rp_cls: Any = None
        if tool_parser:
            self._fc_cls = sglang_compat.load(
                "srt.function_call.function_call_parser"
            ).FunctionCallParser
            protocol = sglang_compat.load("srt.entrypoints.openai.protocol")
            self._tool_cls, self._function_cls = protocol.Tool, protocol.Function
        # SGLang's Tool models per tool list, by the identity of its dicts (kept here,
        # so an id is never reused while its entry lives): see `_sglang_tools`.
        self._tool_models: dict[tuple[int, ...], tuple[list[Any], list[Any]]] = {}
        if reasoning_parser:
            self._rp_cls = sglang_compat.load("srt.parser.reasoning_parser").ReasoningParser
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.force_reasoning = force_reasoning
        self.label = _label("sglang", sglang_compat.version(), tool_parser, reasoning_parser)
        self._check_builds()

    def _check_builds(self) -> None:
        """Build each SGLang parser once now, so a name that cannot work fails at startup."""
        try:
            if self.tool_parser:
                self._fc_cls(tools=[], tool_call_parser=self.tool_parser)
            if self.reasoning_parser:
                self._rp_cls(self.reasoning_parser, stream_reasoning=False)
        except ValueError as exc:  # e.g. response_template without the model's template
            raise ValueError(
                f"SGLang cannot build the parser {self.tool_parser or self.reasoning_parser!r} "
                f"here: {exc}"
            ) from exc

    def parse_sync(self, text: str, tools: list[dict[str, Any]] | None) -> ParsedOutput:
        reasoning: str | None = None
        if self.reasoning_parser:
            kwargs = (
                {} if self.force_reasoning is None else {"force_reasoning": self.force_reasoning}
            )
            parser = self._rp_cls(self.reasoning_parser, stream_reasoning=False, **kwargs)
            raw_reasoning, rest = parser.parse_non_stream(text)
            start = getattr(parser.detector, "think_start_token", None)
            reasoning, text = settle_reasoning(raw_reasoning, rest or "", start, output=text)
        calls: list[ToolCall] = []
        if self.tool_parser and tools:
            fc = self._fc_cls(tools=self._sglang_tools(tools), tool_call_parser=self.tool_parser)
            try:
                normal, items = fc.parse_non_stream(text)
            except Exception:  # a detector that trips on odd output: the output stays text
                log.warning("sglang %s parser failed; the output is kept as text", self.tool_parser)
                normal, items = text, []
            raw = [(item.name, item.parameters) for item in items]
            text, calls = settle_calls(self.tool_parser, text, normal, raw, tools)
        return ParsedOutput(reasoning=reasoning, text=text, tool_calls=calls)

    async def parse(self, text: str, tools: list[dict[str, Any]]) -> ParsedOutput:
        return self.parse_sync(text, tools)

    def _sglang_tools(self, tools: list[dict[str, Any]]) -> list[Any]:
        """SGLang's pydantic Tool models for `tools`, built once per list of tool dicts.

        A session's requests share their tool dicts (`chat.shared_tools`, never
        changed), so every turn would otherwise build the same models (two
        pydantic validations per tool). Keyed by the dicts' identity, checked.
        """
        key = tuple(map(id, tools))
        found = self._tool_models.get(key)
        if found is not None and all(map(operator.is_, found[0], tools)):
            return found[1]
        models = [
            self._tool_cls(type="function", function=self._function_cls(**t["function"]))
            for t in _openai_tools(tools)
        ]
        if len(self._tool_models) >= _MAX_TOOL_MODELS:
            self._tool_models.clear()
        self._tool_models[key] = (list(tools), models)
        return models


def default_backend() -> Backend:
    """SGLang in-process when its parsers import here, else the built-in parsers."""
    return "sglang" if sglang_compat.available() else "builtin"


def make_parser(
    tool_parser: str | None,
    reasoning_parser: str | None,
    backend: Backend,
    engine_url: str | None = None,
    *,
    force_reasoning: bool | None = None,
) -> OutputParser:
    """A parser for the given SGLang parser names on the chosen backend.

    `force_reasoning`: the output starts inside `<think>` (see `prefills_reasoning`).
    Raises ValueError for an unknown name (naming the valid ones) or backend,
    and `sglang_compat.SglangUnavailable` when backend 'sglang' cannot import.
    """
    if backend == "builtin":
        return BuiltinParser(tool_parser, reasoning_parser, force_reasoning=force_reasoning)
    if backend == "sglang":
        return SglangParser(tool_parser, reasoning_parser, force_reasoning=force_reasoning)
    if backend == "http":
        if not engine_url:
            raise ValueError("the http parser backend needs engine_url")
        return HttpParser(engine_url, tool_parser, reasoning_parser)
    raise ValueError(f"unknown parser backend {backend!r}: {', '.join(BACKENDS)}")
