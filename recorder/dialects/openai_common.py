"""What the two OpenAI dialects share: tools, tool choice, parts, images, decoding errors.

Both build Anthropic-shaped `translate.Message` values and hand them to
`translate.parse_request`, so the chat messages, digests, tool-result checks
and the per-session ParseCache are the Messages path's own: one
implementation of the chain logic, whatever the client spoke.
"""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import msgspec

from recorder.dialects.anthropic_wire import (
    AnthropicRequest,
    Base64Source,
    ImageBlock,
    Message,
    TextBlock,
    Tool,
    ToolChoice,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    UrlSource,
    from_validation_error,
)
from recorder.dialects.chat import ChatRequest, InvalidRequest
from recorder.dialects.json_limits import MAX_DEPTH, json_problem
from recorder.dialects.parse_cache import ParseCache
from recorder.dialects.translate import outside_messages, parse_request

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
_encoder = msgspec.json.Encoder()


def decode(body: bytes, kind: type[Any]) -> Any:
    """The body as the dialect's request Struct; InvalidRequest names the field.

    JSON limits (depth, 64-bit integers) first, as for every JSON body."""
    problem = json_problem(body)
    if problem is not None:
        raise InvalidRequest(problem, "body")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"not valid JSON (UTF-8): {exc}", "body") from None


def tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> Tool:
    schema = parameters if parameters is not None else {"type": "object", "properties": {}}
    return Tool(name=name, input_schema=schema, description=description or "")


def tool_choice(choice: str | dict[str, Any] | None, parallel: bool, field: str) -> ToolChoice:
    """`auto` | `none` | `required` | {"type": "function", "name"/"function": {"name"}}."""
    no_parallel = not parallel
    if choice is None or choice == "auto":
        return ToolChoiceAuto(disable_parallel_tool_use=no_parallel)
    if choice == "none":
        return ToolChoiceNone()
    if choice == "required":
        return ToolChoiceAny(disable_parallel_tool_use=no_parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        if isinstance(name, str) and name:
            return ToolChoiceTool(name=name, disable_parallel_tool_use=no_parallel)
    raise InvalidRequest(
        "must be 'auto', 'none', 'required' or a function tool choice with a name", field
    )


def image(url: str) -> ImageBlock:
    """An image part: a `data:` URL is inline base64, anything else is named by its URL."""
    if url.startswith("data:") and ";base64," in url:
        head, data = url[5:].split(";base64,", 1)
        return ImageBlock(source=Base64Source(media_type=head, data=data))
    return ImageBlock(source=UrlSource(url=url))


# The arguments become a tool_use `input` four levels deep in the translated
# body (messages, a message, its content, a block), which meets MAX_DEPTH too.
ARGUMENTS_MAX_DEPTH = MAX_DEPTH - 8


def arguments(text: str, field: str) -> dict[str, Any]:
    """A tool call's JSON-string arguments as the object the model wrote.

    The string is JSON inside JSON, so the body's limits never saw it: its
    depth is checked here (`json.loads` raised RecursionError past ~1,000
    levels), and a lone surrogate escape (`"\\ud800"`) is refused, since no
    UTF-8 encoder (the log's, the engine's) can write it. Both were 500s.
    """
    problem = json_problem(text.encode("utf-8", "surrogatepass"), ARGUMENTS_MAX_DEPTH)
    if problem is not None:
        raise InvalidRequest(f"{problem}; send the arguments as a JSON object string", field)
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"not valid JSON ({exc.msg}); send the arguments as a JSON object string", field
        ) from None
    if not isinstance(value, dict):
        raise InvalidRequest("must be a JSON object", field)
    try:
        _encoder.encode(value)
    except UnicodeEncodeError:
        raise InvalidRequest(
            "holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), "
            "which is not text; send valid Unicode",
            field,
        ) from None
    return value


# What `{"type": "json_object"}` asks of the output, in the form SGLang's JSON
# constraint takes (it has no "any JSON object" switch; this schema is that).
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


