"""Anthropic Messages request -> chat-template request.

Claude Code sends a 40-80 KB body every turn, so the body is decoded once by
msgspec straight into typed Structs (unknown fields such as
`context_management` are ignored, which also drops every `cache_control`).
Anything the chat template cannot represent is refused with `InvalidRequest`
whose message starts with the path of the offending field
(`messages.3.content.1.type: ...`), so the server can answer 400.

Besides the chat messages, a `ChatRequest` carries digests of a normalized
form of every message. The token-chain layer compares them to decide whether a
request extends an earlier one: the normalized form ignores what a client may
legitimately change when it echoes our answer back (surrounding whitespace,
cache_control, signatures, block splitting) and keeps what the model saw.

A client resends the whole conversation every turn. With a `ParseCache`
(one per session) only the messages whose JSON bytes were not seen before
are decoded, validated and translated, so a turn costs what its new
messages cost plus one scan of the body; the result is the same as without
the cache, and so is every error (on any error the body is parsed again
without the cache, which names the field exactly as before).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
import numpy as np

from recorder.dialects.json_limits import MAX_DEPTH, json_problem

BILLING_HEADER_PREFIX = "x-anthropic-billing-header"
DISPATCH_TOOL_NAMES = frozenset({"Agent", "Task"})

_PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
_NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
_UnitFloat = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
_Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]


class InvalidRequest(ValueError):
    """The request body cannot be served; the message names the offending field."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


# --------------------------------------------------------------------------
# The Anthropic request, as msgspec Structs (wire format)
# --------------------------------------------------------------------------


class _Base(msgspec.Struct, kw_only=True):
    pass


class TextBlock(_Base, tag="text"):
    text: str


class ToolUseBlock(_Base, tag="tool_use"):
    id: Annotated[str, msgspec.Meta(min_length=1)]
    name: Annotated[str, msgspec.Meta(min_length=1)]
    input: dict[str, Any]


class Base64Source(_Base, tag="base64"):
    media_type: str
    data: str


class UrlSource(_Base, tag="url"):
    url: str


class FileSource(_Base, tag="file"):
    file_id: str


class ImageBlock(_Base, tag="image"):
    """An image the model is shown (a screenshot, a PNG the agent Read)."""

    source: Base64Source | UrlSource | FileSource


class ToolReferenceBlock(_Base, tag="tool_reference"):
    """In a ToolSearch result: the named `defer_loading` tool is now loaded (`_load_references`)."""

    tool_name: Annotated[str, msgspec.Meta(min_length=1)]


class ToolResultBlock(_Base, tag="tool_result"):
    tool_use_id: Annotated[str, msgspec.Meta(min_length=1)]
    content: str | list[TextBlock | ImageBlock | ToolReferenceBlock] | None = None
    is_error: bool = False


class ThinkingBlock(_Base, tag="thinking"):
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Base, tag="redacted_thinking"):
    data: str = ""


ContentBlock = (
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
)


class Message(_Base):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_Base):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    input_schema: dict[str, Any]
    description: str = ""
    type: str | None = None
    # Left out of the prompt's tool list until a `tool_reference` loads it (tool search).
    defer_loading: bool = False


class ToolChoiceAuto(_Base, tag="auto"):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Base, tag="any"):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Base, tag="tool"):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Base, tag="none"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingEnabled(_Base, tag="enabled"):
    budget_tokens: _NonNegativeInt


class ThinkingDisabled(_Base, tag="disabled"):
    pass


class ThinkingAdaptive(_Base, tag="adaptive"):
    pass


ThinkingConfig = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive


class JsonSchemaFormat(_Base, tag="json_schema"):
    schema: dict[str, Any]


class OutputConfig(_Base):
    """`output_config` (and the older top-level `output_format`): `effort` is ignored."""

    format: JsonSchemaFormat | None = None


class _RequestFields(_Base):
    """Everything of a Messages request but its messages."""

    model: str = ""
    max_tokens: _PositiveInt | None = None
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: _Temperature | None = None
    top_p: _UnitFloat | None = None
    top_k: _PositiveInt | None = None
    thinking: ThinkingConfig | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    output_format: JsonSchemaFormat | None = None


class AnthropicRequest(_RequestFields, kw_only=True):
    """POST /v1/messages (and /count_tokens, where max_tokens may be absent)."""

    messages: list[Message]


