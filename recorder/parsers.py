"""Split a model's output text into reasoning, plain text and tool calls.

Three backends behind one protocol:
- `sglang`: SGLang's own parsers in-process (when `import sglang` works);
- `http`: the engine's `/parse_function_call` and `/separate_reasoning`;
- `builtin`: hermes/qwen25 `<tool_call>{json}</tool_call>` and qwen3
  `<think>...</think>`, written here so the recorder works without sglang.

Whatever the backend, a tool call that cannot be parsed (bad JSON, no name,
unknown tool, unclosed tag) comes back as plain text: parsing never raises
on model output. Pass the output text without its final EOS token.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, Protocol

import aiohttp
import msgspec

Backend = Literal["auto", "builtin", "http", "sglang"]

TOOL_PARSERS = ("qwen25", "qwen", "hermes")
REASONING_PARSERS = ("qwen3", "qwen3-thinking", "deepseek-r1")
# Parsers whose model always starts inside its reasoning (template pre-fills `<think>`).
_FORCED_REASONING = ("qwen3-thinking", "deepseek-r1")


class ToolCall(msgspec.Struct, frozen=True):
    name: str
    arguments: dict[str, Any]


class ParsedOutput(msgspec.Struct, frozen=True):
    reasoning: str | None
    text: str
    tool_calls: list[ToolCall] = []


class ParserError(RuntimeError):
    """The parser backend itself failed (not the model's output): e.g. the engine is down."""


class OutputParser(Protocol):
    async def parse(self, text: str, tools: list[dict[str, Any]]) -> ParsedOutput: ...


def tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    """Names of OpenAI-style (`{"function": {"name"}}`) or Anthropic-style (`{"name"}`) tools."""
    names: set[str] = set()
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        if isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


def prefills_reasoning(render_generation_prompt: str) -> bool:
    """Whether a rendered generation prompt leaves the model inside `<think>`."""
    tail = render_generation_prompt.rstrip("\n")
    return tail.endswith("<think>")


# --------------------------------------------------------------------------
# Built-in parsers (pure)
# --------------------------------------------------------------------------

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(CALL_START) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)


