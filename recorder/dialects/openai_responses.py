"""OpenAI Responses (`POST /v1/responses`): wire types and the two edges.

Input items map onto Anthropic-shaped messages (consecutive assistant items
merge into one turn in the shared translation, as the API treats them).
`previous_response_id` is resolved from the session's log (`History`): the
earlier request's conversation plus the answer it got, so a stateful client
and a stateless one that re-sends everything splice onto the same chain.
`reasoning` items are not compared (the model's reasoning is ours already).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from recorder.dialects.answer import Answer
from recorder.dialects.anthropic_wire import (
    ContentBlock,
    JsonSchemaFormat,
    Message,
    OutputConfig,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    from_validation_error,
)
from recorder.dialects.base import OPENAI_PING, Dialect, History, openai_error, usage_numbers
from recorder.dialects.chat import ChatRequest, InvalidRequest
from recorder.dialects.errors import ApiError
from recorder.dialects.openai_common import (
    NonEmpty,
    arguments,
    chat_request_from_pieces,
    converted_messages,
    decode,
    encode_message,
    image,
    join_through_cache,
    output_schema,
    to_chat_request,
    tool,
    tool_choice,
)
from recorder.dialects.parse_cache import ParseCache
from recorder.dialects.sse import SseFrame


class Part(msgspec.Struct, kw_only=True):
    """input_text / output_text / refusal carry `text`; input_image an `image_url`."""

    type: str
    text: str | None = None
    image_url: str | None = None


class MessageItem(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(msgspec.Struct, kw_only=True):
    call_id: NonEmpty
    name: NonEmpty
    arguments: str


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    call_id: NonEmpty
    output: str | list[Part]


class ResponsesTool(msgspec.Struct, kw_only=True):
    type: str
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    tools: list[ResponsesTool] | None = None  # a `namespace`'s function tools


# Tools OpenAI's servers run themselves: no model behind this recorder can call
# them, so they are left out of the prompt (the recorded prompt is what the model saw).
HOSTED_TOOLS = frozenset(
    {"web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
     "computer_use_preview", "mcp"}
)  # fmt: skip


class _ResponsesFields(msgspec.Struct, kw_only=True):
    model: str = ""
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class ResponsesRequest(_ResponsesFields, kw_only=True):
    input: str | list[dict[str, Any]]


class _RawResponsesRequest(_ResponsesFields, kw_only=True):
    """The request with its input items left as JSON bytes (the cached path decodes new ones)."""

    input: str | list[msgspec.Raw]


_raw_request_decoder = msgspec.json.Decoder(_RawResponsesRequest)
_item_decoder = msgspec.json.Decoder(dict[str, Any])

_ITEM_TYPES: dict[str, type[Any]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


@dataclass(frozen=True)
class OpenAIResponses:
    """The Responses dialect; `request` echoes the request's settings in the response object."""

    request: dict[str, Any] | None = None
    name: str = "openai-responses"
    ping: bytes | None = OPENAI_PING

    async def parse(
        self, body: bytes, *, cache: ParseCache | None = None, history: History | None = None
    ) -> tuple[ChatRequest, Dialect]:
        req: _ResponsesFields
        chat: ChatRequest | None = None
        if cache is not None:
            try:
                req, chat = await _parse_cached(body, cache, history)
            except (InvalidRequest, msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
                chat = None  # parsed again without the cache, which names the field
        if chat is None:
            req = full = decode(body, ResponsesRequest)
            earlier = await _earlier(full, history)
            messages, index_map, system = conversation(full, earlier)
            fields = {**_fields(full), "system": system or None}
            chat = to_chat_request(fields, messages, index_map, None)
        echo = {
            "previous_response_id": req.previous_response_id,
            "instructions": req.instructions,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "store": req.store,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls,
            "max_output_tokens": req.max_output_tokens,
        }
        return chat, OpenAIResponses(request=echo)

    def message(self, answer: Answer) -> dict[str, Any]:
        return self._response(answer, _status(answer), _output(answer), answer.usage)

    def opening(self, message_id: str, model: str, usage: dict[str, int]) -> SseFrame:
        shell = Answer(message_id=message_id, model=model, content=[], stop_reason="")
        response = self._response(shell, "in_progress", [], None)
        return "response.created", {
            "type": "response.created",
            "sequence_number": 0,
            "response": response,
        }

    def frames(self, answer: Answer) -> list[SseFrame]:
        events: list[tuple[str, dict[str, Any]]] = []
        for index, item in enumerate(_output(answer)):
            events.extend(_item_events(index, item))
        kind = "response.completed" if _status(answer) == "completed" else "response.incomplete"
        final = self._response(answer, _status(answer), _output(answer), answer.usage)
        events.append((kind, {"type": kind, "response": final}))
        return [
            (name, {**data, "sequence_number": n}) for n, (name, data) in enumerate(events, start=1)
        ]

    def error(self, err: ApiError) -> dict[str, Any]:
        return openai_error(err)

    def error_frame(self, err: ApiError) -> SseFrame:
        body = openai_error(err)
        return "error", {"type": "error", **body["error"], "error": body["error"]}

    def _response(
        self,
        answer: Answer,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, int] | None,
    ) -> dict[str, Any]:
        echo = self.request or {}
        return {
            "id": answer.message_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": status,
            "model": answer.model,
            "output": output,
            "usage": None if usage is None else _usage(usage),
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "tool_choice": "auto",
            "tools": [],
            "text": {"format": {"type": "text"}},
            **{k: echo.get(k) for k in ("instructions", "temperature", "top_p")},
            "previous_response_id": echo.get("previous_response_id"),
            "parallel_tool_calls": echo.get("parallel_tool_calls", True),
            "metadata": echo.get("metadata") or {},
            "store": echo.get("store", True),
            "max_output_tokens": echo.get("max_output_tokens"),
        }