class _RawMessagesRequest(_RequestFields, kw_only=True):
    """A request whose messages are left undecoded (each one's exact JSON bytes)."""

    messages: list[msgspec.Raw]


_request_decoder = msgspec.json.Decoder(AnthropicRequest)
_raw_messages_decoder = msgspec.json.Decoder(_RawMessagesRequest)
_message_decoder = msgspec.json.Decoder(Message)
_block_decoder = msgspec.json.Decoder(list[ContentBlock])


# --------------------------------------------------------------------------
# The translated request
# --------------------------------------------------------------------------


class ChatRequest(msgspec.Struct, kw_only=True):
    """What the token layer and the engine need from one Messages request.

    `messages` are chat-template dicts (role, content, reasoning_content,
    tool_calls, tool_call_id); the system prompt, if any, is `messages[0]`.
    `message_digests[i]` is the digest of the normalized `messages[i]`.
    `render_digest` covers what besides the messages changes how they render
    (the tool schemas): a chain only extends under the same one. Template
    kwargs (`enable_thinking`) may only change the generation prompt.

    `tools` is the prompt's tool list (what the template renders up front);
    `loaded_tools` are the `defer_loading` tools a `tool_reference` in the
    history has loaded. Their schemas reach the model inside that tool result,
    never in the list, yet the model may call them: `callable_tools` is what
    the output parser accepts.
    """

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    message_digests: tuple[str, ...]
    system: str
    system_digest: str
    render_digest: str
    tool_result_ids: tuple[str, ...]
    n_input_messages: int
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: tuple[str, ...] = ()
    tool_choice: Literal["auto", "any", "tool", "none"] = "auto"
    tool_choice_name: str | None = None
    disable_parallel_tool_use: bool = False
    thinking: Literal["enabled", "disabled", "adaptive"] | None = None
    thinking_budget: int | None = None
    stream: bool = False
    metadata: dict[str, Any] = {}
    template_kwargs: dict[str, Any] = {}
    # `output_config.format` / `output_format`: the engine decodes under this JSON schema.
    json_schema: dict[str, Any] | None = None
    # The answer carries each output token's logprob (OpenAI `logprobs: true`).
    logprobs: bool = False
    loaded_tools: list[dict[str, Any]] = []

    @property
    def callable_tools(self) -> list[dict[str, Any]]:
        """The tools the model may call now: the listed ones and the loaded deferred ones."""
        return [*self.tools, *self.loaded_tools] if self.loaded_tools else self.tools


# --------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------


def parse_request(
    body: bytes, *, count_tokens: bool = False, cache: ParseCache | None = None
) -> ChatRequest:
    """Decode and translate a Messages request body; raise InvalidRequest if it can't be served.

    `count_tokens=True` accepts a /v1/messages/count_tokens body (no max_tokens).
    `cache` (one per session) reuses the translation of messages sent before;
    the result is the same as without it.

    JSON limits (depth, 64-bit integers) are checked on the raw bytes before
    anything walks the value. With a cache only the bytes not seen before are
    scanned (the new messages and the fields around the messages), so the check
    costs what a turn adds, not the whole context (~2.7 ms for a 570 kB body).
    """
    if cache is not None:
        try:
            return _parse_with_cache(body, count_tokens, cache)
        except (InvalidRequest, msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
            pass  # parsed again without the cache, which names the offending field
    problem = json_problem(body)
    if problem is not None:
        raise InvalidRequest(problem, "body")
    try:
        req = _request_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise _from_validation_error(exc) from None
    except UnicodeDecodeError:
        raise InvalidRequest(_utf8_error(body), "body") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(_describe_decode_error(body, exc), "body") from None
    _check_max_tokens(req, count_tokens)
    return translate(req)


def translate(req: AnthropicRequest) -> ChatRequest:
    """Translate a decoded request (see `parse_request`)."""
    _check_head(req, len(req.messages))
    conversation = _Conversation(system_text(req.system))
    for i, message in enumerate(req.messages):
        conversation.add(_translate_message(message, f"messages.{i}", conversation.seen))
    return _chat_request(req, conversation)


def _parse_with_cache(body: bytes, count_tokens: bool, cache: ParseCache) -> ChatRequest:
    req = _raw_messages_decoder.decode(body)
    if json_problem(outside_messages(body, req.messages)) is not None:
        raise InvalidRequest("JSON limits", "body")  # the uncached path names the problem
    _check_max_tokens(req, count_tokens)
    _check_head(req, len(req.messages))
    conversation = _Conversation(system_text(req.system))
    cache.add_messages(req.messages, conversation)
    return _chat_request(req, conversation)


def outside_messages(body: bytes, raws: Sequence[msgspec.Raw]) -> bytes:
    """`body` without the bytes of its messages (each message is checked on its own,
    once, when the cache first sees it). msgspec's `Raw` is a view into `body`, so
    the messages' span is found by address, never by searching."""
    if not raws:
        return body
    base = _address(body)
    start = _address(raws[0]) - base
    end = _address(raws[-1]) - base + len(raws[-1])
    if not 0 <= start <= end <= len(body):
        return body  # not views of `body`: check it all
    return body[:start] + body[end:]


def _address(buffer: Any) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).__array_interface__["data"][0])


