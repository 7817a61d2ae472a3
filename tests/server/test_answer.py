"""The pure answer builder: content blocks, stop reasons, usage, SSE event order."""

from __future__ import annotations

import json

import pytest

from recorder.dialects.answer import (
    Answer,
    ToolCallOut,
    build_content,
    content_events,
    message_json,
    message_start_event,
    split_stop_sequence,
    stop_reason_for,
    thinking_signature,
    usage_for,
)
from recorder.dialects.sse import encode_sse


@pytest.mark.parametrize(
    ("finish", "tools", "stop_seq", "expected"),
    [
        ("stop", False, None, "end_turn"),
        ("stop", True, None, "tool_use"),
        ("length", False, None, "max_tokens"),
        ("length", True, None, "tool_use"),
        ("stop", False, "###", "stop_sequence"),
        ("unknown", False, None, "end_turn"),
    ],
)
def test_stop_reason(finish: str, tools: bool, stop_seq: str | None, expected: str) -> None:
    assert stop_reason_for(finish, has_tool_calls=tools, stop_sequence=stop_seq) == expected


def test_split_stop_sequence_prefers_the_longest_match() -> None:
    assert split_stop_sequence("abc END", ["END", " END"]) == ("abc", " END")
    assert split_stop_sequence("abc", ["END"]) == ("abc", None)
    assert split_stop_sequence("abc", [""]) == ("abc", None)


def test_split_stop_sequence_cuts_a_match_inside_the_last_token() -> None:
    # The engine reports the matched string; the token that completed it may run on.
    assert split_stop_sequence("abc END.", ["END"], matched="END") == ("abc ", "END")
    assert split_stop_sequence("abc", ["END"], matched="END") == ("abc", None)
    assert split_stop_sequence("abc END", ["END"], matched="151645") == ("abc ", "END")


def test_usage_excludes_cached_tokens_and_never_goes_negative() -> None:
    assert usage_for(1000, 800, 40) == {
        "input_tokens": 200,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 800,
        "output_tokens": 40,
    }
    assert usage_for(10, 50, 1)["input_tokens"] == 0
    assert usage_for(10, -3, 1)["cache_read_input_tokens"] == 0


def test_content_order_and_empty_answer() -> None:
    calls = [ToolCallOut("Bash", {"command": "ls"})]
    blocks = build_content("hmm", "  ", calls, ["toolu_1"])
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"]  # blank text dropped
    assert blocks[0]["signature"] == thinking_signature("hmm")
    assert build_content(None, "", [], []) == [{"type": "text", "text": ""}]
    with pytest.raises(ValueError):
        build_content(None, "", calls, [])  # every call needs an id


def test_sse_sequence_matches_the_json_message() -> None:
    answer = Answer(
        message_id="msg_1",
        model="m",
        content=build_content("think", "hello", [ToolCallOut("Edit", {"path": "a"})], ["toolu_9"]),
        stop_reason="tool_use",
        usage=usage_for(100, 90, 7),
    )
    start = message_start_event(answer.message_id, answer.model, answer.usage)
    events = [start, *content_events(answer)]
    # Rebuild the message from the events the way a client accumulates them.
    message = dict(events[0][1]["message"])
    message["content"] = []
    for name, data in events[1:]:
        if name == "content_block_start":
            message["content"].append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] += delta["signature"]
            elif delta["type"] == "input_json_delta":
                block["input"] = json.loads(delta["partial_json"])
        elif name == "message_delta":
            message["stop_reason"] = data["delta"]["stop_reason"]
            message["stop_sequence"] = data["delta"]["stop_sequence"]
            message["usage"] = data["usage"]
    assert events[-1][0] == "message_stop"
    assert message == message_json(answer)


def test_sse_frame_encoding() -> None:
    frame = encode_sse("ping", {"type": "ping"})
    assert frame == b'event: ping\ndata: {"type":"ping"}\n\n'
