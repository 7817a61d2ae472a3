"""OpenAI Chat Completions (`POST /v1/chat/completions`): wire types and the two edges.

Messages map one to one onto Anthropic-shaped ones (leading system/developer
messages become the system prompt, a `tool` message a tool_result), which the
shared translation turns into the chat-template request: the same
conversation gives the same tokens as over /v1/messages.
"""

from __future__ import annotations

import time
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
    texts,
    to_chat_request,
    tool,
    tool_choice,
)
from recorder.dialects.parse_cache import ParseCache
from recorder.dialects.sse import SseFrame

_PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class TextPart(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImageUrl(msgspec.Struct):
    url: str


class ImagePart(msgspec.Struct, tag="image_url", tag_field="type"):
    image_url: ImageUrl


class FunctionCall(msgspec.Struct):
    name: NonEmpty
    arguments: str


class ToolCall(msgspec.Struct):
    id: NonEmpty
    function: FunctionCall
    type: Literal["function"] = "function"


class _Msg(msgspec.Struct, kw_only=True, tag_field="role"):
    pass


class SystemMessage(_Msg, tag="system"):
    content: str | list[TextPart]


class DeveloperMessage(_Msg, tag="developer"):
    content: str | list[TextPart]


class UserMessage(_Msg, tag="user"):
    content: str | list[TextPart | ImagePart]


class AssistantMessage(_Msg, tag="assistant"):
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    # Echoed reasoning is not compared: a chain's digest ignores dropped reasoning.
    reasoning_content: str | None = None


class ToolMessage(_Msg, tag="tool"):
    tool_call_id: NonEmpty
    content: str | list[TextPart]


ChatMessage = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


class FunctionDef(msgspec.Struct):
    name: NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = None


class FunctionTool(msgspec.Struct):
    function: FunctionDef
    type: Literal["function"] = "function"


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _RequestFields(msgspec.Struct, kw_only=True):
    """Everything of a Chat Completions request but its messages."""

    model: str = ""
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_tokens: _PositiveInt | None = None
    max_completion_tokens: _PositiveInt | None = None
    stop: str | list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    logprobs: bool = False
    # Alternatives are not computed by the engine call the recorder makes: only 0 is served.
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=0)] | None = None


class ChatCompletionsRequest(_RequestFields, kw_only=True):
    messages: list[ChatMessage]


class _RawChatRequest(_RequestFields, kw_only=True):
    """A request whose messages are left undecoded (each one's exact JSON bytes)."""

    messages: list[msgspec.Raw]


_raw_request_decoder = msgspec.json.Decoder(_RawChatRequest)
_message_decoder = msgspec.json.Decoder(ChatMessage)


@dataclass(frozen=True)
class OpenAIChat:
    """The Chat Completions dialect; `include_usage` is the request's stream option."""

    include_usage: bool = False
    name: str = "openai-chat"
    ping: bytes | None = OPENAI_PING

    async def parse(
        self, body: bytes, *, cache: ParseCache | None = None, history: History | None = None
    ) -> tuple[ChatRequest, Dialect]:
        req: _RequestFields
        if cache is not None:
            try:
                req, chat = _parse_cached(body, cache)
            except (InvalidRequest, msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
                cache = None  # parsed again without the cache, which names the field
        if cache is None:
            req = full = decode(body, ChatCompletionsRequest)
            messages, index_map, system = _messages(full.messages)
            fields = {**_fields(req), "system": system or None}
            chat = to_chat_request(fields, messages, index_map, None)
        if req.logprobs:
            chat = msgspec.structs.replace(chat, logprobs=True)
        include = req.stream_options is not None and req.stream_options.include_usage
        return chat, OpenAIChat(include_usage=include)

    def message(self, answer: Answer) -> dict[str, Any]:
        message = _message(answer)
        return {
            "id": answer.message_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": answer.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", **message},
                    "finish_reason": _finish_reason(answer.stop_reason),
                    "logprobs": _logprobs(answer),
                }
            ],
            "usage": _usage(answer.usage),
        }

    def opening(self, message_id: str, model: str, usage: dict[str, int]) -> SseFrame:
        return None, _chunk(message_id, model, {"role": "assistant", "content": ""})

    def frames(self, answer: Answer) -> list[SseFrame]:
        mid, model, message = answer.message_id, answer.model, _message(answer)
        frames: list[SseFrame] = []
        if message.get("reasoning_content"):
            frames.append(
                (None, _chunk(mid, model, {"reasoning_content": message["reasoning_content"]}))
            )
        if message["content"]:
            chunk = _chunk(mid, model, {"content": message["content"]})
            chunk["choices"][0]["logprobs"] = _logprobs(answer)
            frames.append((None, chunk))
        for index, call in enumerate(message.get("tool_calls", ())):
            frames.append((None, _chunk(mid, model, {"tool_calls": [{"index": index, **call}]})))
        frames.append((None, _chunk(mid, model, {}, _finish_reason(answer.stop_reason))))
        if self.include_usage:
            usage_chunk = _chunk(mid, model, {})
            usage_chunk["choices"], usage_chunk["usage"] = [], _usage(answer.usage)
            frames.append((None, usage_chunk))
        frames.append((None, b"[DONE]"))
        return frames

    def error(self, err: ApiError) -> dict[str, Any]:
        return openai_error(err)

    def error_frame(self, err: ApiError) -> SseFrame:
        return None, openai_error(err)


OPENAI_CHAT = OpenAIChat()


# --------------------------------------------------------------------------
# Request -> Anthropic-shaped messages
# --------------------------------------------------------------------------