def split_reasoning(text: str, *, force_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning, rest) for qwen3-style `<think>...</think>` output.

    With `force_reasoning` the output may lack the opening tag (the prompt
    pre-filled it); output without `</think>` is then all reasoning.
    """
    start = text.find(THINK_START)
    if start == -1 and not force_reasoning:
        return None, text
    if start != -1 and text[:start].strip() == "":
        body = text[start + len(THINK_START) :]
    elif start == -1 or force_reasoning:
        body = text
    else:  # a `<think>` in the middle of plain text is plain text
        return None, text
    end = body.find(THINK_END)
    if end == -1:
        return body.strip(), ""
    return body[:end].strip(), body[end + len(THINK_END) :].strip()


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None) -> tuple[str, list[ToolCall]]:
    """(text, calls) for hermes/qwen25 output: `<tool_call>\\n{"name", "arguments"}\\n</tool_call>`.

    `tools=None` accepts any well-formed call; an empty list means the request
    offered no tools, so there are no calls and the text stays text.
    """
    if tools is not None and not tools:
        return text, []
    allowed = tool_names(tools)
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for match in _CALL_RE.finditer(text):
        kept.append(text[pos : match.start()])
        call = _tool_call(match.group(1), allowed)
        if call is None:
            kept.append(match.group(0))
        else:
            calls.append(call)
        pos = match.end()
    kept.append(text[pos:])
    if not calls:
        return text, []
    return "\n".join(piece.strip() for piece in kept if piece.strip()), calls


def _tool_call(body: str, allowed: set[str]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    if allowed and obj["name"] not in allowed:
        return None
    return ToolCall(name=obj["name"], arguments=args)


class BuiltinParser:
    """hermes/qwen25 tool calls and qwen3 reasoning, no dependencies."""

    def __init__(
        self,
        tool_parser: str | None,
        reasoning_parser: str | None,
        *,
        force_reasoning: bool | None = None,
    ) -> None:
        _check_names(tool_parser, reasoning_parser, "builtin")
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.force_reasoning = (
            force_reasoning
            if force_reasoning is not None
            else reasoning_parser in _FORCED_REASONING
        )

    def parse_sync(self, text: str, tools: list[dict[str, Any]] | None) -> ParsedOutput:
        reasoning: str | None = None
        if self.reasoning_parser:
            reasoning, text = split_reasoning(text, force_reasoning=self.force_reasoning)
        calls: list[ToolCall] = []
        if self.tool_parser:
            text, calls = parse_tool_calls(text, tools)
        return ParsedOutput(reasoning=reasoning, text=text, tool_calls=calls)

    async def parse(self, text: str, tools: list[dict[str, Any]]) -> ParsedOutput:
        return self.parse_sync(text, tools)


def _check_names(tool_parser: str | None, reasoning_parser: str | None, backend: str) -> None:
    if tool_parser and tool_parser not in TOOL_PARSERS:
        raise ValueError(
            f"the {backend} parser knows tool parsers {', '.join(TOOL_PARSERS)}, not "
            f"{tool_parser!r}; install sglang (backend 'sglang') or use backend 'http'"
        )
    if reasoning_parser and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"the {backend} parser knows reasoning parsers {', '.join(REASONING_PARSERS)}, "
            f"not {reasoning_parser!r}; install sglang (backend 'sglang') or use backend 'http'"
        )


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
        self.engine_url = engine_url.rstrip("/")
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
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
            reasoning = answer.get("reasoning_text") or None
            text = str(answer.get("text") or "")
        calls: list[ToolCall] = []
        if self.tool_parser and tools:
            answer = await self._post(
                "/parse_function_call",
                {"text": text, "tools": _openai_tools(tools), "tool_call_parser": self.tool_parser},
            )
            text, calls = _calls_from_engine(text, answer, tool_names(tools))
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


def _calls_from_engine(
    text: str, answer: dict[str, Any], allowed: set[str]
) -> tuple[str, list[ToolCall]]:
    calls: list[ToolCall] = []
    for raw in answer.get("calls") or []:
        call = _tool_call(
            json.dumps({"name": raw.get("name"), "arguments": raw.get("parameters") or "{}"}),
            allowed,
        )
        if call is None:  # a call the engine accepted but we cannot use: keep the raw text
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    return str(answer.get("normal_text") or ""), calls


# --------------------------------------------------------------------------
# SGLang in-process parsers
# --------------------------------------------------------------------------


class SglangParser:
    """SGLang's FunctionCallParser / ReasoningParser, imported lazily."""

    def __init__(
        self,
        tool_parser: str | None,
        reasoning_parser: str | None,
        *,
        force_reasoning: bool | None = None,
    ) -> None:
        try:
            from sglang.srt.entrypoints.openai.protocol import Function, Tool
            from sglang.srt.function_call.function_call_parser import FunctionCallParser
            from sglang.srt.parser.reasoning_parser import ReasoningParser
        except ImportError as exc:
            raise ImportError(
                f"the sglang parser backend needs sglang importable here ({exc}); "
                "use backend 'builtin' or 'http'"
            ) from exc
        self._tool_cls, self._function_cls = Tool, Function
        self._fc_cls, self._rp_cls = FunctionCallParser, ReasoningParser
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.force_reasoning = force_reasoning

    def parse_sync(self, text: str, tools: list[dict[str, Any]] | None) -> ParsedOutput:
        reasoning: str | None = None
        if self.reasoning_parser:
            kwargs = (
                {} if self.force_reasoning is None else {"force_reasoning": self.force_reasoning}
            )
            parser = self._rp_cls(self.reasoning_parser, stream_reasoning=False, **kwargs)
            reasoning, text = parser.parse_non_stream(text)
            reasoning = reasoning or None
            text = text or ""
        calls: list[ToolCall] = []
        if self.tool_parser and tools:
            sg_tools = [
                self._tool_cls(type="function", function=self._function_cls(**t["function"]))
                for t in _openai_tools(tools)
            ]
            fc = self._fc_cls(tools=sg_tools, tool_call_parser=self.tool_parser)
            if fc.has_tool_call(text):
                normal, items = fc.parse_non_stream(text)
                raw = {
                    "normal_text": normal,
                    "calls": [{"name": i.name, "parameters": i.parameters} for i in items],
                }
                text, calls = _calls_from_engine(text, raw, tool_names(tools))
        return ParsedOutput(reasoning=reasoning, text=text, tool_calls=calls)

    async def parse(self, text: str, tools: list[dict[str, Any]]) -> ParsedOutput:
        return self.parse_sync(text, tools)


def sglang_available() -> bool:
    try:
        import sglang.srt.function_call.function_call_parser
        import sglang.srt.parser.reasoning_parser  # noqa: F401
    except ImportError:
        return False
    return True


def make_parser(
    tool_parser: str | None,
    reasoning_parser: str | None,
    backend: Backend = "auto",
    engine_url: str | None = None,
    *,
    force_reasoning: bool | None = None,
) -> OutputParser:
    """A parser for the given SGLang parser names.

    "auto" uses sglang in-process when it imports, else the built-in parsers.
    `force_reasoning`: the output starts inside `<think>` (see `prefills_reasoning`).
    """
    if backend == "auto":
        backend = "sglang" if sglang_available() else "builtin"
    if backend == "builtin":
        return BuiltinParser(tool_parser, reasoning_parser, force_reasoning=force_reasoning)
    if backend == "sglang":
        return SglangParser(tool_parser, reasoning_parser, force_reasoning=force_reasoning)
    if backend == "http":
        if not engine_url:
            raise ValueError("the http parser backend needs engine_url")
        return HttpParser(engine_url, tool_parser, reasoning_parser)
    raise ValueError(f"unknown parser backend {backend!r}: auto, builtin, http or sglang")
