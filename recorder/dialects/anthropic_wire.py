"""The Anthropic Messages request as msgspec Structs, and what a decode error says.

Claude Code sends a 40-80 KB body every turn, so the body is decoded once by
msgspec straight into these typed Structs (unknown fields such as
`context_management` are ignored, which also drops every `cache_control`).
A body that does not decode is refused with `InvalidRequest` whose message
starts with the path of the offending field (`messages.3.content.1.type:
...`), so the server can answer 400. Translation: `recorder.dialects.translate`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from recorder.dialects.chat import InvalidRequest

_PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
_NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
_UnitFloat = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
_Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]


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


class RequestFields(_Base):
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


class AnthropicRequest(RequestFields, kw_only=True):
    """POST /v1/messages (and /count_tokens, where max_tokens may be absent)."""

    messages: list[Message]


class RawMessagesRequest(RequestFields, kw_only=True):
    """A request whose messages are left undecoded (each one's exact JSON bytes)."""

    messages: list[msgspec.Raw]


request_decoder = msgspec.json.Decoder(AnthropicRequest)
raw_messages_decoder = msgspec.json.Decoder(RawMessagesRequest)
message_decoder = msgspec.json.Decoder(Message)
_block_decoder = msgspec.json.Decoder(list[ContentBlock])


# --------------------------------------------------------------------------
# Error messages
# --------------------------------------------------------------------------

_PATH_RE = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_INDEX_RE = re.compile(r"\[(\d+)\]")
_TAG_RE = re.compile(r"^Invalid value '(?P<tag>[^']*)'$")


def from_validation_error(exc: msgspec.ValidationError) -> InvalidRequest:
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


def utf8_error(body: bytes) -> str:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not valid UTF-8 (byte {err.start}); send the JSON body encoded as UTF-8"
    return "not valid UTF-8; send the JSON body encoded as UTF-8"


def describe_decode_error(body: bytes, exc: msgspec.DecodeError) -> str:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return utf8_error(body)
    return f"not valid JSON: {exc}"