def _parse_cached(body: bytes, cache: ParseCache) -> tuple[_RawChatRequest, ChatRequest]:
    """The request through the session's caches: only messages not seen before are decoded.

    Each message's Anthropic-shaped JSON is kept by its exact bytes
    (`converted_messages`), and the Anthropic body is joined from those
    pieces, so the shared ParseCache then matches them by a byte compare.
    The result is the same as without the caches.
    """
    req = _raw_request_decoder.decode(body)
    system, pieces = join_through_cache(
        body,
        req.messages,
        "messages",
        converted_messages(cache, "openai-chat"),
        lambda key, where: _converted(_message_decoder.decode(key), where),
        system=[],
        pieces=[],
    )
    fields = {**_fields(req), "system": system}
    return req, chat_request_from_pieces(fields, pieces, cache)


def _converted(m: ChatMessage, where: str) -> tuple[str, bytes]:
    """("system", its text) or ("message", the Anthropic-shaped message's JSON)."""
    if isinstance(m, (SystemMessage, DeveloperMessage)):
        return "system", (m.content if isinstance(m.content, str) else texts(m.content)).encode()
    return "message", encode_message(_message_of(m, where))


def _fields(req: _RequestFields) -> dict[str, Any]:
    if req.n != 1:
        raise InvalidRequest("only n=1 is supported (one trajectory per request)", "n")
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    schema = output_schema(req.response_format, "response_format", nested=True)
    names = [t.function.name for t in req.tools or []]
    return {
        "model": req.model,
        "max_tokens": req.max_completion_tokens or req.max_tokens,
        "tools": [
            tool(t.function.name, t.function.description, t.function.parameters)
            for t in req.tools or []
        ]
        or None,
        "tool_choice": tool_choice(req.tool_choice, req.parallel_tool_calls, "tool_choice")
        if names or req.tool_choice is not None
        else None,
        "stop_sequences": stop,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "metadata": req.metadata,
        "output_config": None
        if schema is None
        else OutputConfig(format=JsonSchemaFormat(schema=schema)),
    }


def _messages(wire: list[ChatMessage]) -> tuple[list[Message], list[str], str]:
    """(Anthropic-shaped messages, the client's field for each and last the list's, system)."""
    system: list[str] = []
    messages: list[Message] = []
    fields: list[str] = []
    leading = True
    for i, m in enumerate(wire):
        where = f"messages.{i}"
        if isinstance(m, (SystemMessage, DeveloperMessage)):
            text = m.content if isinstance(m.content, str) else texts(m.content)
            if leading:
                system.append(text)
                continue
            messages.append(Message(role="system", content=text))
        else:
            leading = False
            messages.append(_message_of(m, where))
        fields.append(where)
    fields.append("messages")
    return messages, fields, "\n\n".join(system)


def _message_of(m: ChatMessage, where: str) -> Message:
    if isinstance(m, UserMessage):
        if isinstance(m.content, str):
            return Message(role="user", content=m.content)
        blocks: list[ContentBlock] = [
            TextBlock(text=p.text) if isinstance(p, TextPart) else image(p.image_url.url)
            for p in m.content
        ]
        return Message(role="user", content=blocks)
    if isinstance(m, ToolMessage):
        text = m.content if isinstance(m.content, str) else texts(m.content)
        return Message(
            role="user", content=[ToolResultBlock(tool_use_id=m.tool_call_id, content=text)]
        )
    assert isinstance(m, AssistantMessage)
    content: list[ContentBlock] = []
    text = m.content if isinstance(m.content, str) or m.content is None else texts(m.content)
    if text is not None and (text or not m.tool_calls):
        content.append(TextBlock(text=text))
    for j, call in enumerate(m.tool_calls or ()):
        args = arguments(call.function.arguments, f"{where}.tool_calls.{j}.function.arguments")
        content.append(ToolUseBlock(id=call.id, name=call.function.name, input=args))
    if not content:
        raise InvalidRequest("an assistant message needs content or tool_calls", where)
    return Message(role="assistant", content=content)


# --------------------------------------------------------------------------
# Answer -> Chat Completions
# --------------------------------------------------------------------------


def _message(answer: Answer) -> dict[str, Any]:
    text = [b["text"] for b in answer.content if b["type"] == "text"]
    thinking = [b["thinking"] for b in answer.content if b["type"] == "thinking"]
    calls = [
        {
            "id": b["id"],
            "type": "function",
            "function": {"name": b["name"], "arguments": msgspec.json.encode(b["input"]).decode()},
        }
        for b in answer.content
        if b["type"] == "tool_use"
    ]
    out: dict[str, Any] = {"content": "".join(text) if text or not calls else None}
    reasoning = "\n\n".join(thinking) or answer.hidden_reasoning
    if reasoning:
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = calls
    return out


def _logprobs(answer: Answer) -> dict[str, Any] | None:
    """The engine's logprob of every output token (the same values the samples carry)."""
    if answer.token_logprobs is None:
        return None
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in answer.token_logprobs
        ],
        "refusal": None,
    }


def _finish_reason(stop_reason: str) -> str:
    return {"tool_use": "tool_calls", "max_tokens": "length"}.get(stop_reason, "stop")


def _usage(usage: dict[str, int]) -> dict[str, Any]:
    prompt, cached, output = usage_numbers(usage)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _chunk(
    message_id: str, model: str, delta: dict[str, Any], finish: str | None = None
) -> dict[str, Any]:
    return {
        "id": message_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }
