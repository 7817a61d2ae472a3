"""Output parsers without SGLang: the built-in backend, the engine's HTTP parsers, the policy,
parser names at startup. Real SGLang is tested in test_sglang_parsers.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from recorder.model.parse_policy import opened_calls, settle_calls, settle_reasoning
from recorder.model.parsers import (
    SGLANG_REASONING_PARSERS,
    SGLANG_TOOL_PARSERS,
    HttpParser,
    ParsedOutput,
    ParserError,
    ToolCall,
    check_parser_names,
    make_parser,
    prefills_reasoning,
    split_reasoning_for,
)
from recorder.model.tokenizer import load_tokenizer
from recorder.server.commands import serve
from tests.conftest import REPO
from tools.test_engine import ScriptedEngine, free_port

from .conftest import FIXTURE_TOKENIZER
from .parser_corpus import FAMILIES, TOOLS, corpus

BUILTIN_FAMILIES = [f for f in FAMILIES.values() if f.builtin]


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


@pytest.mark.parametrize(
    ("name", "text", "force", "expected"),
    [
        ("qwen3", "<think>\nplan\n</think>\n\nanswer", False, ("plan", "answer")),
        ("qwen3", "plain answer", False, (None, "plain answer")),
        ("qwen3", "plan\n</think>\n\nanswer", True, ("plan", "answer")),
        ("qwen3", "still thinking", True, ("still thinking", "")),
        ("qwen3", "<think>\nunfinished", False, ("unfinished", "")),
        # Whitespace and repeated openers at the head of the reasoning go (policy rule 2).
        ("qwen3", "\n<think>a</think>b", False, ("a", "b")),
        # SGLang's rule: a `<think>` anywhere puts the output in reasoning.
        ("qwen3", "text then <think>x</think>", False, ("text then <think>x", "")),
        ("qwen3", "<think>\n\n</think>\n\nok", True, (None, "ok")),
        # A call opening inside unfinished reasoning ends it (qwen3), not for deepseek-r1.
        ("qwen3", "<think>plan\n<tool_call>x", False, ("plan", "<tool_call>x")),
        ("deepseek-r1", "plan\n<tool_call>x", False, ("plan\n<tool_call>x", "")),
        # These two always start inside their reasoning.
        ("qwen3-thinking", "a</think>b", False, ("a", "b")),
        ("deepseek-r1", "plain", False, ("plain", "")),
    ],
)
def test_builtin_reasoning_split(
    name: str, text: str, force: bool, expected: tuple[str | None, str]
) -> None:
    raw, rest = split_reasoning_for(name, text, force_reasoning=force)
    assert settle_reasoning(raw, rest, "<think>", output=text) == expected


@pytest.mark.parametrize("family", BUILTIN_FAMILIES, ids=lambda f: f.tool_parser)
async def test_builtin_corpus(family) -> None:  # type: ignore[no-untyped-def]
    for case in corpus(family):
        parser = make_parser(
            family.tool_parser,
            family.reasoning_parser,
            "builtin",
            force_reasoning=case.force_reasoning,
        )
        assert await parser.parse(case.output, TOOLS) == case.expected, case.name


def test_policy_all_or_nothing_and_arguments() -> None:
    text = call("bash", '{"cmd": "ls"}')
    assert settle_calls("qwen25", text, "", [("bash", '{"cmd": "ls"}')], TOOLS) == (
        "",
        [ToolCall("bash", {"cmd": "ls"})],
    )
    # Arguments written as a JSON string holding an object are that object.
    assert settle_calls("qwen25", text, "", [("bash", '"{\\"cmd\\": 1}"')], TOOLS)[1] == [
        ToolCall("bash", {"cmd": 1})
    ]
    # A parser that found fewer calls than the model opened: everything is text.
    two = text + "\n" + text
    assert settle_calls("qwen25", two, "", [("bash", "{}")], TOOLS) == (two, [])
    # Arguments that are not an object, an undeclared tool, no tools at all.
    assert settle_calls("qwen25", text, "", [("bash", "[1]")], TOOLS) == (text, [])
    assert settle_calls("qwen25", text, "", [("rm", "{}")], TOOLS) == (text, [])
    assert settle_calls("qwen25", text, "", [("bash", "{}")], []) == (text, [])
    assert opened_calls("qwen25", "x " + text + " y") is None
    assert opened_calls("llama3", '{"name": "a"}; {"name": "b"}') == 2
    assert opened_calls("mistral", '[TOOL_CALLS] [{"name": "a"}] trailing') is None
    assert opened_calls("mistral", '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}') == 2


async def test_no_tools_means_no_calls() -> None:
    parser = make_parser("qwen25", None, "builtin")
    text = call("bash", "{}")
    assert await parser.parse(text, []) == ParsedOutput(None, text, [])


def test_parser_names_are_checked_for_every_backend() -> None:
    with pytest.raises(ValueError, match=r"unknown tool parser 'llama3'.*valid: hermes, qwen"):
        make_parser("llama3", None, "builtin")
    with pytest.raises(ValueError, match="unknown reasoning parser 'kimi'"):
        make_parser(None, "kimi", "builtin")
    with pytest.raises(ValueError, match=r"unknown tool parser 'qwen2\.5'.*deepseekv3.*SGLang"):
        make_parser("qwen2.5", None, "http", engine_url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="needs engine_url"):
        make_parser("qwen25", None, "http")
    with pytest.raises(ValueError, match="unknown parser backend"):
        make_parser("qwen25", None, "grpc")  # type: ignore[arg-type]
    for name in SGLANG_TOOL_PARSERS:
        check_parser_names(name, None, "http")
    for name in SGLANG_REASONING_PARSERS:
        check_parser_names(None, name, "sglang")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--tool-parser", "qwen2.5"], "unknown tool parser 'qwen2.5'"),
        (["--reasoning-parser", "qwen-3", "--parser-backend", "builtin"], "valid: deepseek-r1"),
    ],
)
def test_serve_refuses_an_unknown_parser_name_at_startup(args: list[str], needle: str) -> None:
    """Before any engine or store is touched: the engine URL here is never dialled."""
    result = CliRunner().invoke(
        serve,
        [
            "--engine",
            f"http://127.0.0.1:{free_port()}",
            "--tokenizer",
            str(FIXTURE_TOKENIZER),
            *args,
        ],
    )
    assert result.exit_code != 0
    assert needle in result.output


def test_prefills_reasoning_from_templates() -> None:
    think = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template="chatml-tools-think")
    plain = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template="chatml-tools")
    msgs = [{"role": "user", "content": "x"}]
    assert prefills_reasoning(think.render(msgs))
    assert not prefills_reasoning(think.render(msgs, enable_thinking=False))
    assert not prefills_reasoning(plain.render(msgs))


async def test_http_backend_against_test_engine(tokenizer) -> None:  # type: ignore[no-untyped-def]
    async with ScriptedEngine(tokenizer) as engine:
        parser = make_parser("qwen25", "qwen3", "http", engine_url=engine.url)
        assert isinstance(parser, HttpParser)
        try:
            for case in corpus(FAMILIES["qwen25"]):
                if case.force_reasoning:
                    continue  # /separate_reasoning takes no force flag
                assert await parser.parse(case.output, TOOLS) == case.expected, case.name
        finally:
            await parser.close()
    down = HttpParser(f"http://127.0.0.1:{free_port()}", "qwen25", None)
    try:
        with pytest.raises(ParserError, match="parse_function_call"):
            await down.parse(call("bash", "{}"), TOOLS)
    finally:
        await down.close()


def test_a_broken_sglang_install_is_reported_not_crashed_on(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Anything SGLang raises on import (not only ImportError) means 'unavailable', with the fix."""
    broken = tmp_path / "sglang" / "srt" / "function_call"
    broken.mkdir(parents=True)
    (tmp_path / "sglang" / "__init__.py").write_text("raise SystemError('never run')\n")
    (broken / "function_call_parser.py").write_text("raise AttributeError('triton.language')\n")
    code = (
        "from recorder.model import sglang_compat\n"
        "from recorder.model.parsers import default_backend, make_parser\n"
        "assert not sglang_compat.available()\n"
        "assert default_backend() == 'builtin'\n"
        "try:\n"
        "    make_parser('qwen25', None, 'sglang')\n"
        "except sglang_compat.SglangUnavailable as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "AttributeError: triton.language" in out.stdout
    assert "tools/requirements-sglang-cpu.txt" in out.stdout
