"""Model outputs in each family's own syntax, with the answer the parse policy owes for each.

One `Family` per SGLang tool-call parser name: how its model writes a call,
several calls and its reasoning. `corpus(family)` builds the cases the issue
lists (text around calls, two calls, bad JSON next to a good call, an unknown
tool, a call cut off at max_tokens, text after the last call, reasoning forced
and not, reasoning then calls), each with the expected `ParsedOutput` written
from recorder/model/parse_policy.py's rules, never from a parser's answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from recorder.model.parse_policy import ParsedOutput, ToolCall

TOOLS: list[dict[str, Any]] = [  # Anthropic-style, as agents send them
    {
        "name": "bash",
        "description": "Run a shell command.",
        "input_schema": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}},
            "required": ["cmd"],
        },
    },
    {
        "name": "read_file",
        "description": "Read a file.",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    },
]
LS = ToolCall("bash", {"cmd": "ls -la /tmp"})
READ = ToolCall("read_file", {"path": "README.md"})
UNKNOWN = ToolCall("rm_rf", {"path": "/"})


@dataclass(frozen=True)
class Family:
    tool_parser: str
    reasoning_parser: str | None
    call: Callable[[ToolCall], str]  # one call as the model writes it
    broken: str  # a call whose arguments are not valid JSON / markup
    wrap: Callable[[list[str]], str] = "\n".join  # several calls as one output
    think: tuple[str, str] = ("<think>", "</think>")  # reasoning open/close as written
    forced: bool = False  # a template that pre-fills the reasoning opener exists
    builtin: bool = False  # the builtin backend knows this format


def _j(obj: Any) -> str:
    return json.dumps(obj)


def _hermes(c: ToolCall) -> str:
    return f"<tool_call>\n{_j({'name': c.name, 'arguments': c.arguments})}\n</tool_call>"


def _glm45(c: ToolCall) -> str:
    args = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in c.arguments.items()
    )
    return f"<tool_call>{c.name}\n{args}</tool_call>"


def _glm47(c: ToolCall) -> str:
    args = "".join(
        f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in c.arguments.items()
    )
    return f"<tool_call>{c.name}{args}</tool_call>"


def _qwen3_coder(c: ToolCall) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in c.arguments.items())
    return f"<tool_call>\n<function={c.name}>\n{params}</function>\n</tool_call>"


def _kimi(c: ToolCall) -> str:
    return (
        f"<|tool_call_begin|>functions.{c.name}:0<|tool_call_argument_begin|>"
        f"{_j(c.arguments)}<|tool_call_end|>"
    )


def _kimi_wrap(calls: list[str]) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


def _deepseek(c: ToolCall) -> str:
    return (
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{c.name}\n```json\n{_j(c.arguments)}\n```"
        "<｜tool▁call▁end｜>"
    )


def _deepseek_wrap(calls: list[str]) -> str:
    return "<｜tool▁calls▁begin｜>" + "\n".join(calls) + "<｜tool▁calls▁end｜>"


def _llama3(c: ToolCall) -> str:
    return _j({"name": c.name, "parameters": c.arguments})


def _llama3_wrap(calls: list[str]) -> str:
    return "<|python_tag|>" + "; ".join(calls)


def _mistral(c: ToolCall) -> str:
    return _j({"name": c.name, "arguments": c.arguments})


def _mistral_wrap(calls: list[str]) -> str:
    return "[TOOL_CALLS] [" + ", ".join(calls) + "]"


def _gpt_oss(c: ToolCall) -> str:
    return (
        f"<|start|>assistant<|channel|>commentary to=functions.{c.name} <|constrain|>json"
        f"<|message|>{_j(c.arguments)}<|call|>"
    )


FAMILIES: dict[str, Family] = {
    f.tool_parser: f
    for f in [
        Family("qwen25", "qwen3", _hermes, "<tool_call>\n{oops, not json}\n</tool_call>",
               forced=True, builtin=True),
        Family("hermes", "qwen3", _hermes, "<tool_call>\n{oops, not json}\n</tool_call>",
               forced=True, builtin=True),
        Family("glm45", "glm45", _glm45, "<tool_call></tool_call>"),
        Family("glm47", "glm45", _glm47, "<tool_call></tool_call>"),
        Family("qwen3_coder", "qwen3", _qwen3_coder, "<tool_call>\n<oops>\n</tool_call>",
               forced=True),
        Family("kimi_k2", "kimi_k2", _kimi,
               "<|tool_call_begin|>functions.bash:1<|tool_call_argument_begin|>{oops"
               "<|tool_call_end|>", wrap=_kimi_wrap),
        Family("deepseekv3", "deepseek-v3", _deepseek,
               "<｜tool▁call▁begin｜>function<｜tool▁sep｜>bash\n```json\n{oops\n```"
               "<｜tool▁call▁end｜>", wrap=_deepseek_wrap, forced=True),
        Family("llama3", None, _llama3, '{"name": "bash", "parameters": {oops}}',
               wrap=_llama3_wrap),
        Family("mistral", "mistral", _mistral, '{"name": "bash", "arguments": {oops}}',
               wrap=_mistral_wrap, think=("[THINK]", "[/THINK]")),
        Family("gpt-oss", "gpt-oss", _gpt_oss,
               "<|start|>assistant<|channel|>commentary to=functions.bash <|constrain|>json"
               "<|message|>{oops<|call|>", wrap="".join,
               think=("<|channel|>analysis<|message|>", "<|end|>")),
    ]
}  # fmt: skip


@dataclass(frozen=True)
class Case:
    name: str
    output: str
    expected: ParsedOutput
    force_reasoning: bool | None = None


def _text(output: str) -> ParsedOutput:
    return ParsedOutput(None, output, [])  # only text: as the model wrote it


def corpus(f: Family) -> list[Case]:
    """Every case for one family; `expected` follows the parse policy."""
    one, two = f.wrap([f.call(LS)]), f.wrap([f.call(LS), f.call(READ)])
    bad = f.wrap([f.call(LS), f.broken])
    unknown = f.wrap([f.call(UNKNOWN)])
    cut = one[: one.index("/tmp")]
    after = one + "\nDone, that was all."
    cases = [
        Case("text", "All done, nothing to run.\n", _text("All done, nothing to run.\n")),
        Case("text then call", "Let me look.\n" + one, ParsedOutput(None, "Let me look.", [LS])),
        Case("two calls", two, ParsedOutput(None, "", [LS, READ])),
        Case("bad json next to a good call", bad, _text(bad)),
        Case("unknown tool", unknown, _text(unknown)),
        Case("unclosed call at max_tokens", cut, _text(cut)),
        Case("text after the last call", after, _text(after)),
    ]
    if f.reasoning_parser is None:
        return cases
    start, end = f.think
    plan = "I should list /tmp first."
    cases += [
        Case(
            "reasoning then text",
            f"{start}{plan}{end}\n\nNothing to do.",
            ParsedOutput(plan, "Nothing to do.", []),
        ),
        Case(
            "reasoning then calls",
            f"{start}\n{plan}\n{end}\n\n{two}",
            ParsedOutput(plan, "", [LS, READ]),
        ),
    ]
    if f.forced:
        cases.append(
            Case(
                "reasoning forced, opener pre-filled",
                f"{plan}\n{end}\n\n{one}",
                ParsedOutput(plan, "", [LS]),
                force_reasoning=True,
            )
        )
    return cases


def anthropic_blocks(expected: ParsedOutput) -> list[dict[str, Any]]:
    """The content blocks an agent must get for `expected` (tool_use ids left out)."""
    blocks: list[dict[str, Any]] = []
    if expected.reasoning:
        blocks.append({"type": "thinking", "thinking": expected.reasoning})
    if expected.text or (not expected.tool_calls and not blocks):
        blocks.append({"type": "text", "text": expected.text})
    blocks += [
        {"type": "tool_use", "name": c.name, "input": c.arguments} for c in expected.tool_calls
    ]
    return blocks