def output_schema(fmt: Any, field: str, *, nested: bool) -> dict[str, Any] | None:
    """The JSON schema an output format asks for (None: free text), or 400 naming the field.

    Chat's `response_format` holds the schema in `json_schema.schema` (`nested`),
    Responses' `text.format` in `schema`. As OpenAI's API: an unknown type, or
    `json_schema` without a schema, is refused rather than ignored; silently
    answering free text would hand the agent output its parser rejects.
    """
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind == "json_schema":
        holder = fmt.get("json_schema") if nested else fmt
        schema = holder.get("schema") if isinstance(holder, dict) else None
        if not isinstance(schema, dict):
            where = f"{field}.json_schema.schema" if nested else f"{field}.schema"
            raise InvalidRequest(
                "is required for type 'json_schema': the JSON schema (an object) the output "
                "must follow",
                where,
            )
        return schema
    raise InvalidRequest(
        f"type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'",
        f"{field}.type",
    )


def texts(parts: Sequence[TextBlock]) -> str:
    return "\n\n".join(p.text for p in parts)


def to_chat_request(
    fields: dict[str, Any],
    messages: list[Message],
    index_map: list[str],
    cache: ParseCache | None,
) -> ChatRequest:
    """The shared translation of Anthropic-shaped messages; errors named in the client's terms."""
    if not messages:
        raise InvalidRequest("at least one non-system message is required", index_map[-1])
    request = AnthropicRequest(messages=messages, **fields)
    try:
        # count_tokens=True: max_tokens is optional in the OpenAI dialects.
        return parse_request(_encoder.encode(request), count_tokens=True, cache=cache)
    except InvalidRequest as exc:
        raise _renamed(exc, index_map) from None


def _renamed(exc: InvalidRequest, index_map: list[str]) -> InvalidRequest:
    field = exc.field
    message = str(exc)[len(field) + 2 :] if field else str(exc)
    head, _, rest = field.partition(".")
    if head == "messages":
        index = rest.partition(".")[0]
        if index.isdigit() and int(index) < len(index_map) - 1:
            return InvalidRequest(message, index_map[int(index)])
    return InvalidRequest(message, field)


def encode_message(message: Message) -> bytes:
    return _encoder.encode(message)


def chat_request_from_pieces(
    fields: dict[str, Any], pieces: list[bytes], cache: ParseCache
) -> ChatRequest:
    """`to_chat_request` for messages already encoded (Anthropic-shaped JSON, one per piece)."""
    if not pieces:
        raise InvalidRequest("at least one non-system message is required", "messages")
    head = _encoder.encode(fields)
    body = b'{"messages":[' + b",".join(pieces) + b"]," + head[1:]
    pieces.clear()  # the body holds them now: one copy of a near-limit message, not two
    return parse_request(body, count_tokens=True, cache=cache)


class ConvertedMessages:
    """One session's OpenAI messages already converted, by their exact JSON bytes (LRU, bounded).

    Values are small tuples of bytes that the shared ParseCache keys on in turn,
    so a resent conversation is joined, not converted again. Charged twice the
    key's size (key + value); the oldest go beyond `max_entries` / `max_bytes`.
    """

    def __init__(self, max_entries: int = 4096, max_bytes: int = 32 << 20) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        # A message bigger than this is converted anew each time and never kept:
        # one 16 MB message kept its key and conversion (32 MB) in the session
        # until evicted, and it is sent once or twice, not every turn.
        self.max_entry_bytes = max_bytes // 32
        self._entries: OrderedDict[bytes, tuple[str, bytes]] = OrderedDict()
        self._nbytes = 0
        self._previous: list[bytes] = []
        self._keys: list[bytes] = []

    def get(self, index: int, data: bytes) -> tuple[bytes, tuple[str, bytes] | None]:
        """(the key for message `index` with bytes `data`, its conversion if known).

        The previous request's keys are kept in order: a message at the same
        position as before is matched by a byte compare (the old key's hash is
        cached), so only messages that moved or are new get hashed.
        """
        if index == 0:
            self._keys = []  # a new request (even if the last one stopped at an error)
        if len(data) > self.max_entry_bytes:
            self._keys.append(b"")  # never kept (see `max_entry_bytes`)
            return data, None
        previous = self._previous
        key = previous[index] if index < len(previous) and previous[index] == data else data
        self._keys.append(key)
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
        return key, hit

    def unkept(self, index: int) -> None:
        """Message `index` of this request is too big to keep (see `max_entry_bytes`)."""
        if index == 0:
            self._keys = []
        self._keys.append(b"")

    def done(self) -> None:
        """The request's messages are all looked up: its keys are the next one's `previous`."""
        self._previous, self._keys = self._keys, []

    def put(self, key: bytes, value: tuple[str, bytes]) -> None:
        if len(key) > self.max_entry_bytes:
            return
        self._entries[key] = value
        self._nbytes += len(key) + len(value[1])
        while self._entries and (
            len(self._entries) > self.max_entries or self._nbytes > self.max_bytes
        ):
            old, (_, data) = self._entries.popitem(last=False)
            self._nbytes -= len(old) + len(data)


