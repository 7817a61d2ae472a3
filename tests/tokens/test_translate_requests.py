"""Anthropic Messages body -> ChatRequest: what is accepted, and every refusal names its field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from recorder.dialects.chat import InvalidRequest, find_dispatches, message_digest, same_message
from recorder.dialects.parse_cache import ParseCache
from recorder.dialects.translate import parse_request, response_message_digest
from tests.tokens.chat_builders import load_test_tokenizer


def _body(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    body.update(over)
    return body


def _msgs(*messages: dict[str, Any]) -> dict[str, Any]:
    return _body(messages=list(messages))


_TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}


def _with_tool_use(*user_blocks: dict[str, Any]) -> dict[str, Any]:
    return _msgs(
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [_TOOL_USE]},
        {"role": "user", "content": list(user_blocks)},
    )


MALFORMED: list[tuple[str, bytes | dict[str, Any] | list[Any], str, str]] = [
    ("truncated json", b'{"model": "m", "max_tokens": 5, ', "body", "not valid JSON"),
    ("not json at all", b"hello", "body", "not valid JSON"),
    ("empty body", b"", "body", "not valid JSON"),
    ("invalid utf-8", b'{"model": "m\xff\xfe", "max_tokens": 5, "messages": []}', "body", "UTF-8"),
    ("lone surrogate escape", b'{"model": "\\ud800", "messages": []}', "body", "not valid JSON"),
    ("top level array", [], "body", "object"),
    ("top level string", b'"x"', "body", "object"),
    ("missing messages", {"model": "m", "max_tokens": 5}, "messages", "field required"),
    (
        "missing max_tokens",
        {"model": "m", "messages": [{"role": "user", "content": "x"}]},
        "max_tokens",
        "field required",
    ),
    ("empty messages", _body(messages=[]), "messages", "at least one"),
    ("messages not a list", _body(messages={"role": "user"}), "messages", "array"),
    ("message not an object", _body(messages=["hi"]), "messages.0", "object"),
    ("bad role", _msgs({"role": "robot", "content": "x"}), "messages.0.role", "robot"),
    ("missing role", _msgs({"content": "x"}), "messages.0.role", "field required"),
    ("missing content", _msgs({"role": "user"}), "messages.0.content", "field required"),
    ("content a number", _msgs({"role": "user", "content": 5}), "messages.0.content", "int"),
    ("empty content list", _msgs({"role": "user", "content": []}), "messages.0.content", "empty"),
    (
        "image block without a source",  # images are served: test_translate_blocks.py
        _msgs({"role": "user", "content": [{"type": "image"}]}),
        "messages.0.content.0.source",
        "field required",
    ),
    (
        "document block",
        _msgs(
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "document", "source": {}}],
            }
        ),
        "messages.0.content.1.type",
        "unsupported block type 'document'",
    ),
    (
        "unknown block type",
        _msgs({"role": "user", "content": [{"type": "hologram"}]}),
        "messages.0.content.0.type",
        "'hologram'",
    ),
    (
        "block without type",
        _msgs({"role": "user", "content": [{"text": "x"}]}),
        "messages.0.content.0.type",
        "field required",
    ),
    (
        "text block without text",
        _msgs({"role": "user", "content": [{"type": "text"}]}),
        "messages.0.content.0.text",
        "field required",
    ),
    (
        "text not a string",
        _msgs({"role": "user", "content": [{"type": "text", "text": 3}]}),
        "messages.0.content.0.text",
        "str",
    ),
    (
        "tool_use input not an object",
        _msgs(
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{**_TOOL_USE, "input": "ls"}]},
            {"role": "user", "content": "x"},
        ),
        "messages.1.content.0.input",
        "object",
    ),
    (
        "tool_use without id",
        _msgs(
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "name": "Bash", "input": {}}]},
            {"role": "user", "content": "x"},
        ),
        "messages.1.content.0.id",
        "field required",
    ),
    (
        "tool_result for unknown id",
        _with_tool_use({"type": "tool_result", "tool_use_id": "toolu_404", "content": "x"}),
        "messages.2.content.0.tool_use_id",
        "toolu_404",
    ),
    (
        "tool_result before its tool_use",
        _msgs({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}),
        "messages.0.content.0.tool_use_id",
        "no tool_use",
    ),
    (
        "tool_result with a document",
        _with_tool_use(
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "document"}]}
        ),
        "messages.2.content.0.content.0.type",
        "unsupported block type 'document'",
    ),
    (
        "tool_result is_error not bool",
        _with_tool_use({"type": "tool_result", "tool_use_id": "toolu_1", "is_error": "yes"}),
        "messages.2.content.0.is_error",
        "bool",
    ),
    (
        "tool_result in assistant message",
        _msgs(
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]},
            {"role": "user", "content": "x"},
        ),
        "messages.1.content.0.type",
        "user messages",
    ),
    (
        "tool_use in user message",
        _msgs({"role": "user", "content": [_TOOL_USE]}),
        "messages.0.content.0.type",
        "assistant messages",
    ),
    (
        "thinking in user message",
        _msgs({"role": "user", "content": [{"type": "thinking", "thinking": "hm"}]}),
        "messages.0.content.0.type",
        "assistant messages",
    ),
    (
        "assistant prefill",
        _msgs({"role": "user", "content": "x"}, {"role": "assistant", "content": "sure"}),
        "messages.1.role",
        "last message",
    ),
    ("negative max_tokens", _body(max_tokens=-5), "max_tokens", ">= 1"),
    ("zero max_tokens", _body(max_tokens=0), "max_tokens", ">= 1"),
    ("max_tokens a string", _body(max_tokens="10"), "max_tokens", "int"),
    ("temperature a string", _body(temperature="hot"), "temperature", "float"),
    ("temperature negative", _body(temperature=-1), "temperature", ">= 0"),
    ("top_p above one", _body(top_p=1.5), "top_p", "<= 1"),
    ("top_k zero", _body(top_k=0), "top_k", ">= 1"),
    ("stop_sequences a string", _body(stop_sequences="END"), "stop_sequences", "array"),
    ("stream not bool", _body(stream="yes"), "stream", "bool"),
    ("system a number", _body(system=7), "system", "int"),
    (
        "system image block",
        _body(system=[{"type": "image"}]),
        "system.0.type",
        "unsupported block type 'image'",
    ),
    (
        "system message with tool_use",
        _msgs({"role": "system", "content": [_TOOL_USE]}, {"role": "user", "content": "x"}),
        "messages.0.content.0.type",
        "text blocks",
    ),
    (
        "tool without input_schema",
        _body(tools=[{"name": "Bash"}]),
        "tools.0.input_schema",
        "field required",
    ),
    ("tool without name", _body(tools=[{"input_schema": {}}]), "tools.0.name", "field required"),
    (
        "tool schema not an object",
        _body(tools=[{"name": "a", "input_schema": []}]),
        "tools.0.input_schema",
        "object",
    ),
    (
        "server tool",
        _body(tools=[{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]),
        "tools.0.type",
        "unsupported tool type",
    ),
    (
        "duplicate tool names",
        _body(tools=[{"name": "a", "input_schema": {}}, {"name": "a", "input_schema": {}}]),
        "tools.1.name",
        "duplicate",
    ),
    (
        "unknown tool_choice",
        _body(tool_choice={"type": "sometimes"}),
        "tool_choice.type",
        "unsupported tool_choice type 'sometimes'",
    ),
    (
        "tool_choice tool without name",
        _body(tool_choice={"type": "tool"}),
        "tool_choice.name",
        "field required",
    ),
    (
        "thinking enabled without budget",
        _body(thinking={"type": "enabled"}),
        "thinking.budget_tokens",
        "field required",
    ),
    (
        "unknown thinking type",
        _body(thinking={"type": "maybe"}),
        "thinking.type",
        "unsupported thinking type 'maybe'",
    ),
    ("metadata a list", _body(metadata=[1]), "metadata", "object"),
]


@pytest.mark.parametrize(
    ("body", "field", "fragment"),
    [pytest.param(b, f, m, id=name) for name, b, f, m in MALFORMED],
)
def test_malformed_request_names_the_field(
    body: bytes | dict[str, Any] | list[Any], field: str, fragment: str
) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(InvalidRequest) as info:
        parse_request(raw)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert fragment in str(info.value)


def test_table_is_big_enough() -> None:
    assert len(MALFORMED) >= 30


def _claude_code_body() -> dict[str, Any]:
    """Shaped like Claude Code 2.1.x: billing header, system role message, cache_control, ..."""
    cache = {"type": "ephemeral"}
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cch=9f3a;"},
            {
                "type": "text",
                "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                "cache_control": cache,
            },
            {"type": "text", "text": "Use the tools to help the user.", "cache_control": cache},
        ],
        "messages": [
            {"role": "system", "content": "Today's date is 2026-01-01."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "fix the bug", "cache_control": cache},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Look first.", "signature": "c2ln"},
                    {"type": "redacted_thinking", "data": "b3BhcXVl"},
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "toolu_01",
                        "name": "Bash",
                        "input": {"command": "ls"},
                        "cache_control": cache,
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01",
                        "content": [{"type": "text", "text": "a.py"}],
                        "cache_control": cache,
                    },
                    {"type": "text", "text": "continue"},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_02",
                        "name": "Bash",
                        "input": {"command": "x"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_02",
                        "content": "boom",
                        "is_error": True,
                    },
                ],
            },
        ],
        "tools": [
            {
                "name": "Bash",
                "description": "Run.",
                "cache_control": cache,
                "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
            },
            {
                "name": "Agent",
                "description": "Subagent.",
                "input_schema": {"type": "object", "properties": {"prompt": {"type": "string"}}},
            },
        ],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "adaptive"},
        "metadata": {"user_id": "user_abc"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
        "output_config": {"effort": "high"},
        "temperature": 1,
    }


def test_claude_code_body_translates() -> None:
    req = parse_request(json.dumps(_claude_code_body()).encode())
    assert req.system == (
        "You are Claude Code, Anthropic's official CLI for Claude.\n\n"
        "Use the tools to help the user."
    )
    assert [m["role"] for m in req.messages] == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
        "user",
        "assistant",
        "tool",
    ]
    assert req.messages[1]["content"] == "Today's date is 2026-01-01."
    assert req.messages[2]["content"] == "<system-reminder>ctx</system-reminder>\n\nfix the bug"
    assistant = req.messages[3]
    assert assistant["reasoning_content"] == "Look first."
    assert assistant["content"] == "Let me look."
    assert assistant["tool_calls"] == [
        {
            "id": "toolu_01",
            "type": "function",
            "function": {"name": "Bash", "arguments": {"command": "ls"}},
        }
    ]
    assert req.messages[4] == {"role": "tool", "tool_call_id": "toolu_01", "content": "a.py"}
    assert req.messages[7]["is_error"] is True
    assert req.tools[0] == {
        "type": "function",
        "function": {
            "name": "Bash",
            "description": "Run.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
    assert "cache_control" not in json.dumps(req.messages) + json.dumps(req.tools)
    assert req.tool_result_ids == ("toolu_02",)
    assert req.thinking == "adaptive"
    assert req.template_kwargs == {"enable_thinking": True}
    assert req.stream is True and req.max_tokens == 32000 and req.temperature == 1.0
    assert req.metadata == {"user_id": "user_abc"}
    assert len(req.message_digests) == len(req.messages)
    assert req.n_input_messages == 6


def test_billing_header_does_not_change_digests() -> None:
    a = _claude_code_body()
    b = _claude_code_body()
    b["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.197; cch=0000;"
    ra, rb = (parse_request(json.dumps(x).encode()) for x in (a, b))
    assert ra.system_digest == rb.system_digest
    assert ra.message_digests == rb.message_digests


def test_string_system_drops_billing_line() -> None:
    req = parse_request(
        json.dumps(_body(system="x-anthropic-billing-header: a=1;\nBe nice.")).encode()
    )
    assert req.system == "Be nice."
    assert req.messages[0] == {"role": "system", "content": "Be nice."}


def test_consecutive_assistant_messages_merge() -> None:
    split = _msgs(
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."}]},
        {"role": "assistant", "content": [_TOOL_USE]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
    )
    whole = _msgs(
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."}, _TOOL_USE]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
    )
    a, b = (parse_request(json.dumps(x).encode()) for x in (split, whole))
    assert a.messages == b.messages
    assert a.message_digests == b.message_digests


def test_sampling_and_tool_choice_fields() -> None:
    req = parse_request(
        json.dumps(
            _body(
                temperature=0.5,
                top_p=0.9,
                top_k=20,
                stop_sequences=["END"],
                tool_choice={"type": "tool", "name": "Bash", "disable_parallel_tool_use": True},
                tools=[{"name": "Bash", "input_schema": {"type": "object"}}],
                thinking={"type": "enabled", "budget_tokens": 2048},
            )
        ).encode()
    )
    assert (req.temperature, req.top_p, req.top_k) == (0.5, 0.9, 20)
    assert req.stop_sequences == ("END",)
    assert (req.tool_choice, req.tool_choice_name, req.disable_parallel_tool_use) == (
        "tool",
        "Bash",
        True,
    )
    assert (req.thinking, req.thinking_budget) == ("enabled", 2048)
    none = parse_request(
        json.dumps(_body(tool_choice={"type": "none"}, thinking={"type": "disabled"})).encode()
    )
    assert none.tool_choice == "none"
    assert none.template_kwargs == {"enable_thinking": False}


def test_count_tokens_body_needs_no_max_tokens() -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    assert parse_request(body, count_tokens=True).max_tokens is None
    with pytest.raises(InvalidRequest):
        parse_request(body)


def test_echo_digest_ignores_whitespace_signature_and_cache_control() -> None:
    sent = [
        {"type": "thinking", "thinking": "plan\n", "signature": "s1"},
        {"type": "text", "text": "Done.\n\n"},
        {"type": "tool_use", "id": "toolu_9", "name": "Bash", "input": {"b": 1, "a": [2]}},
    ]
    echoed = [
        {"type": "thinking", "thinking": "plan", "signature": "other"},
        {"type": "text", "text": "Done.", "cache_control": {"type": "ephemeral"}},
        {"type": "tool_use", "id": "toolu_9", "name": "Bash", "input": {"a": [2], "b": 1}},
    ]
    req = parse_request(
        json.dumps(
            _msgs(
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": echoed},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]},
            )
        ).encode()
    )
    assert req.message_digests[1] == response_message_digest(sent)
    # A call is ours by its id: the client may normalise its input (defaults, key order).
    normalised = [*sent[:2], {**sent[2], "input": {"replace_all": False, "a": [2], "b": 1}}]
    assert response_message_digest(normalised) == response_message_digest(sent)
    changed = [*sent[:2], {**sent[2], "id": "toolu_10"}]
    assert response_message_digest(changed) != response_message_digest(sent)
    assert message_digest({"role": "user", "content": "a"}) != message_digest(
        {"role": "user", "content": "b"}
    )


def test_find_dispatches() -> None:
    content = [
        {"type": "text", "text": "Delegating."},
        {
            "type": "tool_use",
            "id": "toolu_a",
            "name": "Agent",
            "input": {"prompt": "find the bug", "subagent_type": "general"},
        },
        {"type": "tool_use", "id": "toolu_b", "name": "Bash", "input": {"command": "ls"}},
        {"type": "tool_use", "id": "toolu_c", "name": "Task", "input": {}},
    ]
    assert find_dispatches(content) == [("toolu_a", "find the bug"), ("toolu_c", "")]


def test_same_message_tolerates_only_dropped_thinking() -> None:
    with_thinking = response_message_digest(
        [{"type": "thinking", "thinking": "t"}, {"type": "text", "text": "a"}]
    )
    without = response_message_digest([{"type": "text", "text": "a"}])
    other = response_message_digest(
        [{"type": "thinking", "thinking": "u"}, {"type": "text", "text": "a"}]
    )
    assert same_message(with_thinking, without)
    assert same_message(with_thinking, with_thinking)
    assert not same_message(with_thinking, other)
    assert not same_message(without, with_thinking)
    assert not same_message(with_thinking, response_message_digest([{"type": "text", "text": "b"}]))


@pytest.mark.parametrize("text", ["", "plain", "  padded  \n"])
def test_a_string_content_is_the_same_as_one_text_block(text: str) -> None:
    """The short form has its own fast path; it must translate as the block it stands for."""

    def parsed(form: Any) -> Any:
        user = form(text or "x")  # a user message must not be empty
        return parse_request(
            json.dumps(
                _msgs(
                    {"role": "system", "content": form(text)},
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": form(text)},
                    {"role": "user", "content": user},
                )
            ).encode()
        )

    as_string = parsed(lambda t: t)
    as_block = parsed(lambda t: [{"type": "text", "text": t}])
    assert (as_string.messages, as_string.message_digests) == (
        as_block.messages,
        as_block.message_digests,
    )


@pytest.mark.parametrize("empty", [[], "", "  \n", [{"type": "text", "text": ""}]])
def test_an_empty_system_message_is_dropped(empty: Any) -> None:
    """2.1.33x sends `{"role": "system", "content": []}` after /compact: no empty system block.

    The request translates exactly as the one without that message (also through the
    parse cache), so the prompt renders no `<|im_start|>system\\n<|im_end|>`.
    """
    tok = load_test_tokenizer()
    head = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "text", "text": "Summary."}]},
    ]
    tail = [{"role": "user", "content": "go on"}]
    with_empty = json.dumps(_msgs(*head, {"role": "system", "content": empty}, *tail)).encode()
    without = parse_request(json.dumps(_msgs(*head, *tail)).encode())
    for chat in (parse_request(with_empty), parse_request(with_empty, cache=ParseCache())):
        assert (chat.messages, chat.message_digests) == (without.messages, without.message_digests)
        assert all(m["role"] != "system" for m in chat.messages[1:])
    prompt = tok.render(parse_request(with_empty).messages, None, True)
    assert "<|im_start|>system\n<|im_end|>" not in prompt
    assert prompt.count("<|im_start|>system") == 1  # the request's system prompt only


def test_the_same_tools_are_one_set_of_schemas_rendered_as_fresh_ones(tok: Any) -> None:
    """Requests sending the same tools share their schemas (and the template's JSON of
    each); the render is that of schemas built anew, and other tools (the same ones
    in another key order too) are theirs, not the shared ones."""
    tools = [
        {"name": "Read", "description": "Read a file.", "input_schema": {"type": "object",
         "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}}}},
        {"name": "Bash", "input_schema": {"type": "object", "properties": {}}},
    ]  # fmt: skip
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    first = parse_request(json.dumps({**body, "tools": tools}).encode(), cache=ParseCache())
    again = parse_request(json.dumps({**body, "tools": tools}).encode(), cache=ParseCache())
    assert parse_request(json.dumps({**body, "tools": tools}).encode()) == again  # uncached
    assert again.tools == first.tools and again.tools is not first.tools
    assert all(a is b for a, b in zip(again.tools, first.tools, strict=True))
    fresh = json.loads(json.dumps(first.tools))
    for _ in range(2):  # the second render takes the kept JSON
        assert tok.render(again.messages, again.tools) == tok.render(again.messages, fresh)
    reordered = [{**tools[0], "input_schema": {"properties": tools[0]["input_schema"][
        "properties"], "type": "object"}}, tools[1]]  # fmt: skip
    other = parse_request(json.dumps({**body, "tools": reordered}).encode(), cache=ParseCache())
    assert other.render_digest == first.render_digest  # digests sort keys; renders do not
    text = tok.render(other.messages, other.tools)
    assert text == tok.render(other.messages, json.loads(json.dumps(other.tools)))
    assert text != tok.render(first.messages, first.tools)