def _check_max_tokens(req: _RequestFields, count_tokens: bool) -> None:
    if req.max_tokens is None and not count_tokens:
        raise InvalidRequest("field required", "max_tokens")


def _check_head(req: _RequestFields, n_messages: int) -> None:
    if not n_messages:
        raise InvalidRequest("at least one message is required", "messages")
    _check_tools(req.tools or [])
    _check_tool_choice(req.tool_choice, req.tools or [])


def _check_tool_choice(choice: ToolChoice | None, tools: list[Tool]) -> None:
    """As the real API: `any` needs tools, `tool` must name one of them."""
    if isinstance(choice, ToolChoiceAny) and not tools:
        raise InvalidRequest("`any` requires at least one tool in `tools`", "tool_choice.type")
    if isinstance(choice, ToolChoiceTool) and choice.name not in {t.name for t in tools}:
        raise InvalidRequest(f"tool {choice.name!r} is not in `tools`", "tool_choice.name")


def _chat_request(req: _RequestFields, conversation: _Conversation) -> ChatRequest:
    if conversation.last_role == "assistant":
        raise InvalidRequest(
            "the last message must be from the user (assistant prefill is not supported)",
            f"messages.{conversation.n_input_messages - 1}.role",
        )
    system = conversation.system
    tools = [_tool_schema(t) for t in req.tools or [] if not t.defer_loading]
    deferred = {t.name: _tool_schema(t) for t in req.tools or [] if t.defer_loading}
    by_name = {**{t["function"]["name"]: t for t in tools}, **deferred}
    messages, digests, loaded = _load_references(
        conversation.messages, conversation.digests, by_name
    )
    thinking = req.thinking
    template_kwargs: dict[str, Any] = {}
    if thinking is not None:
        template_kwargs["enable_thinking"] = not isinstance(thinking, ThinkingDisabled)
    choice = req.tool_choice
    return ChatRequest(
        model=req.model,
        messages=messages,
        tools=tools,
        message_digests=tuple(digests),
        system=system,
        system_digest=_digest_text(system),
        render_digest=_digest_obj(tools),
        tool_result_ids=tuple(conversation.trailing_tool_result_ids),
        n_input_messages=conversation.n_input_messages,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop_sequences=tuple(req.stop_sequences or ()),
        tool_choice=_choice_name(choice),
        tool_choice_name=choice.name if isinstance(choice, ToolChoiceTool) else None,
        disable_parallel_tool_use=bool(getattr(choice, "disable_parallel_tool_use", False)),
        thinking=None if thinking is None else thinking.__struct_config__.tag,  # type: ignore[arg-type]
        thinking_budget=thinking.budget_tokens if isinstance(thinking, ThinkingEnabled) else None,
        stream=req.stream,
        metadata=dict(req.metadata or {}),
        template_kwargs=template_kwargs,
        json_schema=_json_schema(req),
        loaded_tools=[deferred[name] for name in loaded if name in deferred],
    )


def _json_schema(req: _RequestFields) -> dict[str, Any] | None:
    """The requested output schema, from `output_config.format` or the older `output_format`."""
    if req.output_config is not None and req.output_config.format is not None:
        return req.output_config.format.schema
    return req.output_format.schema if req.output_format is not None else None


