"""Output parsers: built-in formats, the engine's HTTP parsers, SGLang in-process (faked)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from recorder.parsers import (
    BuiltinParser,
    HttpParser,
    ParsedOutput,
    ParserError,
    SglangParser,
    ToolCall,
    make_parser,
    parse_tool_calls,
    prefills_reasoning,
    split_reasoning,
)
from recorder.tokenizer import load_tokenizer
from tools.test_engine import ScriptedEngine, free_port

from .conftest import FIXTURE_TOKENIZER

TOOLS = [
    {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}},
    {"name": "read_file", "input_schema": {"type": "object"}},  # Anthropic-style
]


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


@pytest.mark.parametrize(
    ("text", "force", "expected"),
    [
        ("<think>\nplan\n</think>\n\nanswer", False, ("plan", "answer")),
        ("plain answer", False, (None, "plain answer")),
        ("plan\n</think>\n\nanswer", True, ("plan", "answer")),
        ("still thinking", True, ("still thinking", "")),
        ("<think>\nunfinished", False, ("unfinished", "")),
        ("\n<think>a</think>b", False, ("a", "b")),
        ("text then <think>x</think>", False, (None, "text then <think>x</think>")),
        ("<think>\n\n</think>\n\nok", True, ("", "ok")),
    ],
)
def test_split_reasoning(text: str, force: bool, expected: tuple[str | None, str]) -> None:
    assert split_reasoning(text, force_reasoning=force) == expected


def test_tool_calls_parse_and_keep_text() -> None:
    text = "Let me look.\n" + call("bash", '{"cmd": "ls -la"}') + "\n" + call("read_file", "{}")
    out, calls = parse_tool_calls(text, TOOLS)
    assert out == "Let me look."
    assert calls == [ToolCall("bash", {"cmd": "ls -la"}), ToolCall("read_file", {})]


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        call("rm_rf", "{}"),  # unknown tool
        call("bash", "[1, 2]"),  # arguments not an object
        call("bash", '"{broken"'),  # arguments a broken JSON string
        '<tool_call>\n{"name": "bash", "arguments": {}}',  # unclosed (max_tokens)
    ],
)
def test_malformed_tool_calls_come_back_as_text(bad: str) -> None:
    good = call("bash", '{"cmd": "pwd"}')
    out, calls = parse_tool_calls(good + "\n" + bad, TOOLS)
    assert calls == [ToolCall("bash", {"cmd": "pwd"})]
    assert out == bad.strip()
    alone, none = parse_tool_calls(bad, TOOLS)
    assert (alone, none) == (bad, [])


def test_string_arguments_and_parameters_key() -> None:
    text = (
        '<tool_call>\n{"name": "bash", "arguments": "{\\"cmd\\": \\"ls\\"}"}\n</tool_call>'
        '<tool_call>{"name": "bash", "parameters": {"cmd": "pwd"}}</tool_call>'
    )
    _, calls = parse_tool_calls(text, TOOLS)
    assert calls == [ToolCall("bash", {"cmd": "ls"}), ToolCall("bash", {"cmd": "pwd"})]
    # Without a tool list (None) every well-formed call is accepted...
    _, calls = parse_tool_calls(call("anything", "{}"), None)
    assert calls == [ToolCall("anything", {})]
    # ...but `tools: []` offers none: no calls, the text stays text.
    text, calls = parse_tool_calls(call("anything", "{}"), [])
    assert calls == [] and text == call("anything", "{}")


async def test_builtin_parser_combines_reasoning_and_calls() -> None:
    parser = make_parser("qwen25", "qwen3", backend="builtin", force_reasoning=True)
    out = await parser.parse(
        "I need ls\n</think>\n\nRunning.\n" + call("bash", '{"cmd": "ls"}'), TOOLS
    )
    assert out == ParsedOutput("I need ls", "Running.", [ToolCall("bash", {"cmd": "ls"})])
    none = await make_parser(None, None, backend="builtin").parse(
        "<think>x</think>" + call("bash", "{}"), TOOLS
    )
    assert none == ParsedOutput(None, "<think>x</think>" + call("bash", "{}"), [])
    # qwen3-thinking forces reasoning by default.
    forced = await make_parser(None, "qwen3-thinking", backend="builtin").parse("a</think>b", [])
    assert (forced.reasoning, forced.text) == ("a", "b")


def test_unknown_parser_names_and_backends() -> None:
    with pytest.raises(ValueError, match="knows tool parsers"):
        make_parser("llama3", None, backend="builtin")
    with pytest.raises(ValueError, match="knows reasoning parsers"):
        make_parser(None, "kimi", backend="builtin")
    with pytest.raises(ValueError, match="needs engine_url"):
        make_parser("qwen25", None, backend="http")
    with pytest.raises(ValueError, match="unknown parser backend"):
        make_parser("qwen25", None, backend="grpc")  # type: ignore[arg-type]


def test_prefills_reasoning_from_templates() -> None:
    think = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template="chatml-tools-think")
    plain = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template="chatml-tools")
    msgs = [{"role": "user", "content": "x"}]
    assert prefills_reasoning(think.render(msgs))
    assert not prefills_reasoning(think.render(msgs, enable_thinking=False))
    assert not prefills_reasoning(plain.render(msgs))


async def test_http_backend_against_test_engine(tokenizer) -> None:
    async with ScriptedEngine(tokenizer) as engine:
        parser = make_parser("qwen25", "qwen3", backend="http", engine_url=engine.url)
        assert isinstance(parser, HttpParser)
        try:
            text = "<think>plan</think>\n\nOK.\n" + call("read_file", '{"path": "a"}')
            out = await parser.parse(text, TOOLS)
            assert out == ParsedOutput("plan", "OK.", [ToolCall("read_file", {"path": "a"})])
            bad = await parser.parse("<tool_call>\n{oops}\n</tool_call>", TOOLS)
            assert bad == ParsedOutput(None, "<tool_call>\n{oops}\n</tool_call>", [])
        finally:
            await parser.close()
    down = HttpParser(f"http://127.0.0.1:{free_port()}", "qwen25", None)
    try:
        with pytest.raises(ParserError, match="parse_function_call"):
            await down.parse(call("bash", "{}"), TOOLS)
    finally:
        await down.close()


def _fake_sglang(monkeypatch) -> dict[str, Any]:
    """A stand-in for sglang's parser modules (sglang is not installed here)."""
    seen: dict[str, Any] = {}

    class Function:
        def __init__(self, name: str, **kw: Any) -> None:
            self.name = name

    class Tool:
        def __init__(self, type: str, function: Function) -> None:
            self.function = function

    class Item:
        def __init__(self, name: str, parameters: str) -> None:
            self.name, self.parameters, self.tool_index = name, parameters, 0

    class FunctionCallParser:
        def __init__(self, tools: list[Tool], tool_call_parser: str) -> None:
            seen["tools"] = [t.function.name for t in tools]
            seen["tool_call_parser"] = tool_call_parser
            self._builtin = BuiltinParser("qwen25", None)

        def has_tool_call(self, text: str) -> bool:
            return "<tool_call>" in text

        def parse_non_stream(self, text: str) -> tuple[str, list[Item]]:
            parsed = self._builtin.parse_sync(text, None)
            import json

            return parsed.text, [Item(c.name, json.dumps(c.arguments)) for c in parsed.tool_calls]

    class ReasoningParser:
        def __init__(self, model_type: str, stream_reasoning: bool = True, **kw: Any) -> None:
            seen["reasoning"] = (model_type, stream_reasoning, kw)
            self._force = kw.get("force_reasoning", False)

        def parse_non_stream(self, text: str) -> tuple[str, str]:
            reasoning, rest = split_reasoning(text, force_reasoning=self._force)
            return reasoning or "", rest

    modules = {
        "sglang": types.ModuleType("sglang"),
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.entrypoints": types.ModuleType("sglang.srt.entrypoints"),
        "sglang.srt.entrypoints.openai": types.ModuleType("sglang.srt.entrypoints.openai"),
        "sglang.srt.entrypoints.openai.protocol": types.ModuleType("p"),
        "sglang.srt.function_call": types.ModuleType("sglang.srt.function_call"),
        "sglang.srt.function_call.function_call_parser": types.ModuleType("f"),
        "sglang.srt.parser": types.ModuleType("sglang.srt.parser"),
        "sglang.srt.parser.reasoning_parser": types.ModuleType("r"),
    }
    modules["sglang.srt.entrypoints.openai.protocol"].Tool = Tool  # type: ignore[attr-defined]
    modules["sglang.srt.entrypoints.openai.protocol"].Function = Function  # type: ignore[attr-defined]
    modules["sglang.srt.function_call.function_call_parser"].FunctionCallParser = FunctionCallParser  # type: ignore[attr-defined]
    modules["sglang.srt.parser.reasoning_parser"].ReasoningParser = ReasoningParser  # type: ignore[attr-defined]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return seen


async def test_sglang_backend_through_its_api(monkeypatch) -> None:
    seen = _fake_sglang(monkeypatch)
    parser = make_parser("qwen25", "qwen3", backend="auto", force_reasoning=True)
    assert isinstance(parser, SglangParser)
    out = await parser.parse("plan</think>Go.\n" + call("bash", '{"cmd": "ls"}'), TOOLS)
    assert out == ParsedOutput("plan", "Go.", [ToolCall("bash", {"cmd": "ls"})])
    assert seen["tools"] == ["bash", "read_file"] and seen["tool_call_parser"] == "qwen25"
    assert seen["reasoning"] == ("qwen3", False, {"force_reasoning": True})


def test_sglang_backend_missing_says_what_to_use(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match="use backend 'builtin' or 'http'"):
        make_parser("qwen25", None, backend="sglang")
    assert isinstance(make_parser("qwen25", None, backend="auto"), BuiltinParser)
