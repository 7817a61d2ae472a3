"""Anthropic Messages request -> `ChatRequest`, the turn model every dialect shares.

The body is decoded into the Structs of `recorder.dialects.anthropic_wire`;
anything the chat template cannot represent is refused with `InvalidRequest`
naming the offending field. Each message is translated on its own (a
`_Piece`), then the cross-message rules run (`_Conversation`: consecutive
assistant messages merge, tool results must follow their tool_use). The
OpenAI dialects translate their own wire into these Structs first, so all
three share this translation and its digests (`recorder.dialects.chat`).

With a `ParseCache` (one per session, `recorder.dialects.parse_cache`) only
the messages whose JSON bytes were not seen before are decoded, validated
and translated; the result is the same as without the cache, and so is
every error (on any error the body is parsed again without the cache, which
names the field exactly as before).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any, Literal, NamedTuple

import msgspec
import numpy as np

from recorder.dialects.anthropic_wire import (
    AnthropicRequest,
    Base64Source,
    ContentBlock,
    ImageBlock,
    Message,
    RequestFields,
    TextBlock,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    Tool,
    ToolChoice,
    ToolChoiceAny,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    UrlSource,
    describe_decode_error,
    from_validation_error,
    message_decoder,
    raw_messages_decoder,
    request_decoder,
    utf8_error,
)
from recorder.dialects.chat import (
    ChatRequest,
    InvalidRequest,
    digest_obj,
    digest_text,
    message_digest,
    shared_tools,
)
from recorder.dialects.json_limits import MAX_DEPTH, json_problem
from recorder.dialects.parse_cache import (
    CachedPiece,
    ChatMessages,
    KnownPrefix,
    ParseCache,
    pack_message,
    unpack_message,
)

BILLING_HEADER_PREFIX = "x-anthropic-billing-header"
_BLANKS = re.compile(rb"[ \t\r\n]*")  # JSON whitespace
# A tool list's exact JSON (key order kept): the key of its shared schemas. Shared
# only from a body whose fields around the messages are at most this big.
_tools_encoder = msgspec.json.Encoder()
_MAX_SHARED_TOOLS_BYTES = 1 << 20


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
        req = request_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from None
    except UnicodeDecodeError:
        raise InvalidRequest(utf8_error(body), "body") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(describe_decode_error(body, exc), "body") from None
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
    known = cache.known_prefix(body)
    if known is not None:
        chat = _parse_after_known(body, count_tokens, cache, known)
        if chat is not None:
            return chat
    req = raw_messages_decoder.decode(body)
    span = message_span(body, req.messages)
    outside_len = _outside_len(body, span)
    if not _outside_within_limits(body, span):
        raise InvalidRequest("JSON limits", "body")  # the uncached path names the problem
    _check_max_tokens(req, count_tokens)
    _check_head(req, len(req.messages))
    conversation = _Conversation(system_text(req.system))
    cache.add_messages(req.messages, conversation, _translate_raw, body=body, span=span)
    return _chat_request(req, conversation, share_tools=outside_len <= _MAX_SHARED_TOOLS_BYTES)


def _parse_after_known(
    body: bytes, count_tokens: bool, cache: ParseCache, known: KnownPrefix
) -> ChatRequest | None:
    """The request, decoding only what follows the previous request's messages.

    `body` repeats the previous body through its last message (`known`):
    those messages are cut out, and the rest (the fields around the
    messages, and the messages after them) is decoded, checked for JSON
    limits and translated as a request of its own, whose messages continue
    the previous request's conversation. A 570 kB body costs what its new
    messages cost, not a decoder pass over all of it (~0.2 ms). None when
    the body does not go on as a list of messages would (the full path
    decides, and names any problem).
    """
    after = _BLANKS.match(body, known.end).end()  # type: ignore[union-attr]
    if after >= len(body) or body[after] not in b",]":
        return None
    more = body[after] == ord(",")
    rest = after + 1 if more else after
    short = body[: known.first] + body[rest:]
    req = raw_messages_decoder.decode(short)
    if more and not req.messages:
        return None  # "[..., ]": not JSON, though the rest alone would be
    # The new messages are checked one by one as they are translated (`_translate_raw`).
    span = message_span(short, req.messages)
    if not _outside_within_limits(short, span):
        raise InvalidRequest("JSON limits", "body")  # the uncached path names the problem
    state: _ConversationState = known.state
    system = system_text(req.system)
    if system != state.system:
        return None  # another system prompt: another conversation
    _check_max_tokens(req, count_tokens)
    _check_head(req, known.n_messages + len(req.messages))
    conversation = _Conversation.resume(state)
    cache.add_new_messages(known, body, rest, req.messages, conversation, _translate_raw)
    return _chat_request(req, conversation, share_tools=len(short) <= _MAX_SHARED_TOOLS_BYTES)


# Digests of the bytes around a request's messages (system prompt, tools, metadata)
# that met the JSON limits. A session sends the same ones every turn, its subagents
# the same tools: ~25-70 kB for Claude Code, ~0.3-1 ms to scan, ~15-40 us to digest.
_OUTSIDE_OK: set[bytes] = set()
_MAX_OUTSIDE_OK = 1024


def _outside_within_limits(body: bytes, span: tuple[int, int] | None) -> bool:
    """Does `body` without its messages (`span`) meet the JSON limits? (`json_problem`)

    A message is checked on its own when it is translated (`_translate_raw`).
    The answer is kept by the outside bytes' SHA-256: the same bytes,
    the same answer, and a body cannot be made to collide with one checked.
    """
    key = _outside_digest(body, span)
    if key in _OUTSIDE_OK:
        return True
    outside = body if span is None else body[: span[0]] + body[span[1] :]
    if json_problem(outside) is not None:
        return False
    if len(_OUTSIDE_OK) >= _MAX_OUTSIDE_OK:
        _OUTSIDE_OK.clear()
    _OUTSIDE_OK.add(key)
    return True


def _outside_digest(body: bytes, span: tuple[int, int] | None) -> bytes:
    """The digest of `body` without `span`, hashed in place (no copy of the outside).

    SHA-256: CPUs with SHA extensions hash it ~2x faster than BLAKE2b (~15 us for 25 kB).
    """
    digest = hashlib.sha256()
    with memoryview(body) as view:
        if span is None:
            digest.update(view)
        else:
            digest.update(view[: span[0]])
            digest.update(view[span[1] :])
    return digest.digest()


def _outside_len(body: bytes, span: tuple[int, int] | None) -> int:
    return len(body) if span is None else len(body) - (span[1] - span[0])


def outside_messages(body: bytes, raws: Sequence[msgspec.Raw]) -> bytes:
    """`body` without the bytes of its messages (each message is checked on its own,
    once, when the cache first sees it)."""
    span = message_span(body, raws)
    return body if span is None else body[: span[0]] + body[span[1] :]


def message_span(body: bytes, raws: Sequence[msgspec.Raw]) -> tuple[int, int] | None:
    """Where in `body` its messages `raws` start and end, None if they are not views of it.

    msgspec's `Raw` is a view into `body`, so the span is found by address,
    never by searching."""
    if not raws:
        return None
    base = _address(body)
    start = _address(raws[0]) - base
    end = _address(raws[-1]) - base + len(raws[-1])
    if not 0 <= start <= end <= len(body):
        return None
    return start, end


def _address(buffer: Any) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).__array_interface__["data"][0])


def _check_max_tokens(req: RequestFields, count_tokens: bool) -> None:
    if req.max_tokens is None and not count_tokens:
        raise InvalidRequest("field required", "max_tokens")


def _check_head(req: RequestFields, n_messages: int) -> None:
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


def _chat_request(
    req: RequestFields, conversation: _Conversation, *, share_tools: bool = False
) -> ChatRequest:
    """The translated request. `share_tools`: its tool schemas may be the ones other
    requests with the same tools share (`chat.shared_tools`); only for a body whose
    fields around the messages are small (a shared list is kept, and keyed by its JSON).
    """
    if conversation.last_role == "assistant":
        raise InvalidRequest(
            "the last message must be from the user (assistant prefill is not supported)",
            f"messages.{conversation.n_input_messages - 1}.role",
        )
    system = conversation.system
    listed = [t for t in req.tools or [] if not t.defer_loading]
    if share_tools:
        tools, render_digest = shared_tools(
            _tools_encoder.encode(listed), lambda: [_tool_schema(t) for t in listed]
        )
    else:
        tools = [_tool_schema(t) for t in listed]
        render_digest = digest_obj(tools)
    deferred = {t.name: _tool_schema(t) for t in req.tools or [] if t.defer_loading}
    by_name = {**{t["function"]["name"]: t for t in tools}, **deferred}
    messages, digests, loaded = conversation.messages, conversation.digests, ()
    if conversation.reference_at:
        messages, digests, loaded = _load_references(
            messages, digests, conversation.reference_at, by_name
        )
    thinking = req.thinking
    template_kwargs: dict[str, Any] = {}
    if thinking is not None:
        template_kwargs["enable_thinking"] = not isinstance(thinking, ThinkingDisabled)
    choice = req.tool_choice
    return ChatRequest(
        model=req.model,
        messages=ChatMessages(messages) if conversation.packed else messages,  # type: ignore[arg-type]
        tools=tools,
        message_digests=tuple(digests),
        system=system,
        system_digest=conversation.system_digest,
        render_digest=render_digest,
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
        # Loading a tool changed the text of the messages that reference it.
        text_chars=-1 if loaded else conversation.text_chars,
    )


def _json_schema(req: RequestFields) -> dict[str, Any] | None:
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
    # Characters of its text a template renders (0 for an assistant message:
    # `ChatRequest.text_chars`), and which of its messages hold a tool_reference.
    text_chars: int
    reference_at: tuple[int, ...]


def _piece(
    role: Literal["user", "assistant", "system"],
    messages: tuple[dict[str, Any], ...],
    tool_use_ids: tuple[str, ...] = (),
    tool_result_ids: tuple[str, ...] = (),
) -> _Piece:
    """A `_Piece` with its digests and counts (user, tool and system content is a string)."""
    digests = tuple(message_digest(m) for m in messages)
    if role == "assistant":
        return _Piece(role, messages, digests, tool_use_ids, tool_result_ids, 0, ())
    chars = sum(len(m["content"]) for m in messages)
    at = tuple(i for i, m in enumerate(messages) if "tool_references" in m)
    return _Piece(role, messages, digests, tool_use_ids, tool_result_ids, chars, at)


def _translate_message(message: Message, path: str, seen: set[str]) -> _Piece:
    """`seen`: the tool_use ids of the messages before this one.

    A system message without text (Claude Code 2.1.33x sends `{"role": "system",
    "content": []}` after `/compact`) adds nothing the model could read: it
    becomes no chat message, rather than an empty system block in the prompt.
    """
    if message.role == "system" and _is_empty_system(message.content, path):
        return _piece("system", ())
    if isinstance(message.content, str):
        # The short form of one text block: any role's chat message is that text
        # (what the general path makes of it, without building the block).
        return _piece(message.role, ({"role": message.role, "content": message.content},))
    blocks = message.content
    if message.role == "assistant":
        reply = _assistant_turn(blocks, path)
        calls = tuple(b.id for b in blocks if isinstance(b, ToolUseBlock))
        return _piece("assistant", (reply,), calls)
    if message.role == "user":
        out = tuple(_user_messages(blocks, path, seen))
        results = tuple(b.tool_use_id for b in blocks if isinstance(b, ToolResultBlock))
        return _piece("user", out, (), results)
    return _piece("system", ({"role": "system", "content": _text_only(blocks, path)},))


def _translate_raw(data: bytes, index: int, conversation: _Conversation) -> CachedPiece:
    """One message's JSON bytes, checked, decoded and translated (for the ParseCache)."""
    # A message sits two levels deep in the body ({"messages": [ ... ]}).
    if json_problem(data, MAX_DEPTH - 2) is not None:
        raise InvalidRequest("JSON limits", f"messages.{index}")  # named by the caller
    message = message_decoder.decode(data)
    return tuple(_translate_message(message, f"messages.{index}", conversation.seen))  # type: ignore[return-value]