def system_text(system: str | list[TextBlock] | None) -> str:
    """The system prompt without Claude Code's per-turn billing header (it would break the prefix)."""
    if system is None:
        return ""
    if isinstance(system, str):
        lines = system.split("\n")
        while lines and lines[0].startswith(BILLING_HEADER_PREFIX):
            lines.pop(0)
        return "\n".join(lines).strip()
    parts = [b.text for b in system if not b.text.lstrip().startswith(BILLING_HEADER_PREFIX)]
    return "\n\n".join(p for p in parts if p)


# --------------------------------------------------------------------------
# Message translation: each message on its own, then the conversation rules
# --------------------------------------------------------------------------


class _Piece(NamedTuple):
    """One request message translated and validated on its own.

    Its chat messages are shared by every request that repeats it (through
    a ParseCache), so nothing downstream may mutate them. It is valid in any
    conversation in which each of its `tool_result_ids` follows its tool_use.
    """

    role: Literal["user", "assistant", "system"]
    messages: tuple[dict[str, Any], ...]
    digests: tuple[str, ...]
    tool_use_ids: tuple[str, ...]
    tool_result_ids: tuple[str, ...]


# A `_Piece` as the ParseCache keeps it: a plain tuple, so an entry costs the
# cyclic GC two tracked objects (this tuple and its tuple of message dicts; the
# dicts of plain text and the tuples of strings are untracked), not three.
# Read by position (`_Conversation` unpacks it).
_CachedPiece = tuple[
    str, tuple[dict[str, Any], ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]
]


def _translate_message(message: Message, path: str, seen: set[str]) -> _Piece:
    """`seen`: the tool_use ids of the messages before this one.

    A system message without text (Claude Code 2.1.33x sends `{"role": "system",
    "content": []}` after `/compact`) adds nothing the model could read: it
    becomes no chat message, rather than an empty system block in the prompt.
    """
    if message.role == "system" and _is_empty_system(message.content, path):
        return _Piece("system", (), (), (), ())
    if isinstance(message.content, str):
        # The short form of one text block: any role's chat message is that text
        # (what the general path makes of it, without building the block).
        chat = {"role": message.role, "content": message.content}
        return _Piece(message.role, (chat,), (message_digest(chat),), (), ())
    blocks = message.content
    if message.role == "assistant":
        reply = _assistant_turn(blocks, path)
        calls = tuple(b.id for b in blocks if isinstance(b, ToolUseBlock))
        return _Piece("assistant", (reply,), (message_digest(reply),), calls, ())
    if message.role == "user":
        out = tuple(_user_messages(blocks, path, seen))
        results = tuple(b.tool_use_id for b in blocks if isinstance(b, ToolResultBlock))
        return _Piece("user", out, tuple(message_digest(m) for m in out), (), results)
    system = {"role": "system", "content": _text_only(blocks, path)}
    return _Piece("system", (system,), (message_digest(system),), (), ())


class _Conversation:
    """The chat messages of a request, built message by message under the cross-message rules.

    Consecutive assistant messages merge (the API treats them as one turn);
    the tool_result ids after the last assistant message are collected.
    """

    def __init__(self, system: str) -> None:
        self.system = system
        self.messages: list[dict[str, Any]] = []
        self.digests: list[str] = []
        if system:
            prompt = {"role": "system", "content": system}
            self.messages.append(prompt)
            self.digests.append(message_digest(prompt))
        self.seen: set[str] = set()
        self.trailing_tool_result_ids: list[str] = []
        self.last_role = ""
        self.n_input_messages = 0

    def check_tool_results(self, piece: _CachedPiece, index: int) -> None:
        """A message translated in another conversation: do its tool_results follow their tool_use?"""
        for tool_use_id in piece[4]:
            if tool_use_id not in self.seen:
                raise InvalidRequest(
                    f"no tool_use with id {tool_use_id!r} earlier in the conversation",
                    f"messages.{index}",
                )

    def add(self, piece: _CachedPiece) -> None:
        """Add a `_Piece` (or its cached plain tuple)."""
        role, messages, digests, tool_use_ids, tool_result_ids = piece
        self.n_input_messages += 1
        self.last_role = role
        if role != "assistant":
            self.trailing_tool_result_ids.extend(tool_result_ids)
        else:
            self.seen.update(tool_use_ids)
            self.trailing_tool_result_ids.clear()
            if self.messages and self.messages[-1]["role"] == "assistant":
                merged = _merge_assistant(self.messages[-1], messages[0])
                self.messages[-1] = merged
                self.digests[-1] = message_digest(merged)
                return
        self.messages.extend(messages)
        self.digests.extend(digests)