OPENAI_RESPONSES = OpenAIResponses()


# --------------------------------------------------------------------------
# Request -> Anthropic-shaped messages
# --------------------------------------------------------------------------


async def _parse_cached(
    body: bytes, cache: ParseCache, history: History | None
) -> tuple[_ResponsesFields, ChatRequest | None]:
    """The request through the session's caches: only input items not seen before are decoded.

    As for Chat Completions (openai_chat._parse_cached): each item's
    Anthropic-shaped JSON is kept by the item's exact bytes, the Anthropic
    body is joined from those pieces, and the shared ParseCache matches them
    by a byte compare. None for a plain-string input (nothing to cache). The
    result is the same as without the caches.
    """
    req = _raw_request_decoder.decode(body)
    if isinstance(req.input, str):
        return req, None
    system, pieces = join_through_cache(
        body,
        req.input,
        "input",
        converted_messages(cache, "openai-responses"),
        lambda key, where: _converted(_item_decoder.decode(key), where),
        system=[req.instructions] if req.instructions else [],
        pieces=[encode_message(m) for m in await _earlier(req, history)],
    )
    fields = {**_fields(req), "system": system}
    return req, chat_request_from_pieces(fields, pieces, cache)


def _converted(raw: dict[str, Any], where: str) -> tuple[str, bytes]:
    """("system", its text), ("message", the Anthropic-shaped JSON) or ("skip", b"")."""
    item = _item(raw, where)
    if item is None:
        return "skip", b""
    if isinstance(item, MessageItem) and item.role in ("system", "developer"):
        return "system", _text(item.content, where).encode()
    return "message", encode_message(_message_of(item, where))


async def _earlier(req: _ResponsesFields, history: History | None) -> list[Message]:
    if req.previous_response_id is None:
        return []
    if history is None:
        raise InvalidRequest("cannot be resolved here", "previous_response_id")
    return await history(req.previous_response_id)


def conversation(
    req: ResponsesRequest, earlier: Sequence[Message]
) -> tuple[list[Message], list[str], str]:
    """(Anthropic-shaped messages, the client's field of each and last `input`, system prompt)."""
    system = [req.instructions] if req.instructions else []
    messages = list(earlier)
    fields = ["previous_response_id"] * len(messages)
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    leading = not messages
    for i, raw in enumerate(items):
        where = f"input.{i}"
        item = _item(raw, where)
        if item is None:
            continue
        if isinstance(item, MessageItem) and item.role in ("system", "developer"):
            text = _text(item.content, where)
            if leading:
                system.append(text)
                continue
            messages.append(Message(role="system", content=text))
        else:
            leading = False
            messages.append(_message_of(item, where))
        fields.append(where)
    fields.append("input")
    return messages, fields, "\n\n".join(system)


