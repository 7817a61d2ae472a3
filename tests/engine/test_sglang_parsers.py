"""The `sglang` tier: real SGLang 0.5.23 parsers, every listed family, and the differential test.

Needs SGLang's parser modules (tools/setup.sh installs them): skipped locally
without them, failed under CI.
"""

from __future__ import annotations

import pytest

from recorder.model import sglang_compat
from recorder.model.parsers import (
    SGLANG_REASONING_PARSERS,
    SGLANG_TOOL_PARSERS,
    SGLANG_VERSION,
    BuiltinParser,
    SglangParser,
    default_backend,
    make_parser,
)
from tests.conftest import fresh_python

from .parser_corpus import FAMILIES, TOOLS, Case, Family, corpus

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("sglang_version")]

LISTED = [
    "qwen25", "hermes", "glm45", "glm47", "kimi_k2", "deepseekv3", "qwen3_coder", "llama3",
    "mistral", "gpt-oss",
]  # fmt: skip


def test_the_installed_sglang_is_the_one_our_name_lists_describe(sglang_version: str) -> None:
    assert sglang_version == SGLANG_VERSION
    assert sorted(sglang_compat.tool_parser_names()) == sorted(SGLANG_TOOL_PARSERS)
    assert sorted(sglang_compat.reasoning_parser_names()) == sorted(SGLANG_REASONING_PARSERS)
    assert set(LISTED) <= set(FAMILIES)


def test_parsers_import_without_the_package_init() -> None:
    """In a fresh interpreter: `sglang/__init__` (triton, zmq: not installed here) never runs."""
    code = (
        "import sys\n"
        "from recorder.model.parsers import make_parser\n"
        "make_parser('qwen25', 'qwen3', 'sglang')\n"
        "bad = [m for m in ('triton', 'zmq', 'sglang.srt.utils') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "from recorder.model.parsers import default_backend\n"
        "print(default_backend())\n"
    )
    out = fresh_python(code, timeout=120)
    assert out.strip() == "sglang"


def test_parsers_never_import_torch_and_xgrammar_stays_whole() -> None:
    """In a fresh interpreter: every SGLang parser builds and parses without torch,
    and a server without a reasoning parser never imports transformers.

    xgrammar's `__init__` imports its torch kernels; the lazy package must
    still hand out xgrammar's real objects, each of its exported names, torch
    loading only when a torch module is asked for (the matcher, here last).
    """
    code = (
        "import importlib, sys\n"
        "from recorder.model.parsers import SGLANG_TOOL_PARSERS, SGLANG_REASONING_PARSERS\n"
        "from recorder.model.parsers import make_parser\n"
        "tools = [{'type': 'function', 'function': {'name': 'Read', 'parameters': "
        "{'type': 'object', 'properties': {'path': {'type': 'string'}}}}}]\n"
        'text = \'<think>a</think>b\\n<tool_call>\\n{"name": "Read", '
        '"arguments": {"path": "x"}}\\n</tool_call>\'\n'
        "from recorder.model.parsers import default_backend\n"
        "assert default_backend() == 'sglang'\n"
        "make_parser('qwen25', None, 'sglang').parse_sync(text, tools)\n"
        "assert 'transformers' not in sys.modules, 'no reasoning parser needs transformers'\n"
        "out = make_parser('qwen25', 'qwen3', 'sglang').parse_sync(text, tools)\n"
        "assert [c.name for c in out.tool_calls] == ['Read'], out\n"
        "for name in SGLANG_REASONING_PARSERS:\n"
        "    try:\n"
        "        make_parser(None, name, 'sglang').parse_sync(text, tools)\n"
        "    except ValueError:\n"
        "        pass  # needs the model's template (response_template)\n"
        "for name in SGLANG_TOOL_PARSERS:\n"
        "    try:\n"
        "        make_parser(name, None, 'sglang').parse_sync(text, tools)\n"
        "    except ValueError:\n"
        "        pass\n"
        "assert 'torch' not in sys.modules, 'a parser imported torch'\n"
        "xg = sys.modules['xgrammar']\n"
        "real = importlib.import_module('xgrammar.structural_tag').StructuralTag\n"
        "assert xg.StructuralTag is real\n"
        "names = [n for n in xg.__all__ if n not in ('GrammarMatcher',)]\n"
        "missing = [n for n in names if getattr(xg, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert xg.GrammarMatcher is importlib.import_module('xgrammar.matcher').GrammarMatcher\n"
        "assert 'torch' in sys.modules\n"
    )
    fresh_python(code, timeout=300)