def _assistant_turn(blocks: list[ContentBlock], path: str) -> dict[str, Any]:
    if not blocks:
        raise InvalidRequest("must not be empty", f"{path}.content")
    for j, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            raise InvalidRequest(
                "tool_result blocks belong in user messages", f"{path}.content.{j}.type"
            )
    return assistant_message(blocks)


def assistant_message(blocks: Sequence[ContentBlock]) -> dict[str, Any]:
    """The chat message for an assistant turn (the same for our response and its echo)."""
    reasoning = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
    text = [b.text for b in blocks if isinstance(b, TextBlock)]
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
        for b in blocks
        if isinstance(b, ToolUseBlock)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(t for t in text if t)}
    if any(reasoning):
        message["reasoning_content"] = "\n\n".join(r for r in reasoning if r)
    if calls:
        message["tool_calls"] = calls
    return message


def _merge_assistant(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {
        "role": "assistant",
        "content": "\n\n".join(t for t in (a["content"], b["content"]) if t),
    }
    reasoning = [r for r in (a.get("reasoning_content"), b.get("reasoning_content")) if r]
    if reasoning:
        merged["reasoning_content"] = "\n\n".join(reasoning)
    calls = [*a.get("tool_calls", ()), *b.get("tool_calls", ())]
    if calls:
        merged["tool_calls"] = calls
    return merged


def _user_messages(
    blocks: list[ContentBlock], path: str, seen: set[str]
) -> Iterable[dict[str, Any]]:
    """Tool results become `tool` messages; runs of text become one user message."""
    if not blocks:
        raise InvalidRequest("must not be empty", f"{path}.content")
    text: list[str] = []
    for j, block in enumerate(blocks):
        where = f"{path}.content.{j}"
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ImageBlock):
            text.append(image_text(block))
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in seen:
                raise InvalidRequest(
                    f"no tool_use with id {block.tool_use_id!r} earlier in the conversation",
                    f"{where}.tool_use_id",
                )
            if text:
                yield {"role": "user", "content": "\n\n".join(text)}
                text = []
            yield _tool_message(block)
        else:
            raise InvalidRequest(
                f"{block.__struct_config__.tag} blocks are only allowed in assistant messages",
                f"{where}.type",
            )
    if text:
        yield {"role": "user", "content": "\n\n".join(text)}


def _tool_message(block: ToolResultBlock) -> dict[str, Any]:
    content = block.content
    references: list[str] = []
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for part in content:
            if isinstance(part, TextBlock):
                parts.append(part.text)
            elif isinstance(part, ImageBlock):
                parts.append(image_text(part))
            else:
                references.append(part.tool_name)
                parts.append(_reference_mark(part.tool_name))
        text = "\n\n".join(parts)
    message: dict[str, Any] = {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}
    if block.is_error:
        message["is_error"] = True
    if references:
        message["tool_references"] = tuple(references)
    return message


def image_text(block: ImageBlock) -> str:
    """The text a text-only model is shown in place of an image (README: "Images").

    It names the image by content (media type, size, sha256 prefix), so a
    different image is a different message and an identical re-send is not.
    """
    source = block.source
    if isinstance(source, Base64Source):
        data = source.data.strip()
        size = len(data) * 3 // 4 - data[-2:].count("=")  # decoded size, without decoding
        digest = hashlib.sha256(data.encode()).hexdigest()[:12]
        what = f"{source.media_type}, {size} bytes, sha256 {digest}"
    elif isinstance(source, UrlSource):
        what = source.url
    else:
        what = f"file {source.file_id}"
    return f"[image: {what}; not shown, the model reads text only]"


def _reference_mark(name: str) -> str:
    """A tool_reference before its tool is known: `_load_references` replaces it."""
    return f"<tool_reference>{name}</tool_reference>"