def _item(raw: dict[str, Any], where: str) -> Any:
    kind = raw.get("type", "message")
    if kind == "reasoning":
        return None
    struct = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if struct is None:
        raise InvalidRequest(
            f"unsupported input item type {kind!r} (message, function_call, "
            "function_call_output, reasoning)",
            f"{where}.type",
        )
    try:
        return msgspec.convert(raw, struct)
    except msgspec.ValidationError as exc:
        inner = from_validation_error(exc)
        raise InvalidRequest(str(inner)[len(inner.field) + 2 :], f"{where}.{inner.field}") from None


def _text(content: str | list[Part], where: str) -> str:
    if isinstance(content, str):
        return content
    return "\n\n".join(b.text for b in _blocks(content, where) if isinstance(b, TextBlock))


def _blocks(parts: list[Part], where: str) -> list[ContentBlock]:
    out: list[ContentBlock] = []
    for j, part in enumerate(parts):
        if part.type in ("input_text", "output_text", "text", "refusal") and part.text is not None:
            out.append(TextBlock(text=part.text))
        elif part.type == "input_image" and part.image_url:
            out.append(image(part.image_url))
        else:
            raise InvalidRequest(
                f"unsupported content part {part.type!r} (input_text, output_text, input_image "
                "with image_url)",
                f"{where}.content.{j}",
            )
    return out


def _message_of(item: Any, where: str) -> Message:
    if isinstance(item, FunctionCallItem):
        args = arguments(item.arguments, f"{where}.arguments")
        call = ToolUseBlock(id=item.call_id, name=item.name, input=args)
        return Message(role="assistant", content=[call])
    if isinstance(item, FunctionCallOutputItem):
        output = item.output if isinstance(item.output, str) else _text(item.output, where)
        result = ToolResultBlock(tool_use_id=item.call_id, content=output)
        return Message(role="user", content=[result])
    content = item.content if isinstance(item.content, str) else _blocks(item.content, where)
    return Message(role=item.role, content=content)


def _fields(req: _ResponsesFields) -> dict[str, Any]:
    tools = [tool(t.name, t.description, t.parameters) for t in _function_tools(req.tools or [])]
    fmt = (req.text or {}).get("format")
    schema = output_schema(fmt, "text.format", nested=False)
    return {
        "model": req.model,
        "max_tokens": req.max_output_tokens,
        "tools": tools or None,
        "tool_choice": tool_choice(req.tool_choice, req.parallel_tool_calls, "tool_choice")
        if tools or req.tool_choice is not None
        else None,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "metadata": req.metadata,
        "output_config": None
        if schema is None
        else OutputConfig(format=JsonSchemaFormat(schema=schema)),
    }


def _function_tools(tools: list[ResponsesTool], where: str = "tools") -> list[ResponsesTool]:
    """Function tools, a `namespace`'s flattened in place; hosted tools left out."""
    out: list[ResponsesTool] = []
    for i, t in enumerate(tools):
        if t.type == "function" and t.name:
            out.append(t)
        elif t.type == "namespace":
            out.extend(_function_tools(t.tools or [], f"{where}.{i}.tools"))
        elif t.type not in HOSTED_TOOLS:
            raise InvalidRequest(
                f"unsupported tool type {t.type!r}: only named function tools (and namespaces of "
                "them; hosted tools such as web_search are left out)",
                f"{where}.{i}.type",
            )
    return out


def answered(request_messages: list[Message], content: list[dict[str, Any]]) -> list[Message]:
    """The conversation after a response: its request's messages plus the answer."""
    kept = [b for b in content if b.get("type") in ("text", "thinking", "tool_use")]
    blocks = msgspec.convert(kept, list[ContentBlock])
    return [*request_messages, Message(role="assistant", content=blocks or [TextBlock(text="")])]


