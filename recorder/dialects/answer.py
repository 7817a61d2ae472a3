"""What one turn says back, in the Anthropic dialect (pure: no I/O).

A turn's engine output becomes content blocks (thinking, text, tool_use), a
stop reason and usage; the same `Answer` is then written either as one JSON
message or as the SSE event sequence, so both paths always agree.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import msgspec

THINKING_SIGNATURE_PREFIX = "trsig1:"


class ToolCallOut(msgspec.Struct, frozen=True):
    name: str
    arguments: dict[str, Any]


class Answer(msgspec.Struct, kw_only=True):
    message_id: str
    model: str
    content: list[dict[str, Any]]
    stop_reason: str
    stop_sequence: str | None = None
    usage: dict[str, int] = {}
    # The model's reasoning when the request did not ask for thinking (recorded, not sent).
    hidden_reasoning: str = ""
    # (token text, logprob) of every output token, when the request asked for them.
    token_logprobs: list[tuple[str, float]] | None = None


# Ids are 24 random hex digits, from the OS's random source: as uuid4().hex[:24]
# was, without building a UUID object per id (two per turn).
def new_message_id() -> str:
    return "msg_" + os.urandom(12).hex()


def new_tool_use_id() -> str:
    return "toolu_" + os.urandom(12).hex()


def thinking_signature(thinking: str) -> str:
    """An opaque signature clients echo back; ours only fingerprints the text."""
    return (
        THINKING_SIGNATURE_PREFIX + hashlib.blake2b(thinking.encode(), digest_size=16).hexdigest()
    )


def build_content(
    reasoning: str | None,
    text: str,
    tool_calls: Sequence[ToolCallOut],
    tool_use_ids: Sequence[str],
) -> list[dict[str, Any]]:
    """Content blocks in the order Anthropic emits them: thinking, text, tool_use."""
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append(
            {"type": "thinking", "thinking": reasoning, "signature": thinking_signature(reasoning)}
        )
    if text.strip() or (not tool_calls and not blocks):
        blocks.append({"type": "text", "text": text})
    for call, tool_id in zip(tool_calls, tool_use_ids, strict=True):
        blocks.append(
            {"type": "tool_use", "id": tool_id, "name": call.name, "input": call.arguments}
        )
    return blocks


def split_stop_sequence(
    text: str, stop_sequences: Sequence[str], *, matched: str | None = None
) -> tuple[str, str | None]:
    """(text before the stop sequence that ended it, that sequence or None).

    The engine keeps the matched stop string in its output (no_stop_trim) so
    the token record stays exact; the client must not see it. The string can
    end inside the last token ("END" in a token "END."), so the engine's
    `matched` string is cut where it stands, not only at the very end.
    """
    if matched and matched in stop_sequences:
        at = text.rfind(matched)
        if at >= 0:
            return text[:at], matched
    for seq in sorted(stop_sequences, key=len, reverse=True):
        if seq and text.endswith(seq):
            return text[: -len(seq)], seq
    return text, None


def stop_reason_for(finish_reason: str, *, has_tool_calls: bool, stop_sequence: str | None) -> str:
    if has_tool_calls:
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def usage_for(input_len: int, cached_tokens: int, output_len: int) -> dict[str, int]:
    """Anthropic usage: `input_tokens` excludes what the engine served from cache."""
    cached = max(0, min(cached_tokens, input_len))
    return {
        "input_tokens": input_len - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_len,
    }


def message_json(answer: Answer) -> dict[str, Any]:
    return {
        "id": answer.message_id,
        "type": "message",
        "role": "assistant",
        "model": answer.model,
        "content": answer.content,
        "stop_reason": answer.stop_reason,
        "stop_sequence": answer.stop_sequence,
        "usage": answer.usage,
    }


def message_start_event(message_id: str, model: str, usage: dict[str, int]) -> tuple[str, Any]:
    start_usage = dict(usage)
    start_usage["output_tokens"] = min(1, start_usage.get("output_tokens", 0))
    return (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": start_usage,
            },
        },
    )


def content_events(answer: Answer) -> list[tuple[str, Any]]:
    """Every event after `message_start`: blocks, `message_delta`, `message_stop`."""
    events: list[tuple[str, Any]] = []
    for index, block in enumerate(answer.content):
        events.extend(_block_events(index, block))
    events.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": answer.stop_reason, "stop_sequence": answer.stop_sequence},
                "usage": answer.usage,
            },
        )
    )
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def _block_events(index: int, block: dict[str, Any]) -> list[tuple[str, Any]]:
    kind = block["type"]
    if kind == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [
            {"type": "thinking_delta", "thinking": block["thinking"]},
            {"type": "signature_delta", "signature": block["signature"]},
        ]
    elif kind == "text":
        start = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": block["text"]}] if block["text"] else []
    elif kind == "tool_use":
        start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
        partial = msgspec.json.encode(block["input"]).decode()
        deltas = [{"type": "input_json_delta", "partial_json": partial}]
    else:
        raise ValueError(f"cannot stream a content block of type {kind!r}")
    events: list[tuple[str, Any]] = [
        (
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": start},
        )
    ]
    events.extend(
        ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})
        for d in deltas
    )
    events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    return events
