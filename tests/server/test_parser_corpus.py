"""The parser corpus through the recorder: the content blocks an agent gets, JSON and SSE.

For each listed family the scripted engine answers with the case's output; the
recorder parses it with SGLang in-process (and with the built-in parser where
it knows the format) and the agent, the official SDK, must read the blocks the
policy promises, streamed or not. The log says which parser answered.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from recorder.log import events as ev
from recorder.model.parsers import make_parser
from recorder.model.tokenizer import Tokenizer
from replay.show import describe
from tests.engine.parser_corpus import FAMILIES, LS, TOOLS, Family, anthropic_blocks, corpus
from tools.test_engine.scripted import Reply

from .conftest import Harness, make_harness

LISTED = [
    "qwen25", "hermes", "glm45", "glm47", "kimi_k2", "deepseekv3", "qwen3_coder", "llama3",
    "mistral", "gpt-oss",
]  # fmt: skip
RUNS = [(name, "sglang") for name in LISTED] + [
    (f.tool_parser, "builtin") for f in FAMILIES.values() if f.builtin
]


@pytest.fixture
async def family_harness(
    request: pytest.FixtureRequest, tokenizer: Tokenizer, sqlite_url: str
) -> AsyncIterator[tuple[Harness, Family]]:
    name, backend = request.param
    if backend == "sglang":
        request.getfixturevalue("sglang_version")  # skip locally / fail in CI without SGLang
    family = FAMILIES[name]
    parser = make_parser(family.tool_parser, family.reasoning_parser, backend)
    h = await make_harness(tokenizer, sqlite_url, parser=parser)
    try:
        yield h, family
    finally:
        await h.close()


def _blocks(message: Any) -> list[dict[str, Any]]:
    out = []
    for block in message.content:
        if block.type == "thinking":
            out.append({"type": "thinking", "thinking": block.thinking})
        elif block.type == "text":
            out.append({"type": "text", "text": block.text})
        else:
            out.append({"type": "tool_use", "name": block.name, "input": block.input})
    return out


@pytest.mark.sglang
@pytest.mark.parametrize("family_harness", RUNS, indirect=True, ids=lambda r: "-".join(r))
async def test_corpus_blocks_json_and_sse(family_harness: tuple[Harness, Family]) -> None:
    h, family = family_harness
    cases = [c for c in corpus(family) if not c.force_reasoning]  # chatml-tools pre-fills nothing
    session = await h.open_session()
    client = h.client(session)
    for case in cases:
        for stream in (False, True):
            marker = f"[{case.name} {stream}]"
            h.engine.push(Reply(text=case.output, match=marker))
            kw: dict[str, Any] = {
                "model": "m",
                "max_tokens": 512,
                "tools": TOOLS,
                "messages": [{"role": "user", "content": marker}],
                # Thinking blocks come back only when asked for, as with the real API.
                "thinking": {"type": "enabled", "budget_tokens": 1024},
            }
            if stream:
                async with client.messages.stream(**kw) as s:
                    message = await s.get_final_message()
            else:
                message = await client.messages.create(**kw)
            expected = anthropic_blocks(case.expected)
            assert _blocks(message) == expected, marker
            wants_tools = bool(case.expected.tool_calls)
            assert message.stop_reason == ("tool_use" if wants_tools else "end_turn"), marker
    sent = await h.payloads(session, ev.ResponseSent)
    assert len(sent) == 2 * len(cases)
    label = h.parser.label
    assert {s.parser for s in sent} == {label}
    assert label.startswith(("sglang 0.5.23 ", "builtin ")) and family.tool_parser in label
    assert f"parser {label}" in describe(sent[0])


async def test_the_parser_gets_the_whole_output_decoded_from_whole_tokens(
    tokenizer: Tokenizer, sqlite_url: str
) -> None:
    """The recorder parses once, after generation, the decode of every output token but
    EOS: no detector ever sees a special token split across character slices."""
    inner = make_parser("qwen25", "qwen3", "builtin")
    seen: list[str] = []

    class Recording:
        label = inner.label

        async def parse(self, text: str, tools: list[dict[str, Any]]) -> Any:
            seen.append(text)
            return await inner.parse(text, tools)

    h = await make_harness(tokenizer, sqlite_url, parser=Recording())
    try:
        output = FAMILIES["kimi_k2"].wrap([FAMILIES["kimi_k2"].call(LS)]) + " ok"
        h.engine.push(Reply(text=output, match="go"))
        session = await h.open_session()
        await h.client(session).messages.create(
            model="m", max_tokens=256, tools=TOOLS, messages=[{"role": "user", "content": "go"}]
        )
        (result,) = await h.payloads(session, ev.GenerateResult)
        ids = await h.array(result.output_ids)
        assert ids[-1] in tokenizer.eos_token_ids
        assert seen == [tokenizer.decode(ids[:-1])] == [output]
    finally:
        await h.close()