# --------------------------------------------------------------------------
# Answer -> Responses
# --------------------------------------------------------------------------


def _status(answer: Answer) -> str:
    return "incomplete" if answer.stop_reason == "max_tokens" else "completed"


def _output(answer: Answer) -> list[dict[str, Any]]:
    mid = answer.message_id
    items: list[dict[str, Any]] = []
    reasoning = "\n\n".join(b["thinking"] for b in answer.content if b["type"] == "thinking")
    reasoning = reasoning or answer.hidden_reasoning
    if reasoning:
        summary = [{"type": "summary_text", "text": reasoning}]
        items.append({"type": "reasoning", "id": f"rs_{mid}", "summary": summary})
    for k, block in enumerate(answer.content):
        if block["type"] == "text":
            part = {"type": "output_text", "text": block["text"], "annotations": []}
            items.append(
                {
                    "type": "message",
                    "id": f"{mid}_{k}",
                    "status": "completed",
                    "role": "assistant",
                    "content": [part],
                }
            )
        elif block["type"] == "tool_use":
            items.append(
                {
                    "type": "function_call",
                    "id": f"fc_{block['id']}",
                    "call_id": block["id"],
                    "name": block["name"],
                    "arguments": msgspec.json.encode(block["input"]).decode(),
                    "status": "completed",
                }
            )
    return items


def _item_events(index: int, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    kind = item["type"]
    head = {"output_index": index}
    if kind == "message":
        start = {**item, "status": "in_progress", "content": []}
    elif kind == "function_call":
        start = {**item, "status": "in_progress", "arguments": ""}
    else:
        start = {**item, "summary": []}
    events: list[tuple[str, dict[str, Any]]] = [
        (
            "response.output_item.added",
            {"type": "response.output_item.added", **head, "item": start},
        )
    ]
    at = {**head, "item_id": item["id"]}
    if kind == "message":
        part = item["content"][0]
        text = part["text"]
        empty = {**part, "text": ""}
        where = {**at, "content_index": 0}
        events += [
            (
                "response.content_part.added",
                {"type": "response.content_part.added", **where, "part": empty},
            ),
            (
                "response.output_text.delta",
                {"type": "response.output_text.delta", **where, "delta": text, "logprobs": []},
            ),
            (
                "response.output_text.done",
                {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
            ),
            (
                "response.content_part.done",
                {"type": "response.content_part.done", **where, "part": part},
            ),
        ]
    elif kind == "function_call":
        args = item["arguments"]
        events += [
            (
                "response.function_call_arguments.delta",
                {"type": "response.function_call_arguments.delta", **at, "delta": args},
            ),
            (
                "response.function_call_arguments.done",
                {"type": "response.function_call_arguments.done", **at, "arguments": args},
            ),
        ]
    else:
        for j, part in enumerate(item["summary"]):
            where = {**at, "summary_index": j}
            events += [
                (
                    "response.reasoning_summary_part.added",
                    {
                        "type": "response.reasoning_summary_part.added",
                        **where,
                        "part": {**part, "text": ""},
                    },
                ),
                (
                    "response.reasoning_summary_text.delta",
                    {
                        "type": "response.reasoning_summary_text.delta",
                        **where,
                        "delta": part["text"],
                    },
                ),
                (
                    "response.reasoning_summary_text.done",
                    {"type": "response.reasoning_summary_text.done", **where, "text": part["text"]},
                ),
                (
                    "response.reasoning_summary_part.done",
                    {"type": "response.reasoning_summary_part.done", **where, "part": part},
                ),
            ]
    events.append(
        ("response.output_item.done", {"type": "response.output_item.done", **head, "item": item})
    )
    return events


def _usage(usage: dict[str, int]) -> dict[str, Any]:
    prompt, cached, output = usage_numbers(usage)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def request_messages(body: bytes, earlier: Sequence[Message]) -> list[Message]:
    """The (non-system) messages a recorded Responses body stands for, given its history."""
    req: ResponsesRequest = decode(body, ResponsesRequest)
    messages, _, _ = conversation(req, earlier)
    return messages