def _load_references(
    messages: list[dict[str, Any]], digests: list[str], tools: dict[str, dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[str], tuple[str, ...]]:
    """Each `tool_reference` becomes the referenced tool's schema, where the model meets it.

    The Messages API expands a reference into the tool's full definition at
    that point of the context, and a `defer_loading` tool is not in the
    prompt's tool list before. The template renders the list as one JSON
    schema a line inside <tools></tools>; a loaded tool reads the same way,
    inside the tool result. So deferred tools stay out of `render_digest`
    (Claude Code adds a tool to `tools` once it is loaded: that must not
    break the chain), and a loaded message's digest is that of its expanded
    text. Messages are shared with the ParseCache: copied, never changed.

    Also returns the names loaded, in order of first reference: from that
    point on the model may call them (as with the real API).
    """
    if not any("tool_references" in m for m in messages):
        return messages, digests, ()
    out, out_digests = [], list(digests)
    loaded_names: dict[str, None] = {}
    for i, message in enumerate(messages):
        names = message.get("tool_references")
        if names is None:
            out.append(message)
            continue
        text = message["content"]
        for name in names:
            if name not in tools:
                raise InvalidRequest(
                    f"tool_reference to {name!r}, which is not in tools; declare it there "
                    "(with defer_loading: true for tool search)",
                    "tools",
                )
            schema = json.dumps(tools[name], ensure_ascii=False)
            text = text.replace(_reference_mark(name), f"<tools>\n{schema}\n</tools>", 1)
            loaded_names[name] = None
        loaded = {**{k: v for k, v in message.items() if k != "tool_references"}, "content": text}
        out.append(loaded)
        out_digests[i] = message_digest(loaded)
    return out, out_digests, tuple(loaded_names)


def _is_empty_system(content: str | list[ContentBlock], path: str) -> bool:
    text = content if isinstance(content, str) else _text_only(content, path)
    return not text.strip()


def _text_only(blocks: list[ContentBlock], path: str) -> str:
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise InvalidRequest(
                "system messages may only contain text blocks", f"{path}.content.{j}.type"
            )
    return "\n\n".join(b.text for b in blocks)  # type: ignore[union-attr]


# --------------------------------------------------------------------------
# The per-session cache of translated messages
# --------------------------------------------------------------------------


class ParseCache:
    """One session's translated messages, keyed by their exact JSON bytes (LRU, bounded).

    Identical bytes decode to the identical message, so a hit needs no
    decoding, validation or translation; only the cross-message rules run
    again (`_Conversation`). The previous request's keys are kept in order:
    a message at the same position as before is matched by a byte compare,
    so only messages that moved or are new get hashed.

    Bounds: the least recently used messages go beyond `max_entries` or
    `max_bytes`, where a message is charged twice its JSON size (the key plus
    its translation) plus a fixed overhead; and a message no request used in
    the last `max_idle_requests` (history replaced by a compaction, a
    finished subagent) goes too. The previous request's key list may keep a
    few evicted keys alive until the next request. Not thread-safe: one
    session's requests are parsed on the server's event loop.

    No object per entry: a translation is kept as a plain tuple and its last
    use as an int in a flat dict (untracked by the cyclic GC), two tracked
    objects per message instead of three. Every full collection walks them
    all: after a restart, 256 restored caches of 200 messages made full
    collections take ~150-200 ms each, most of what the restart cost beyond
    its reads and parses (tests/tokens/test_parse_cache.py counts them).
    """

    # Per message beyond 2x its JSON: the translation's dicts and strings (~600 bytes
    # measured by tests/server/test_memory.py) and the dict slot.
    ENTRY_OVERHEAD = 640

    def __init__(
        self, max_entries: int = 4096, max_bytes: int = 16 << 20, max_idle_requests: int = 64
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_idle_requests = max_idle_requests
        self._entries: OrderedDict[bytes, _CachedPiece] = OrderedDict()  # LRU first
        self._last_used: dict[bytes, int] = {}  # key -> number of the request
        self._previous: list[bytes] = []
        self._nbytes = 0
        self._requests = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Memory charged for the cached messages (see the class docstring)."""
        return self._nbytes

    def clear(self) -> None:
        self._entries.clear()
        self._last_used.clear()
        self._previous = []
        self._nbytes = 0

    def add_messages(self, raws: Sequence[msgspec.Raw], conversation: _Conversation) -> None:
        """Add each message to `conversation`, translating only those not cached."""
        self._requests += 1
        now = self._requests
        previous, keys, entries, last_used = self._previous, [], self._entries, self._last_used
        for i, raw in enumerate(raws):
            data = bytes(raw)
            key = previous[i] if i < len(previous) and previous[i] == data else data
            piece = entries.get(key)
            if piece is None:
                # A message sits two levels deep in the body ({"messages": [ ... ]}).
                if json_problem(data, MAX_DEPTH - 2) is not None:
                    raise InvalidRequest("JSON limits", f"messages.{i}")  # named by the caller
                message = _message_decoder.decode(data)
                piece = tuple(_translate_message(message, f"messages.{i}", conversation.seen))
                self._put(key, piece, now)
            else:
                last_used[key] = now
                entries.move_to_end(key)
                if piece[4]:
                    conversation.check_tool_results(piece, i)
            conversation.add(piece)
            keys.append(key)
        self._previous = keys
        idle_before = now - self.max_idle_requests
        self._evict(lambda oldest: last_used[oldest] < idle_before)

    def _put(self, key: bytes, piece: _CachedPiece, now: int) -> None:
        self._entries[key] = piece
        self._last_used[key] = now
        self._nbytes += self._cost(key)
        # Checked inline first: a session's first request after a restart puts
        # every message of its history (hundreds), and is rarely over a bound.
        if len(self._entries) > self.max_entries:
            self._evict(lambda _: len(self._entries) > self.max_entries)
        if self._nbytes > self.max_bytes:
            self._evict(lambda _: self._nbytes > self.max_bytes)

    def _evict(self, while_oldest: Callable[[bytes], bool]) -> None:
        """Drop least recently used entries while `while_oldest(the oldest entry's key)` holds."""
        entries = self._entries
        while entries and while_oldest(next(iter(entries))):
            key, _ = entries.popitem(last=False)
            del self._last_used[key]
            self._nbytes -= self._cost(key)

    def _cost(self, key: bytes) -> int:
        return 2 * len(key) + self.ENTRY_OVERHEAD


# --------------------------------------------------------------------------
# Tools
# --------------------------------------------------------------------------


def _check_tools(tools: list[Tool]) -> None:
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise InvalidRequest(
                f"unsupported tool type {tool.type!r} (only custom tools with an input_schema)",
                f"tools.{i}.type",
            )
        if tool.name in names:
            raise InvalidRequest(f"duplicate tool name {tool.name!r}", f"tools.{i}.name")
        names.add(tool.name)


def _tool_schema(tool: Tool) -> dict[str, Any]:
    """OpenAI-style function schema, the form chat templates expect."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.input_schema,
        },
    }


