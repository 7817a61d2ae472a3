"""Request bodies whose bulk sits in one field, one builder per field kind.

The early length check once counted only user, tool-result and system text:
63 MB of assistant text then cost 6.8 GB and 17 s before its 400 (issue 24).
Every field a client can fill is here, in both dialects, so tests and
`tools/bench_big_body.py` attack each the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

ANTHROPIC = "/v1/messages"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"

_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}}


def filler(n_chars: int) -> str:
    """`n_chars` of prose-like text (~5 characters a token)."""
    unit = "the quick brown fox jumps over a lazy dog; "
    return (unit * (n_chars // len(unit) + 1))[:n_chars]


def _anthropic(messages: list[Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "messages": messages, **extra}


def _tool_turn(call: dict[str, Any], result: Any = "ok") -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": [call]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": result}],
        },
    ]


def _anthropic_kinds(text: str) -> dict[str, dict[str, Any]]:
    bash = {"name": "Bash", "description": "Run a command.", "input_schema": _SCHEMA}
    use = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}
    return {
        "user text": _anthropic([{"role": "user", "content": text}]),
        "assistant text": _anthropic(
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": text},
                {"role": "user", "content": "go on"},
            ]
        ),
        "thinking": _anthropic(
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": text, "signature": "sig"},
                        {"type": "text", "text": "ok"},
                    ],
                },
                {"role": "user", "content": "go on"},
            ]
        ),
        "tool_use input": _anthropic(_tool_turn({**use, "input": {"command": text}}), tools=[bash]),
        "tools description": _anthropic(
            [{"role": "user", "content": "hi"}], tools=[{**bash, "description": text}]
        ),
        "tools input_schema": _anthropic(
            [{"role": "user", "content": "hi"}],
            tools=[
                {
                    **bash,
                    "input_schema": {
                        "type": "object",
                        "properties": {"command": {"type": "string", "description": text}},
                    },
                }
            ],
        ),
        "system": _anthropic(
            [{"role": "user", "content": "hi"}], system=[{"type": "text", "text": text}]
        ),
        "tool_result list": _anthropic(
            _tool_turn(use, [{"type": "text", "text": text}]), tools=[bash]
        ),
    }


def _openai_kinds(text: str) -> dict[str, dict[str, Any]]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "Bash", "arguments": json.dumps({"command": text})},
    }
    return {
        "chat assistant": {
            "model": "m",
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": text},
                {"role": "user", "content": "go on"},
            ],
        },
        "chat tool arguments": {
            "model": "m",
            "max_tokens": 8,
            "tools": [{"type": "function", "function": {"name": "Bash", "parameters": _SCHEMA}}],
            "messages": [
                {"role": "user", "content": "run it"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
            ],
        },
        "responses input": {
            "model": "m",
            "max_output_tokens": 16,
            "input": [
                {"role": "user", "content": "hi"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text}],
                },
                {"role": "user", "content": "go on"},
            ],
        },
    }


_ROUTES = {"chat assistant": CHAT, "chat tool arguments": CHAT, "responses input": RESPONSES}
KINDS: tuple[str, ...] = (*_anthropic_kinds(""), *_openai_kinds(""))


def bulk_body(
    kind: str, n_chars: int, make_text: Callable[[int], str] = filler
) -> tuple[str, bytes]:
    """(route, JSON body) with `n_chars` of text in the field `kind` names."""
    text = make_text(n_chars)
    bodies = {**_anthropic_kinds(text), **_openai_kinds(text)}
    return _ROUTES.get(kind, ANTHROPIC), json.dumps(bodies[kind]).encode()
