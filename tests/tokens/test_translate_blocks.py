"""Blocks and fields of the newest Claude Code: images, tool search, output formats.

Shapes are taken from real traffic (tests/data/claude_traffic, recorded by
tools/claude_traffic.py); every recorded body must translate.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from recorder.dialects.chat import InvalidRequest
from recorder.dialects.parse_cache import ParseCache
from recorder.dialects.translate import parse_request
from tools.claude_traffic import FIXTURES, load_fixture, tiny_png

PNG_B64 = base64.b64encode(tiny_png()).decode()
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}
BASH = {"name": "Bash", "description": "Run.", "input_schema": {"type": "object"}}
NOTEBOOK = {
    "name": "NotebookEdit",
    "description": "Edit a notebook cell.",
    "input_schema": {"type": "object", "properties": {"cell": {"type": "integer"}}},
    "defer_loading": True,
}
SEARCH = {"type": "tool_use", "id": "toolu_s", "name": "ToolSearch", "input": {"query": "nb"}}


def _body(messages: list[dict[str, Any]], **over: Any) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 64, "messages": messages, **over}).encode()


def _searched(result: list[dict[str, Any]], tools: list[dict[str, Any]]) -> bytes:
    return _body(
        [
            {"role": "user", "content": "find the notebook tool"},
            {"role": "assistant", "content": [SEARCH]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_s", "content": result}],
            },
        ],
        tools=tools,
    )


def test_image_in_user_message_and_tool_result_is_a_text_placeholder() -> None:
    chat = parse_request(
        _body(
            [
                {"role": "user", "content": [{"type": "text", "text": "look"}, IMAGE]},
                {"role": "assistant", "content": [{**SEARCH, "name": "Read"}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_s", "content": [IMAGE]}
                    ],
                },
            ]
        )
    )
    user, tool = chat.messages[0]["content"], chat.messages[2]["content"]
    assert user.startswith("look\n\n[image: image/png, ") and "sha256 " in user
    assert tool == user.removeprefix("look\n\n")
    # The README's example, exactly (the placeholder is documented there).
    assert (
        tool
        == "[image: image/png, 73 bytes, sha256 2f591ddb8e30; not shown, the model reads text only]"
    )
    assert tool.endswith("not shown, the model reads text only]")
    other = {**IMAGE, "source": {**IMAGE["source"], "data": PNG_B64[:-8] + "AAAAAAA="}}
    changed = parse_request(_body([{"role": "user", "content": [other]}]))
    assert changed.messages[0]["content"] != tool  # another image is another message


def test_image_from_url_and_file() -> None:
    url = {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}
    chat = parse_request(_body([{"role": "user", "content": [url]}]))
    assert (
        chat.messages[0]["content"]
        == "[image: https://x/y.png; not shown, the model reads text only]"
    )


def test_tool_reference_loads_the_deferred_tool_where_the_model_meets_it() -> None:
    tools = [BASH, NOTEBOOK]
    before = parse_request(_body([{"role": "user", "content": "hi"}], tools=tools))
    assert [t["function"]["name"] for t in before.tools] == ["Bash"]  # deferred: not listed
    chat = parse_request(
        _searched([{"type": "tool_reference", "tool_name": "NotebookEdit"}], tools)
    )
    tool = chat.messages[-1]
    assert tool["role"] == "tool" and "tool_references" not in tool
    schema = json.dumps(
        {
            "type": "function",
            "function": {
                "name": "NotebookEdit",
                "description": "Edit a notebook cell.",
                "parameters": NOTEBOOK["input_schema"],
            },
        }
    )
    assert tool["content"] == f"<tools>\n{schema}\n</tools>"
    # Claude Code adds a tool to `tools` once loaded: the prefix renders the same.
    assert chat.render_digest == before.render_digest
    assert parse_request(
        _body([{"role": "user", "content": "hi"}], tools=[BASH])
    ).render_digest == (before.render_digest)
    # What the model saw of the loaded tool is in the message's digest.
    changed = [BASH, {**NOTEBOOK, "description": "Edit a cell."}]
    ref = [{"type": "tool_reference", "tool_name": "NotebookEdit"}]
    assert parse_request(_searched(ref, changed)).message_digests[-1] != chat.message_digests[-1]
    assert parse_request(_searched(ref, changed)).message_digests[:-1] == chat.message_digests[:-1]


def test_tool_reference_through_the_parse_cache_is_the_same() -> None:
    body = _searched([{"type": "tool_reference", "tool_name": "NotebookEdit"}], [BASH, NOTEBOOK])
    cache = ParseCache()
    assert parse_request(body, cache=cache) == parse_request(body)
    assert parse_request(body, cache=cache) == parse_request(body)  # from the cache


def test_tool_reference_to_an_undeclared_tool_is_refused() -> None:
    with pytest.raises(InvalidRequest, match=r"^tools: tool_reference to 'Nope'"):
        parse_request(_searched([{"type": "tool_reference", "tool_name": "Nope"}], [BASH]))


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_output_format_becomes_the_json_schema(field: str) -> None:
    schema = {"type": "object", "properties": {"title": {"type": "string"}}}
    fmt = {"type": "json_schema", "schema": schema}
    value = {"effort": "high", "format": fmt} if field == "output_config" else fmt
    chat = parse_request(_body([{"role": "user", "content": "t"}], **{field: value}))
    assert chat.json_schema == schema
    plain = parse_request(_body([{"role": "user", "content": "t"}], output_config={"effort": "x"}))
    assert plain.json_schema is None


def test_an_output_format_the_engine_cannot_follow_is_refused() -> None:
    bad = {"format": {"type": "regex", "pattern": "a+"}}
    with pytest.raises(InvalidRequest, match=r"^output_config\.format\.type: unsupported"):
        parse_request(_body([{"role": "user", "content": "t"}], output_config=bad))


def _fixture_files() -> list[tuple[str, str]]:
    return sorted((p.parent.name, p.name.removesuffix(".json.gz")) for p in FIXTURES.glob("*/*.gz"))


@pytest.mark.parametrize(("version", "scenario"), _fixture_files())
def test_every_recorded_claude_code_body_translates(version: str, scenario: str) -> None:
    records = load_fixture(version, scenario)
    requests = [r for r in records if r["path"].startswith("/v1/messages")]
    assert requests, "the fixture holds no Messages request"
    cache = ParseCache()
    for r in requests:
        raw, count = json.dumps(r["body"]).encode(), "/count_tokens" in r["path"]
        assert parse_request(raw, cache=cache, count_tokens=count) == parse_request(
            raw, count_tokens=count
        )


def test_a_loaded_deferred_tool_is_callable_and_an_unloaded_one_is_not() -> None:
    """The parser's tools: listed ones, plus deferred ones a tool_reference loaded (once)."""
    tools = [BASH, NOTEBOOK, {**NOTEBOOK, "name": "CronList"}]
    ref = [{"type": "tool_reference", "tool_name": "NotebookEdit"}]
    chat = parse_request(_searched([*ref, *ref], tools))
    assert [t["function"]["name"] for t in chat.tools] == ["Bash"]
    assert [t["function"]["name"] for t in chat.callable_tools] == ["Bash", "NotebookEdit"]
    plain = parse_request(_searched([{"type": "text", "text": "none found"}], tools))
    assert [t["function"]["name"] for t in plain.callable_tools] == ["Bash"]
    # A reference to a listed tool loads nothing new.
    listed = parse_request(_searched([{"type": "tool_reference", "tool_name": "Bash"}], tools))
    assert [t["function"]["name"] for t in listed.callable_tools] == ["Bash"]