def _choice_name(choice: ToolChoice | None) -> Literal["auto", "any", "tool", "none"]:
    if choice is None:
        return "auto"
    return choice.__struct_config__.tag  # type: ignore[return-value]


# --------------------------------------------------------------------------
# Digests of a normalized form
# --------------------------------------------------------------------------

_encoder = msgspec.json.Encoder(order="sorted")


def _digest_obj(obj: Any) -> str:
    return hashlib.blake2b(_encoder.encode(obj), digest_size=16).hexdigest()


def _digest_text(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def message_digest(message: dict[str, Any]) -> str:
    """Digest of what the model sees of a chat message, ignoring surrounding whitespace.

    A tool call is identified by its id and name, not its arguments: the ids
    of our answers are ours (random, unique), and clients re-send a call's
    input normalised (Claude Code adds schema defaults such as
    `"replace_all": false` first, reorders keys), which is still our answer.

    The digest has up to three parts, `<message>[|<calls alone>][+<reasoning>]`,
    so that `same_message` also matches the echoes clients make of our answers:
    without the thinking (clients strip it from earlier turns), and, for an
    answer with tool calls, without its text (`content: null` or `""` beside
    `tool_calls`, a Responses `function_call` item alone: many agent frameworks
    drop empty or whitespace text, and some drop all of it).
    """
    calls = message.get("tool_calls")
    ids = [(c["id"], c["function"]["name"]) for c in calls] if calls else None
    text = (message.get("content") or "").strip()
    rest = (message.get("tool_call_id"), message.get("is_error", False))
    digest = _digest_obj((message["role"], text, ids, *rest))
    if ids and text:
        digest += "|" + _digest_obj((message["role"], "", ids, *rest))
    reasoning = (message.get("reasoning_content") or "").strip()
    return f"{digest}+{_digest_text(reasoning)}" if reasoning else digest


def same_message(ours: str, echoed: str) -> bool:
    """Is the client's `echoed` message digest an echo of `ours` (see `message_digest`)?

    The echo may drop the thinking, and the text beside tool calls; it may
    not change or add anything.
    """
    if ours == echoed:
        return True
    echoed_reasoning = echoed.partition("+")[2]
    if echoed_reasoning and echoed_reasoning != ours.partition("+")[2]:
        return False
    return message_key(echoed) in echo_keys(ours)


def echo_keys(ours: str) -> tuple[str, ...]:
    """Message keys (`message_key`) under which an echo of `ours` can appear."""
    head = ours.partition("+")[0]
    full, _, calls = head.partition("|")
    return (full, calls) if calls else (full,)


def message_key(echoed: str) -> str:
    """The part of an echoed digest `echo_keys` looks up: the message as it was echoed."""
    return echoed.partition("+")[0].partition("|")[0]


def answer_keys(req: ChatRequest) -> tuple[str, ...]:
    """`message_key`s of the assistant messages `req` carries, in order, once each."""
    keys = (
        message_key(d)
        for m, d in zip(req.messages, req.message_digests, strict=True)
        if m["role"] == "assistant"
    )
    return tuple(dict.fromkeys(keys))


def response_message_digest(content: Sequence[dict[str, Any]]) -> str:
    """Digest of the assistant message a client will echo for our response `content` blocks.

    Blocks other than text / thinking / tool_use are ignored.
    """
    kept = [b for b in content if b.get("type") in ("text", "thinking", "tool_use")]
    try:
        blocks = msgspec.convert(kept, list[ContentBlock])
    except msgspec.ValidationError as exc:
        raise ValueError(f"response content is not valid Anthropic blocks: {exc}") from exc
    return message_digest(assistant_message(blocks))


def find_dispatches(content: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(tool_use id, prompt) of every Agent/Task subagent dispatch in response `content`."""
    found = []
    for block in content:
        if block.get("type") == "tool_use" and block.get("name") in DISPATCH_TOOL_NAMES:
            prompt = (block.get("input") or {}).get("prompt")
            found.append((str(block["id"]), prompt if isinstance(prompt, str) else ""))
    return found


# --------------------------------------------------------------------------
# Error messages
# --------------------------------------------------------------------------

_PATH_RE = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_INDEX_RE = re.compile(r"\[(\d+)\]")
_TAG_RE = re.compile(r"^Invalid value '(?P<tag>[^']*)'$")


def _from_validation_error(exc: msgspec.ValidationError) -> InvalidRequest:
    """msgspec's "Expected `int`, got `str` - at `$.messages[0].content[1]`" -> field path first."""
    match = _PATH_RE.match(str(exc))
    assert match is not None
    message, raw_path = match["msg"], match["path"] or ""
    path = _INDEX_RE.sub(r".\1", raw_path).lstrip(".")
    tag = _TAG_RE.match(message)
    if tag and path.endswith(".type"):
        message = f"unsupported {_kind_of(path)} type {tag['tag']!r}"
    elif message.startswith("Object missing required field"):
        field = message.split("`")[1]
        path = f"{path}.{field}" if path else field
        message = "field required"
    return InvalidRequest(message, path or "body")


_KIND_BY_FIELD = {
    "content": "block",
    "system": "block",
    "tool_choice": "tool_choice",
    "thinking": "thinking",
}


def _kind_of(path: str) -> str:
    """What a `type` tag at `path` selects: `messages.0.content.1.type` -> "block"."""
    names = [p for p in path.split(".")[:-1] if not p.isdigit()]
    return _KIND_BY_FIELD.get(names[-1] if names else "", "value")


def _utf8_error(body: bytes) -> str:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not valid UTF-8 (byte {err.start}); send the JSON body encoded as UTF-8"
    return "not valid UTF-8; send the JSON body encoded as UTF-8"


def _describe_decode_error(body: bytes, exc: msgspec.DecodeError) -> str:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return _utf8_error(body)
    return f"not valid JSON: {exc}"