def test_parsers_load_no_module_a_parser_never_uses_and_those_stay_whole() -> None:
    """In a fresh interpreter: the tool-call parsers load neither the openai SDK's client
    nor `sglang.utils`' requests/IPython/tqdm (~16 MB of a server's RSS), and each lazily
    loaded module is the real one when something uses it: the protocol's validator
    helper runs SGLang's own function, the SDK builds a client."""
    code = (
        "import sys\n"
        "from recorder.model.parsers import make_parser\n"
        "tools = [{'type': 'function', 'function': {'name': 'Read', 'parameters': "
        "{'type': 'object', 'properties': {'path': {'type': 'string'}}}}}]\n"
        'text = \'<tool_call>\\n{"name": "Read", "arguments": {"path": "x"}}\\n</tool_call>\'\n'
        "out = make_parser('qwen25', None, 'sglang').parse_sync(text, tools)\n"
        "assert [c.name for c in out.tool_calls] == ['Read'], out\n"
        "heavy = ('requests', 'IPython', 'tqdm', 'openai._client', 'openai.resources')\n"
        "loaded = [m for m in heavy if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "protocol = sys.modules['sglang.srt.entrypoints.openai.protocol']\n"
        "assert protocol.convert_json_schema_to_str({'a': 1}) == '{\"a\": 1}'\n"
        "assert 'requests' in sys.modules  # the real sglang.utils ran\n"
        "import openai\n"
        "from openai import OpenAI\n"
        "from openai.types.responses import Response\n"
        "import openai.types.responses.response as real\n"
        "assert Response is real.Response and openai.types.responses.Response is Response\n"
        "client = OpenAI(api_key='k', base_url='http://127.0.0.1:9')\n"
        "assert client.responses is not None and openai.__version__\n"
    )
    fresh_python(code, timeout=300)


def test_default_backend_is_sglang_and_says_its_version() -> None:
    assert default_backend() == "sglang"
    parser = make_parser("glm47", "glm45", default_backend())
    assert isinstance(parser, SglangParser)
    assert parser.label == f"sglang {SGLANG_VERSION} tool=glm47 reasoning=glm45"


# Needs the model's response template (checkpoint metadata), which a tokenizer fixture lacks.
NEEDS_MODEL_METADATA = {"response_template"}


@pytest.mark.parametrize("name", SGLANG_TOOL_PARSERS)
def test_every_tool_parser_name_sglang_offers_builds_and_parses(name: str) -> None:
    if name in NEEDS_MODEL_METADATA:
        with pytest.raises(ValueError, match="SGLang cannot build the parser 'response_template'"):
            SglangParser(name, None)
        return
    parser = SglangParser(name, None)
    out = parser.parse_sync("Just text, no call.", TOOLS)
    assert out.tool_calls == [] and out.text == "Just text, no call."


@pytest.mark.parametrize("name", SGLANG_REASONING_PARSERS)
def test_every_reasoning_parser_name_sglang_offers_builds_and_parses(name: str) -> None:
    if name in NEEDS_MODEL_METADATA:
        with pytest.raises(ValueError, match="SGLang cannot build the parser"):
            SglangParser(None, name)
        return
    out = SglangParser(None, name).parse_sync("Just text.", [])
    # Never lost, wherever it lands (minimax-append-think adds its `<think>` by design).
    assert "Just text." in (out.reasoning or "") + out.text


def _cases(families: list[Family]) -> list[tuple[Family, Case]]:
    return [(f, c) for f in families for c in corpus(f)]