_CONVERTED: weakref.WeakKeyDictionary[ParseCache, dict[str, ConvertedMessages]] = (
    weakref.WeakKeyDictionary()
)


def converted_messages(cache: ParseCache, dialect: str) -> ConvertedMessages:
    """The converted-message cache of one dialect that lives and dies with a session's ParseCache.

    One per dialect: the same JSON bytes may be a message in one dialect and
    an input item of another, converted differently.
    """
    by_dialect = _CONVERTED.get(cache)
    if by_dialect is None:
        by_dialect = _CONVERTED[cache] = {}
    found = by_dialect.get(dialect)
    if found is None:
        found = by_dialect[dialect] = ConvertedMessages()
    return found


# One message's conversion: ("system", its text), ("message", the Anthropic-shaped
# message's JSON) or ("skip", b""), from the message's JSON bytes and its field path.
Convert = Callable[[bytes, str], tuple[str, bytes]]


def join_through_cache(
    body: bytes,
    raws: Sequence[msgspec.Raw],
    field: str,
    memo: ConvertedMessages,
    convert: Convert,
    *,
    system: list[str],
    pieces: list[bytes],
) -> tuple[str | None, list[bytes]]:
    """(system prompt, Anthropic-shaped message pieces) of a request's messages, through `memo`.

    Only messages whose bytes `memo` has not seen are decoded and converted;
    leading system messages (while `pieces` is still empty) join `system`,
    later ones become system messages in place. JSON limits are checked on
    what is new: the body outside the messages, and each unseen message.
    """
    if json_problem(outside_messages(body, raws)) is not None:
        raise InvalidRequest("JSON limits", "body")  # the uncached path names the problem
    leading = not pieces
    for i, raw in enumerate(raws):
        if len(raw) > memo.max_entry_bytes:
            # Never kept: checked on a copy dropped at once, decoded from the body's own
            # bytes, so a near-limit message is not held twice while it is converted.
            memo.unkept(i)
            if json_problem(bytes(raw), MAX_DEPTH - 2) is not None:
                raise InvalidRequest("JSON limits", f"{field}.{i}")
            hit = convert(raw, f"{field}.{i}")  # type: ignore[arg-type]
        else:
            key, hit = memo.get(i, bytes(raw))
        if hit is None:
            if json_problem(key, MAX_DEPTH - 2) is not None:  # two levels deep in the body
                raise InvalidRequest("JSON limits", f"{field}.{i}")
            hit = convert(key, f"{field}.{i}")
            memo.put(key, hit)
        kind, value = hit
        if kind == "system" and leading:
            system.append(value.decode())
        elif kind == "system":
            pieces.append(encode_message(Message(role="system", content=value.decode())))
        elif kind == "message":
            leading = False
            pieces.append(value)
    memo.done()
    return "\n\n".join(system) or None, pieces
