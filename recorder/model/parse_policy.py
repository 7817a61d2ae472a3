"""The one parse policy: whatever the backend, the same output gives the same answer.

Every parser backend (built-in, the engine's HTTP parsers, SGLang in-process)
finds reasoning and tool calls its own way, then hands its raw split to the two
functions here, which decide what the agent gets. The rules:

1. Reasoning ends where SGLang's detector for the model says it ends (the
   built-in parser reimplements that rule for the `<think>` family).
2. Whitespace: an output split into blocks loses the whitespace at the seams.
   The reasoning, and the text next to reasoning or calls, come without
   surrounding whitespace (as SGLang's OpenAI server strips the text before
   calls); start tags the model repeated at the head of its reasoning go too.
   An output that is only text is returned exactly as the model wrote it (a
   trailing space before a stop sequence stays). The exact characters are kept
   in the recorded output tokens either way; the blocks are what the agent
   reads, and separator newlines are no part of any block.
3. Tool calls are all or nothing, and model text is never lost. The calls are
   accepted only when every call the model opened (counted by the format's own
   markers, `CALL_SYNTAX`) parsed into a call of a declared tool with object
   arguments, and nothing but whitespace stands between or after the calls.
   Otherwise (bad JSON, an unknown tool, a call cut off at max_tokens, text
   after the last call) there is no call and the whole output after the
   reasoning is the text. SGLang alone would drop such a block, or the text
   after it, silently; a partial set of calls would run half of what the model
   asked for.
4. No declared tools, no calls (as SGLang: it parses nothing without tools).

Formats outside `CALL_SYNTAX` keep rule 3 for what the parser returned (known
tools, object arguments) but cannot count the calls the parser missed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec


class ToolCall(msgspec.Struct, frozen=True):
    name: str
    arguments: dict[str, Any]


class ParsedOutput(msgspec.Struct, frozen=True):
    reasoning: str | None
    text: str
    tool_calls: list[ToolCall] = []


def tool_names(tools: Iterable[dict[str, Any]] | None) -> set[str]:
    """Names of OpenAI-style (`{"function": {"name"}}`) or Anthropic-style (`{"name"}`) tools."""
    names: set[str] = set()
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        if isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


# --------------------------------------------------------------------------
# Reasoning
# --------------------------------------------------------------------------


def settle_reasoning(
    reasoning: str | None, text: str, start_tag: str | None, *, output: str
) -> tuple[str | None, str]:
    """(reasoning or None when empty, text) from a reasoning parser's raw split of `output`.

    The text keeps its whitespace when the parser split nothing off (rule 2).
    If it found neither reasoning nor text in a non-blank output (SGLang's
    gpt-oss parser on text without channel markup), the output is the text.
    """
    body = (reasoning or "").strip()
    while start_tag and body.startswith(start_tag):
        body = body[len(start_tag) :].strip()
    if not body and not text.strip():
        return None, output if output.strip() else text
    return body or None, text if text == output else text.strip()


# --------------------------------------------------------------------------
# Tool calls
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class CallSyntax:
    """How one format marks its calls: where they begin and what one call is."""

    opener: str  # the calls begin at its first occurrence
    block: re.Pattern[str] | None = None  # one call, from its start to its end marker
    wrappers: tuple[str, ...] = ()  # section markers around the calls
    count: Callable[[str], int | None] | None = None  # custom: calls in the region, or None


def _json_objects(region: str, separator: str) -> int | None:
    """How many JSON objects `region` holds, separated by `separator`; None if anything else."""
    decoder, pos, n = json.JSONDecoder(), 0, 0
    while True:
        pos = len(region) - len(region[pos:].lstrip())
        if pos >= len(region):
            return n
        try:
            obj, end = decoder.raw_decode(region, pos)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        n, pos = n + 1, end
        rest = region[pos:].lstrip()
        if rest and not rest.startswith(separator):
            return None
        pos = len(region) - len(rest) + (len(separator) if rest else 0)


def _llama3_calls(region: str) -> int | None:
    return _json_objects(region, ";")


_MISTRAL_COMPACT = re.compile(r"\s*(?:\[TOOL_CALLS\])?\s*[\w.-]+\[ARGS\]")


def _mistral_calls(region: str) -> int | None:
    """`[TOOL_CALLS] [{...}, ...]` (a JSON array) or `[TOOL_CALLS]name[ARGS]{...}`, repeated."""
    body = region.strip()
    if body.startswith("["):
        try:
            items, end = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return None
        ok = isinstance(items, list) and all(isinstance(i, dict) for i in items)
        return len(items) if ok and not body[end:].strip() else None
    n, pos, decoder = 0, 0, json.JSONDecoder()
    while pos < len(body):
        head = _MISTRAL_COMPACT.match(body, pos)
        if head is None:
            return None
        try:
            _, pos = decoder.raw_decode(body, head.end())
        except ValueError:
            return None
        n += 1
        pos = len(body) - len(body[pos:].lstrip())
    return n


def _tagged(start: str, end: str) -> re.Pattern[str]:
    return re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)


_TOOL_CALL_TAG = CallSyntax("<tool_call>", _tagged("<tool_call>", "</tool_call>"))
_KIMI = CallSyntax(
    "<|tool_calls_section_begin|>",
    _tagged("<|tool_call_begin|>", "<|tool_call_end|>"),
    ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
)
_DEEPSEEK = CallSyntax(
    "<｜tool▁calls▁begin｜>",
    _tagged("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"),
    ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
)
_GPT_OSS_OPENER = "<|start|>assistant<|channel|>commentary"

# Tool-call parser name -> the syntax its model writes (SGLang's detector for that name).
CALL_SYNTAX: dict[str, CallSyntax] = {
    **dict.fromkeys(
        ("qwen", "qwen25", "hermes", "glm", "glm45", "glm47", "qwen3_coder", "step3p5"),
        _TOOL_CALL_TAG,
    ),
    "kimi_k2": _KIMI,
    "deepseekv3": _DEEPSEEK,
    "deepseekv31": _DEEPSEEK,
    "gpt-oss": CallSyntax(_GPT_OSS_OPENER, _tagged(_GPT_OSS_OPENER, "<|call|>")),
    "llama3": CallSyntax("<|python_tag|>", count=_llama3_calls),
    "mistral": CallSyntax("[TOOL_CALLS]", count=_mistral_calls),
}


def opened_calls(tool_parser: str, text: str) -> int | None:
    """How many calls the model opened in `text`; None if anything else stands among them.

    None also for a format this module has no syntax for.
    """
    syntax = CALL_SYNTAX.get(tool_parser)
    if syntax is None:
        return None
    at = text.find(syntax.opener)
    if at == -1 and syntax.count is not None and text.lstrip().startswith("{"):
        at = len(text) - len(text.lstrip())  # llama3 may write bare JSON, without its tag
        region = text[at:]
    elif at == -1:
        return 0
    else:
        region = text[at + len(syntax.opener) if syntax.count is not None else at :]
    if syntax.count is not None:
        return syntax.count(region)
    assert syntax.block is not None
    n = len(syntax.block.findall(region))
    rest = syntax.block.sub("", region)
    for marker in syntax.wrappers:
        rest = rest.replace(marker, "")
    return n if not rest.strip() else None


def _arguments(raw: Any) -> dict[str, Any] | None:
    """Call arguments as an object, or None.

    SGLang gives JSON text, engines may give an object; a model that wrote its
    arguments as a JSON string holding an object gets that object (nothing is
    lost by decoding it), so up to two decodes.
    """
    for _ in range(2):
        if not isinstance(raw, str):
            break
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return None
    return raw if isinstance(raw, dict) else None


def settle_calls(
    tool_parser: str,
    text: str,
    normal_text: str,
    raw_calls: Sequence[tuple[Any, Any]],
    tools: Iterable[dict[str, Any]] | None,
) -> tuple[str, list[ToolCall]]:
    """(text, calls) under rule 3, from a parser's (normal_text, [(name, arguments)]).

    `text` is the output after the reasoning, as the parser got it; it is the
    answer's text, unchanged, when the calls are not accepted.
    """
    allowed = tool_names(tools)
    calls: list[ToolCall] = []
    for name, raw_args in raw_calls:
        args = _arguments(raw_args)
        if not isinstance(name, str) or name not in allowed or args is None:
            return text, []
        calls.append(ToolCall(name=name, arguments=args))
    opened = opened_calls(tool_parser, text)
    if not calls or (tool_parser in CALL_SYNTAX and opened != len(calls)):
        return text, []
    return normal_text.strip(), calls
