"""The HTTP side of a benchmark: the admin API, request headers, streamed answers read back.

Raw aiohttp with pre-encoded bodies, so no client-side SDK work is timed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from tools.benchkit.conversation import Conversation

MESSAGES_PATH = "/v1/messages?beta=true"


def admin_headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def messages_headers(session_id: str) -> dict[str, str]:
    """What the Anthropic SDK sends with a session's key as its API key."""
    return {
        "x-api-key": session_id,
        "anthropic-version": "2023-06-01",
        "content-type": "application/json",
    }


async def open_session(
    http: aiohttp.ClientSession, url: str, token: str, metadata: dict[str, Any] | None = None
) -> str:
    """`POST /sessions` on the recorder at `url`; the new session's id (its API key)."""
    body = {} if metadata is None else metadata
    async with http.post(url + "/sessions", json=body, headers=admin_headers(token)) as resp:
        data = await resp.json()
        if resp.status != 201:
            raise RuntimeError(f"could not open a session: {resp.status} {data}")
    return str(data["session_id"])


async def close_session(
    http: aiohttp.ClientSession, url: str, token: str, session_id: str, body: dict[str, Any]
) -> None:
    """`POST /sessions/{id}/close`; raises unless the recorder closed it."""
    path = f"{url}/sessions/{session_id}/close"
    async with http.post(path, json=body, headers=admin_headers(token)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"close failed: {resp.status} {await resp.text()}")


async def wait_healthy(
    http: aiohttp.ClientSession,
    url: str,
    exited: Callable[[], int | None],
    what: str,
    timeout_s: float = 120,
    path: str = "/health",
) -> None:
    """Poll `GET path` until 200; `exited()` returns a return code once the process died."""
    for _ in range(int(timeout_s * 10)):
        code = exited()
        if code is not None:
            raise RuntimeError(f"{what} exited with code {code}")
        try:
            async with http.get(url + path) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{what} did not become healthy in {timeout_s:g} s")


@dataclass(frozen=True)
class Answered:
    """One turn as the client saw it: wall interval (perf_counter) and the parsed answer."""

    started: float
    ended: float
    request_id: str
    content: list[dict[str, Any]]
    usage: dict[str, int]


async def take_turn(
    http: aiohttp.ClientSession,
    url: str,
    session_id: str,
    conversation: Conversation,
    tool_result_words: int | None,
    dialect: str = "anthropic",
) -> Answered:
    """Answer the last tool call (if any), send the whole conversation as a streamed
    request (Messages, or its Chat Completions twin), and add the answer to it."""
    if tool_result_words is not None:
        conversation.add_tool_result(tool_result_words)
    body, path = conversation.body(), MESSAGES_PATH
    headers = messages_headers(session_id)
    if dialect == "openai-chat":
        body, path = chat_body(body), "/v1/chat/completions"
        headers = {"authorization": f"Bearer {session_id}", **headers}
    started = time.perf_counter()
    async with http.post(url + path, data=body, headers=headers) as resp:
        raw = await resp.read()
        status = resp.status
    ended = time.perf_counter()
    if status != 200:
        raise RuntimeError(f"turn failed with HTTP {status}: {raw[:500]!r}")
    parse = parse_sse if dialect == "anthropic" else parse_chat_sse
    request_id, content, usage = parse(raw)
    conversation.add_answer(content)
    return Answered(started, ended, request_id, content, usage)


def parse_sse(raw: bytes) -> tuple[str, list[dict[str, Any]], dict[str, int]]:
    """(message id, content blocks, final usage) of a streamed Messages answer."""
    message_id, usage = "", {}
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, list[str]] = {}
    for frame in raw.decode().split("\n\n"):
        data = next((line[6:] for line in frame.split("\n") if line.startswith("data: ")), None)
        if data is None:
            continue
        event = json.loads(data)
        kind = event["type"]
        if kind == "message_start":
            message_id = event["message"]["id"]
        elif kind == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
            partial[event["index"]] = []
        elif kind == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]].append(delta["partial_json"])
        elif kind == "message_delta":
            usage = event.get("usage", {})
        elif kind == "error":
            raise RuntimeError(f"the stream failed: {event}")
    for index, block in blocks.items():
        if block["type"] == "tool_use" and partial[index]:
            block["input"] = json.loads("".join(partial[index]))
    return message_id, [blocks[i] for i in sorted(blocks)], usage


def chat_body(messages_body: bytes) -> bytes:
    """The same request as Chat Completions (system, tool results as `tool` messages)."""
    req = json.loads(messages_body)
    system = "\n\n".join(
        b["text"] for b in req["system"] if not b["text"].startswith("x-anthropic-billing-header")
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for m in req["messages"]:
        if isinstance(m["content"], str):
            messages.append({"role": m["role"], "content": m["content"]})
        elif m["role"] == "assistant":
            text = "".join(b["text"] for b in m["content"] if b["type"] == "text")
            calls = [
                {
                    "id": b["id"],
                    "type": "function",
                    "function": {"name": b["name"], "arguments": json.dumps(b["input"])},
                }
                for b in m["content"]
                if b["type"] == "tool_use"
            ]
            messages.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        else:
            for b in m["content"]:
                messages.append(
                    {"role": "tool", "tool_call_id": b["tool_use_id"], "content": b["content"]}
                )
    tools = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t["input_schema"],
            },
        }
        for t in req["tools"]
    ]
    chat = {
        "model": req["model"],
        "messages": messages,
        "tools": tools,
        "max_completion_tokens": req["max_tokens"],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(chat).encode()


def parse_chat_sse(raw: bytes) -> tuple[str, list[dict[str, Any]], dict[str, int]]:
    """(id, Anthropic-shaped content blocks, usage) of a streamed Chat Completions answer."""
    message_id, text, usage = "", "", {}
    calls: dict[int, dict[str, Any]] = {}
    for frame in raw.decode().split("\n\n"):
        if not frame.startswith("data: ") or frame == "data: [DONE]":
            continue
        chunk = json.loads(frame[6:])
        if "error" in chunk:
            raise RuntimeError(f"the stream failed: {chunk}")
        message_id = chunk["id"]
        if chunk.get("usage"):
            usage = {"output_tokens": chunk["usage"]["completion_tokens"]}
        for choice in chunk["choices"]:
            delta = choice["delta"]
            text += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                calls[call["index"]] = call
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text.strip() else []
    for i in sorted(calls):
        call = calls[i]
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"]),
            }
        )
    return message_id, blocks, usage