@pytest.mark.parametrize(
    ("family", "case"),
    _cases([FAMILIES[n] for n in LISTED]),
    ids=lambda x: x.tool_parser if isinstance(x, Family) else x.name,
)
def test_corpus_on_sglang(family: Family, case: Case) -> None:
    parser = SglangParser(
        family.tool_parser, family.reasoning_parser, force_reasoning=case.force_reasoning
    )
    assert parser.parse_sync(case.output, TOOLS) == case.expected


# Outputs where the two backends' raw splits differ (the 13 of the issue's 26 among
# them); the policy must make the answers equal.
TRICKY = [
    "<think>\nplan\n</think>\n\nanswer",
    "\n<think>a</think>b",
    "  <think>a</think>  b  ",
    "text then <think>x</think>",
    "text then <think>x</think> more",
    "<think>a</think>b</think>c",
    "<think><think>a</think>b",
    "<think>plan\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"cmd\": \"ls\"}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"bash\", \"arguments\": \"{\\\"cmd\\\": \\\"ls\\\"}\"}\n</tool_call>",
    "<tool_call>\n{\"name\": \"bash\", \"parameters\": {\"cmd\": \"ls\"}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"bash\", \"parameters\": {\"cmd\": \"a\"}, \"arguments\": {\"cmd\": \"b\"}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"bash\"}\n</tool_call>",
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
    "<tool_call>\n[1, 2]\n</tool_call>",
    "<tool_call>\n{\"name\": \"bash\", \"arguments\": {}}\n</tool_call> and then text",
    "before\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {}}\n</tool_call>\nbetween\n"
    "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {}}\n</tool_call>",
    "<tool_call>{\"name\": \"bash\", \"arguments\": {}}</tool_call>",
    "<tool_call>\n{\"name\": \"bash\", \"arguments\": {}}\n</tool_call>\n\n\n",
    "no calls at all\n\n",
    "",
    "   ",
]  # fmt: skip


@pytest.mark.parametrize("tool_parser", ["qwen25", "hermes"])
@pytest.mark.parametrize("reasoning_parser", [None, "qwen3", "qwen3-thinking", "deepseek-r1"])
@pytest.mark.parametrize("force", [None, True])
@pytest.mark.parametrize("tools", [TOOLS, []], ids=["tools", "no-tools"])
def test_builtin_and_sglang_answer_alike(
    tool_parser: str, reasoning_parser: str | None, force: bool | None, tools: list
) -> None:
    """The differential test: zero differences under the parse policy."""
    builtin = BuiltinParser(tool_parser, reasoning_parser, force_reasoning=force)
    sglang = SglangParser(tool_parser, reasoning_parser, force_reasoning=force)
    outputs = TRICKY + [c.output for f in FAMILIES.values() if f.builtin for c in corpus(f)]
    differences = [
        (text, b, s)
        for text in outputs
        if (b := builtin.parse_sync(text, tools)) != (s := sglang.parse_sync(text, tools))
    ]
    assert differences == []


def test_tool_models_are_built_once_per_tool_dicts_and_again_when_they_change() -> None:
    """A session's tool dicts are shared turn after turn: SGLang's models for them are
    reused; other dicts (a renamed tool) get their own, and the parse sees the change."""
    parser = SglangParser("qwen25", None)
    call = '<tool_call>\n{"name": "grep", "arguments": {"cmd": "x"}}\n</tool_call>'
    first = parser._sglang_tools(TOOLS)
    assert parser._sglang_tools(list(TOOLS)) is first  # a new list of the same dicts
    assert parser.parse_sync(call, TOOLS).tool_calls == []  # no tool named grep
    renamed = [dict(TOOLS[0], name="grep"), *TOOLS[1:]]
    assert parser._sglang_tools(renamed) is not first
    assert [c.name for c in parser.parse_sync(call, renamed).tool_calls] == ["grep"]
    assert parser.parse_sync(call, TOOLS).tool_calls == []