class _ConversationState(NamedTuple):
    """A `_Conversation` after some messages (copies: later changes to it do not show)."""

    system: str
    system_digest: str
    messages: tuple[dict[str, Any] | bytes, ...]
    digests: tuple[str, ...]
    seen: frozenset[str]
    trailing_tool_result_ids: tuple[str, ...]
    last_role: str
    last_is_assistant: bool
    n_input_messages: int
    text_chars: int
    reference_at: tuple[int, ...]
    packed: bool


class _Conversation:
    """The chat messages of a request, built message by message under the cross-message rules.

    Consecutive assistant messages merge (the API treats them as one turn);
    the tool_result ids after the last assistant message are collected.
    Counted on the way, so that no later step walks every message again:
    the characters of the text every template renders (`ChatRequest.text_chars`)
    and which messages hold a `tool_reference`. A message may be packed (a
    ParseCache's piece): it stays packed unless something reads it
    (`parse_cache.ChatMessages`), so neither the request nor the snapshot kept
    for the next one holds a dict of every message.
    """

    def __init__(self, system: str) -> None:
        self.system = system
        # Once per conversation: a request that resumes it has the same system text
        # (checked), and Claude Code's is tens of kB.
        self.system_digest = digest_text(system)
        self.messages: list[dict[str, Any] | bytes] = []
        self.digests: list[str] = []
        self.text_chars = len(system)
        self.reference_at: list[int] = []  # indexes into `messages`
        self.packed = False  # whether any of `messages` is packed
        if system:
            prompt = {"role": "system", "content": system}
            self.messages.append(prompt)
            self.digests.append(message_digest(prompt))
        self.seen: set[str] = set()
        self.trailing_tool_result_ids: list[str] = []
        self.last_role = ""
        self.last_is_assistant = False  # the last chat message's role (merges)
        self.n_input_messages = 0

    def snapshot(self) -> _ConversationState:
        """Its state now, for a later request that repeats these messages (`resume`)."""
        return _ConversationState(
            self.system,
            self.system_digest,
            tuple(self.messages),
            tuple(self.digests),
            frozenset(self.seen),
            tuple(self.trailing_tool_result_ids),
            self.last_role,
            self.last_is_assistant,
            self.n_input_messages,
            self.text_chars,
            tuple(self.reference_at),
            self.packed,
        )

    @classmethod
    def resume(cls, state: _ConversationState) -> _Conversation:
        """The conversation as it was at `snapshot`, to add the messages that follow."""
        conversation = cls.__new__(cls)
        conversation.system = state.system
        conversation.system_digest = state.system_digest
        conversation.messages = list(state.messages)
        conversation.digests = list(state.digests)
        conversation.seen = set(state.seen)
        conversation.trailing_tool_result_ids = list(state.trailing_tool_result_ids)
        conversation.last_role = state.last_role
        conversation.last_is_assistant = state.last_is_assistant
        conversation.n_input_messages = state.n_input_messages
        conversation.text_chars = state.text_chars
        conversation.reference_at = list(state.reference_at)
        conversation.packed = state.packed
        return conversation

    def check_tool_results(self, piece: CachedPiece, index: int) -> None:
        """A message translated in another conversation: do its tool_results follow their tool_use?"""
        for tool_use_id in piece[4]:
            if tool_use_id not in self.seen:
                raise InvalidRequest(
                    f"no tool_use with id {tool_use_id!r} earlier in the conversation",
                    f"messages.{index}",
                )

    def add(self, piece: CachedPiece | _Piece) -> None:
        """Add a `_Piece` (or its cached plain tuple, messages packed)."""
        role, messages, digests, tool_use_ids, tool_result_ids, text_chars, reference_at = piece
        self.n_input_messages += 1
        self.last_role = role
        if messages and isinstance(messages[0], bytes):
            self.packed = True
        if role != "assistant":
            self.trailing_tool_result_ids.extend(tool_result_ids)
        else:
            self.seen.update(tool_use_ids)
            self.trailing_tool_result_ids.clear()
            if self.last_is_assistant:
                self._merge(messages[0])
                return
        if messages:
            self.last_is_assistant = role == "assistant"
        offset = len(self.messages)
        self.reference_at.extend(offset + i for i in reference_at)
        self.messages.extend(messages)
        self.digests.extend(digests)
        self.text_chars += text_chars

    def _merge(self, item: dict[str, Any] | bytes) -> None:
        """An assistant message right after another: one turn (kept packed if it came so)."""
        merged = _merge_assistant(unpack_message(self.messages[-1]), unpack_message(item))
        self.messages[-1] = pack_message(merged) if isinstance(item, bytes) else merged
        self.digests[-1] = message_digest(merged)


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
    messages: list[dict[str, Any] | bytes],
    digests: list[str],
    reference_at: Sequence[int],
    tools: dict[str, dict[str, Any]],
) -> tuple[list[dict[str, Any] | bytes], list[str], tuple[str, ...]]:
    """Each `tool_reference` becomes the referenced tool's schema, where the model meets it.

    The Messages API expands a reference into the tool's full definition at
    that point of the context, and a `defer_loading` tool is not in the
    prompt's tool list before. The template renders the list as one JSON
    schema a line inside <tools></tools>; a loaded tool reads the same way,
    inside the tool result. So deferred tools stay out of `render_digest`
    (Claude Code adds a tool to `tools` once it is loaded: that must not
    break the chain), and a loaded message's digest is that of its expanded
    text. Messages are shared with the ParseCache: copied, never changed.
    Only the messages at `reference_at` (in order) hold references.

    Also returns the names loaded, in order of first reference: from that
    point on the model may call them (as with the real API).
    """
    out, out_digests = list(messages), list(digests)
    loaded_names: dict[str, None] = {}
    for i in reference_at:
        message = unpack_message(messages[i])
        text = message["content"]
        for name in message["tool_references"]:
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
        out[i] = loaded
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
