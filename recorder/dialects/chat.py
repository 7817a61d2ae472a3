"""The turn model every dialect translates into: `ChatRequest`, message digests, dispatches.

A `ChatRequest` is what the token layer and the engine need of one request,
whatever its wire format: chat-template messages, tool schemas, sampling
settings. Besides the messages it carries digests of a normalized form of
each. The token-chain layer compares them to decide whether a request
extends an earlier one: the normalized form ignores what a client may
legitimately change when it echoes our answer back (surrounding whitespace,
cache_control, signatures, block splitting, the text beside tool calls) and
keeps what the model saw.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

DISPATCH_TOOL_NAMES = frozenset({"Agent", "Task"})


class InvalidRequest(ValueError):
    """The request body cannot be served; the message names the offending field."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


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
    # Characters of the user, tool and system messages' text, counted as `messages`
    # were built (-1: not counted); `recorder.model.admission` bounds the prompt by it.
    text_chars: int = -1

    @property
    def callable_tools(self) -> list[dict[str, Any]]:
        """The tools the model may call now: the listed ones and the loaded deferred ones."""
        return [*self.tools, *self.loaded_tools] if self.loaded_tools else self.tools


# --------------------------------------------------------------------------
# Tool schemas shared by the requests that send the same tools
# --------------------------------------------------------------------------

# An agent sends the same tools every turn (Claude Code: ~20 schemas, ~70 kB of
# JSON). Their schemas are built once per exact tool list and shared, never
# changed (as the parse cache's messages are), and the JSON a chat template
# makes of each (`tojson`, every turn's render) is kept with it.
_MAX_TOOL_LISTS = 16
_tool_lists: dict[bytes, tuple[list[dict[str, Any]], str]] = {}
_tool_json: dict[int, tuple[dict[str, Any], dict[tuple[Any, ...], str]]] = {}


def shared_tools(
    key: bytes, build: Callable[[], list[dict[str, Any]]]
) -> tuple[list[dict[str, Any]], str]:
    """(the tool schemas `build()` makes, their `digest_obj`) for the tool list whose
    exact JSON is `key`: built once, the same dicts for every request that sends it.

    The caller gets its own list (the dicts in it are shared: never change them).
    """
    found = _tool_lists.get(key)
    if found is None:
        schemas = build()
        found = (schemas, digest_obj(schemas))
        if len(_tool_lists) >= _MAX_TOOL_LISTS:
            _tool_lists.clear()
            _tool_json.clear()
        _tool_lists[key] = found
        for schema in schemas:
            _tool_json[id(schema)] = (schema, {})
    return list(found[0]), found[1]


def tool_json(value: Any, options: tuple[Any, ...], dumps: Callable[..., str]) -> str:
    """`dumps(value, *options)`, kept for a schema of `shared_tools` (any other value:
    computed each time)."""
    entry = _tool_json.get(id(value))
    if entry is None or entry[0] is not value:  # not a shared schema (or one dropped since)
        return dumps(value, *options)
    text = entry[1].get(options)
    if text is None:
        text = entry[1][options] = dumps(value, *options)
    return text


# --------------------------------------------------------------------------
# Digests of a normalized form
# --------------------------------------------------------------------------

_encoder = msgspec.json.Encoder(order="sorted")


# Texts longer than this are digested piece by piece (`_digest_with_text`, `digest_text`):
# the same digest without a whole encoded (and stripped) copy of a near-limit text.
_PIECE_CHARS = 1 << 20
_SLOT = "\u2063DIGEST-TEXT-SLOT\u2063"


def digest_obj(obj: Any) -> str:
    return hashlib.blake2b(_encoder.encode(obj), digest_size=16).hexdigest()


def digest_text(text: str, start: int = 0, end: int | None = None) -> str:
    """Digest of `text[start:end]`'s UTF-8 bytes."""
    end = len(text) if end is None else end
    if end - start <= _PIECE_CHARS:
        return hashlib.blake2b(text[start:end].encode(), digest_size=16).hexdigest()
    h = hashlib.blake2b(digest_size=16)
    for at in range(start, end, _PIECE_CHARS):
        h.update(text[at : min(at + _PIECE_CHARS, end)].encode())
    return h.hexdigest()


def _digest_with_text(role: str, text: str, rest: tuple[Any, ...]) -> str:
    """`digest_obj((role, text.strip(), *rest))`, without copying a long text.

    JSON escapes a string character by character, so the encoding of the
    whole is the encodings of its pieces joined; the pieces go between the
    encoding's head and tail found around a placeholder.
    """
    start, end = _stripped_span(text)
    if end - start <= _PIECE_CHARS:
        return digest_obj((role, text[start:end], *rest))
    head, _, tail = _encoder.encode((role, _SLOT, *rest)).partition(_encoder.encode(_SLOT))
    h = hashlib.blake2b(head, digest_size=16)
    h.update(b'"')
    for at in range(start, end, _PIECE_CHARS):
        h.update(_encoder.encode(text[at : min(at + _PIECE_CHARS, end)])[1:-1])
    h.update(b'"' + tail)
    return h.hexdigest()


def _stripped_span(text: str) -> tuple[int, int]:
    """(start, end) of `text.strip()` in `text`, looking only at the blanks at its ends."""
    if len(text) <= _PIECE_CHARS:
        stripped = text.lstrip()
        start = len(text) - len(stripped)
        return start, start + len(stripped.rstrip())
    start = 0
    while start < len(text):
        window = text[start : start + 4096]
        kept = window.lstrip()
        start += len(window) - len(kept)
        if kept:
            break
    end = len(text)
    while end > start:
        window = text[max(start, end - 4096) : end]
        kept = window.rstrip()
        end -= len(window) - len(kept)
        if kept:
            break
    return start, end


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
    content = message.get("content") or ""
    rest = (message.get("tool_call_id"), message.get("is_error", False))
    digest = _digest_with_text(message["role"], content, (ids, *rest))
    if ids and not content.isspace() and content:
        digest += "|" + digest_obj((message["role"], "", ids, *rest))
    reasoning = message.get("reasoning_content") or ""
    start, end = _stripped_span(reasoning)
    return f"{digest}+{digest_text(reasoning, start, end)}" if end > start else digest


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


def find_dispatches(content: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(tool_use id, prompt) of every Agent/Task subagent dispatch in response `content`."""
    found = []
    for block in content:
        if block.get("type") == "tool_use" and block.get("name") in DISPATCH_TOOL_NAMES:
            prompt = (block.get("input") or {}).get("prompt")
            found.append((str(block["id"]), prompt if isinstance(prompt, str) else ""))
    return found
