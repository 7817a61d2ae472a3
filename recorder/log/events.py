"""The event schema: every fact and decision of an agent run, as msgspec Structs.

Events are the source of truth; everything else (samples, summaries) is derived
by replaying them. This module does no I/O, reads no clock, draws no random
numbers. Token arrays never live inside an event: events hold an `ArrayRef`
into the store's content-addressed array table.

Each event type has a `VERSION`. The stored row keeps the version it was
written at; `decode_event` upcasts older payloads to the current struct
through the functions registered in `UPCASTERS`.

Payloads are msgpack arrays (`array_like`): the fields in `ARRAY_LAYOUTS`
order, no field names, no type tag (`encode_event`), compressed against a
fixed dictionary when that helps (`packing`). Field names were ~35% of an
event's bytes, and every turn writes eight events. Rows written before (revision
0004 and older) hold msgpack maps and read back as they always did.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import msgspec

from recorder.log import packing
from recorder.log.ids import uuid7

# --------------------------------------------------------------------------
# Array references (token ids, logprobs, routed experts live in the store)
# --------------------------------------------------------------------------

DType = Literal["int32", "float32", "float64", "uint8"]


class ArrayRef(msgspec.Struct, frozen=True, array_like=True):
    """A content-addressed handle to a 1-D array held by the store.

    `digest` names the whole array (a hash chain over its stored pieces), so
    equal refs mean equal contents. `length` is the element count.
    """

    digest: bytes
    length: int
    dtype: DType = "int32"


# --------------------------------------------------------------------------
# Base class
# --------------------------------------------------------------------------


class Event(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    tag_field="type",
    omit_defaults=True,
    array_like=True,
):
    """Base of every event payload. Subclasses set `tag` and `VERSION`.

    Stored as an array, so a field's position is its identity: add fields
    at the end only, with a default, and bump `VERSION` with an entry in
    `ARRAY_LAYOUTS` for the old one (see `decode_event`).
    """

    VERSION: ClassVar[int] = 1
    KIND: ClassVar[Literal["fact", "decision"]] = "fact"


class Decision(Event, frozen=True, kw_only=True):
    """A choice made by code, tagged with the rules version that made it."""

    KIND: ClassVar[Literal["fact", "decision"]] = "decision"
    rules_version: str


# --------------------------------------------------------------------------
# Facts: session lifecycle
# --------------------------------------------------------------------------


class TokenizerIdentity(msgspec.Struct, frozen=True, kw_only=True):
    name_or_path: str
    vocab_size: int
    vocab_digest: str
    chat_template_digest: str
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None


class SessionOpened(Event, frozen=True, kw_only=True, tag="session_opened"):
    session_id: str
    metadata: dict[str, Any] = {}
    config: dict[str, Any] = {}
    tokenizer: TokenizerIdentity | None = None
    context_length: int | None = None
    engine_url: str | None = None
    attempt: int = 0


class SessionClosed(Event, frozen=True, kw_only=True, tag="session_closed"):
    status: Literal["completed", "failed", "aborted", "truncated"] = "completed"
    reason: str = ""


class SessionFailed(Event, frozen=True, kw_only=True, tag="session_failed"):
    """An exception inside one session's work: logged, recorded, contained."""

    where: str
    error_type: str
    message: str
    traceback: str = ""


# --------------------------------------------------------------------------
# Facts: one Messages request and its turn
# --------------------------------------------------------------------------


class MessagesRequest(Event, frozen=True, kw_only=True, tag="messages_request"):
    """The client's request, kept whole (raw body as a uint8 array ref),
    plus a small digest the reducer needs without re-parsing the body.

    v2 added `n_chat_messages` (messages after translation, system included)
    and `n_tools`; None = not recorded (a v1 event).
    v3 added `answer_keys`: the assistant messages the request carries, each
    as `translate.message_key` of its digest, when the request extends no
    chain (an extending request's earlier messages are that chain's tokens):
    the reducer's evidence that the client kept an answer it branched away
    from, e.g. the turns kept verbatim after a compaction summary. None = not
    recorded (an extending request, or a v1/v2 event).
    """

    VERSION: ClassVar[int] = 3
    request_id: str
    turn: int
    body: ArrayRef
    path: str = "/v1/messages"
    stream: bool = False
    system_digest: str = ""
    n_messages: int = 0
    tool_result_ids: tuple[str, ...] = ()
    model: str = ""
    n_chat_messages: int | None = None
    n_tools: int | None = None
    # The wire format of `body` (recorder/dialects); logs from before dialects are Anthropic's.
    dialect: str = "anthropic"
    answer_keys: tuple[str, ...] | None = None


class RenderedInput(Event, frozen=True, kw_only=True, tag="rendered_input"):
    """The exact engine input for a turn.

    `input_ids` extends the chain's previous full sequence when `prefix_len`
    > 0: input_ids[:prefix_len] are reused tokens, the rest were newly rendered.
    """

    request_id: str
    turn: int
    chain_id: int
    input_ids: ArrayRef
    prefix_len: int = 0
    new_messages: int = 0


class GenerateAttempt(Event, frozen=True, kw_only=True, tag="generate_attempt"):
    request_id: str
    turn: int
    attempt: int
    rid: str
    engine_url: str = ""
    # Tokens sent in this attempt beyond the turn's input (resume: partial output).
    resumed_tokens: int = 0
    max_new_tokens: int = 0
    sampling_params: dict[str, Any] = {}


class GenerateResult(Event, frozen=True, kw_only=True, tag="generate_result"):
    """One attempt's output. For a resumed turn, each attempt's result holds
    only the tokens produced in that attempt."""

    request_id: str
    turn: int
    attempt: int
    rid: str
    output_ids: ArrayRef
    logprobs: ArrayRef | None
    finish_reason: Literal["stop", "length", "abort", "unknown"]
    finish_detail: str = ""
    weight_version: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    routed_experts: ArrayRef | None = None
    latency_s: float = 0.0


class TurnAborted(Event, frozen=True, kw_only=True, tag="turn_aborted"):
    """An attempt ended by an engine abort (weight update, cancel)."""

    request_id: str
    turn: int
    attempt: int
    rid: str
    partial_tokens: int
    message: str = ""


class TurnResumed(Event, frozen=True, kw_only=True, tag="turn_resumed"):
    request_id: str
    turn: int
    attempt: int
    resumed_tokens: int
    remaining_new_tokens: int


class TurnFailed(Event, frozen=True, kw_only=True, tag="turn_failed"):
    """The turn produced no usable output (e.g. logprobs missing, budget out)."""

    request_id: str
    turn: int
    reason: str


class EngineError(Event, frozen=True, kw_only=True, tag="engine_error"):
    request_id: str
    turn: int
    attempt: int = 0
    kind: Literal["unreachable", "http", "timeout", "protocol"] = "http"
    status: int = 0
    message: str = ""


class ClientDisconnected(Event, frozen=True, kw_only=True, tag="client_disconnected"):
    request_id: str
    turn: int
    rid: str = ""


class ResponseSent(Event, frozen=True, kw_only=True, tag="response_sent"):
    request_id: str
    turn: int
    content: list[dict[str, Any]]
    stop_reason: str
    usage: dict[str, int] = {}
    status: int = 200
    # Reasoning the model produced but the response left out (the request did not enable
    # thinking, and the real API never returns a thinking block then).
    reasoning: str = ""
    # Which output parser answered: backend, version, names ("" before it was recorded).
    parser: str = ""


class RequestRejected(Event, frozen=True, kw_only=True, tag="request_rejected"):
    """A request refused before any turn started (4xx)."""

    request_id: str
    status: int
    error_type: str
    message: str


# --------------------------------------------------------------------------
# Facts: sandbox and reward
# --------------------------------------------------------------------------


class SandboxEvent(Event, frozen=True, kw_only=True, tag="sandbox_event"):
    kind: str
    detail: dict[str, Any] = {}


class RewardAssigned(Event, frozen=True, kw_only=True, tag="reward_assigned"):
    """v1 stored `{"value": float}`; v2 renamed it to `reward` and added `detail`."""

    VERSION: ClassVar[int] = 2
    reward: float
    detail: dict[str, Any] = {}


# --------------------------------------------------------------------------
# Live state, for a fast restart
# --------------------------------------------------------------------------


class StateSnapshot(Event, frozen=True, kw_only=True, tag="state_snapshot"):
    """The live server's state of a session after an answered turn (a cache of the log).

    Written in the same append as the turn's ResponseSent, so a restart
    rebuilds the session from its newest snapshot plus the events after it
    instead of replaying every turn (`recorder.server.restore`). `state` is
    opaque here: `recorder.server.snapshot` encodes it at its own `format`
    number, and a snapshot this code cannot use (another format, damaged) is
    skipped for the full replay. Token arrays live in the array store
    (`state` names them by ref), so a snapshot costs a few bytes per message,
    not per token. It carries no `turn` or `request_id`: the reducer and
    every sample ignore it.
    """

    format: int
    state: bytes


# --------------------------------------------------------------------------
# Decisions
# --------------------------------------------------------------------------


class ChainDecision(Decision, frozen=True, kw_only=True, tag="chain_decision"):
    """Which chain a request extended, or why it started a new one.

    v2 added the reason "side" (a title or classification request); v1
    payloads read unchanged.
    """

    VERSION: ClassVar[int] = 2
    request_id: str
    turn: int
    chain_id: int
    action: Literal["extend", "new"]
    reason: Literal["first", "extends", "compaction", "subagent", "diverged", "side"] = "extends"
    parent_chain_id: int | None = None
    dispatch_tool_use_id: str | None = None


class TitoVerdict(Decision, frozen=True, kw_only=True, tag="tito_verdict"):
    """Does decode -> re-encode of the turn's output give back the same ids?"""

    request_id: str
    turn: int
    ok: bool
    first_divergence: int | None = None
    reencoded_ids: ArrayRef | None = None


class ClampApplied(Decision, frozen=True, kw_only=True, tag="clamp_applied"):
    request_id: str
    turn: int
    requested: int
    clamped_to: int
    context_length: int


# --------------------------------------------------------------------------
# The union, the envelope, and (de)serialisation
# --------------------------------------------------------------------------

AnyEvent = (
    SessionOpened
    | SessionClosed
    | SessionFailed
    | MessagesRequest
    | RenderedInput
    | GenerateAttempt
    | GenerateResult
    | TurnAborted
    | TurnResumed
    | TurnFailed
    | EngineError
    | ClientDisconnected
    | ResponseSent
    | RequestRejected
    | SandboxEvent
    | RewardAssigned
    | StateSnapshot
    | ChainDecision
    | TitoVerdict
    | ClampApplied
)

EVENT_TYPES: dict[str, type[Event]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in AnyEvent.__args__  # type: ignore[attr-defined]
}

# The field order of each (type, version) ever stored as an array: the
# current versions' must equal their structs' (checked at import), and an
# older one stays here so its rows can be upcast by name (`_as_dict`).
ARRAY_LAYOUTS: dict[tuple[str, int], tuple[str, ...]] = {
    ("session_opened", 1): (
        "session_id", "metadata", "config", "tokenizer", "context_length", "engine_url", "attempt",
    ),
    ("session_closed", 1): ("status", "reason"),
    ("session_failed", 1): ("where", "error_type", "message", "traceback"),
    ("messages_request", 3): (
        "request_id", "turn", "body", "path", "stream", "system_digest", "n_messages",
        "tool_result_ids", "model", "n_chat_messages", "n_tools", "dialect", "answer_keys",
    ),
    ("rendered_input", 1): (
        "request_id", "turn", "chain_id", "input_ids", "prefix_len", "new_messages",
    ),
    ("generate_attempt", 1): (
        "request_id", "turn", "attempt", "rid", "engine_url", "resumed_tokens",
        "max_new_tokens", "sampling_params",
    ),
    ("generate_result", 1): (
        "request_id", "turn", "attempt", "rid", "output_ids", "logprobs", "finish_reason",
        "finish_detail", "weight_version", "prompt_tokens", "cached_tokens", "routed_experts",
        "latency_s",
    ),
    ("turn_aborted", 1): ("request_id", "turn", "attempt", "rid", "partial_tokens", "message"),
    ("turn_resumed", 1): (
        "request_id", "turn", "attempt", "resumed_tokens", "remaining_new_tokens",
    ),
    ("turn_failed", 1): ("request_id", "turn", "reason"),
    ("engine_error", 1): ("request_id", "turn", "attempt", "kind", "status", "message"),
    ("client_disconnected", 1): ("request_id", "turn", "rid"),
    ("response_sent", 1): (
        "request_id", "turn", "content", "stop_reason", "usage", "status", "reasoning", "parser",
    ),
    ("request_rejected", 1): ("request_id", "status", "error_type", "message"),
    ("sandbox_event", 1): ("kind", "detail"),
    ("reward_assigned", 2): ("reward", "detail"),
    ("state_snapshot", 1): ("format", "state"),
    ("chain_decision", 2): (
        "rules_version", "request_id", "turn", "chain_id", "action", "reason",
        "parent_chain_id", "dispatch_tool_use_id",
    ),
    ("tito_verdict", 1): (
        "rules_version", "request_id", "turn", "ok", "first_divergence", "reencoded_ids",
    ),
    ("clamp_applied", 1): (
        "rules_version", "request_id", "turn", "requested", "clamped_to", "context_length",
    ),
}  # fmt: skip


def _check_layouts() -> None:
    """Fail at import when a struct's fields no longer match its stored layout."""
    for name, cls in EVENT_TYPES.items():
        fields = tuple(f.name for f in msgspec.structs.fields(cls))
        if ARRAY_LAYOUTS.get((name, cls.VERSION)) != fields:
            raise AssertionError(
                f"event {name!r} v{cls.VERSION} has fields {fields}, but ARRAY_LAYOUTS says "
                f"{ARRAY_LAYOUTS.get((name, cls.VERSION))}: stored events are arrays, so "
                "changing fields means a new VERSION, an upcaster and a layout entry"
            )


_check_layouts()


class NewEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An event about to be appended. `event_id` makes appends idempotent."""

    event: AnyEvent
    event_id: uuid.UUID = msgspec.field(default_factory=uuid7)
    ts: float = 0.0


class RecordedEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An event as read back from the log."""

    position: int
    session_id: str
    seq: int
    event_id: uuid.UUID
    ts: float
    version: int
    event: AnyEvent

    @property
    def type(self) -> str:
        return type_name(self.event)


def type_name(event: Event) -> str:
    return type(event).__struct_config__.tag  # type: ignore[return-value]


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[str, msgspec.msgpack.Decoder[Any]] = {
    name: msgspec.msgpack.Decoder(cls) for name, cls in EVENT_TYPES.items()
}

# (type name, stored version) -> function turning that version's raw dict
# into the next version's raw dict. Chains are applied until VERSION.
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
UPCASTERS: dict[tuple[str, int], Upcaster] = {}


def upcaster(type_: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    def register(fn: Upcaster) -> Upcaster:
        UPCASTERS[(type_, from_version)] = fn
        return fn

    return register


@upcaster("reward_assigned", 1)
def _reward_v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    raw = dict(raw)
    raw["reward"] = raw.pop("value")
    raw.setdefault("detail", {})
    return raw


@upcaster("messages_request", 1)
def _messages_request_v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    """v1 did not record the chat message and tool counts: unknown (None)."""
    return {**raw, "n_chat_messages": None, "n_tools": None}


@upcaster("messages_request", 2)
def _messages_request_v2_to_v3(raw: dict[str, Any]) -> dict[str, Any]:
    """v2 did not record the answers a request carries: unknown (None)."""
    return raw


@upcaster("chain_decision", 1)
def _chain_decision_v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    return raw


class UnknownEventType(ValueError):
    pass


# msgpack's fixarray header: 0x90 | n, for n <= 15 elements.
_FIXARRAY, _FIXARRAY_LAST = 0x90, 0x9F
_TAGS: dict[str, bytes] = {name: _encoder.encode(name) for name in EVENT_TYPES}
# type name -> [the header of a tagless payload's array (0x90 + k) plus the
# tag, for each k]: a read restores every event's tag, and a replay reads
# every event of the log (one concatenation per event instead of three).
_TAGGED_HEADS: dict[str, list[bytes]] = {
    name: [bytes((head + 1,)) + tag for head in range(_FIXARRAY, _FIXARRAY_LAST)]
    for name, tag in _TAGS.items()
}


def encode_event(event: Event) -> bytes:
    """Payload bytes for storage: the event's array without its type tag, which the
    row's `type` column holds (~15 bytes of every event).

    Only a fixarray (at most 15 elements with the tag) is stored without its
    tag, so a payload's first byte says which it is: a fixarray lacks its
    tag, a longer array keeps it, a map is a row from before revision 0005.
    Then `packing.pack` compresses it against a dictionary of recurring words
    when that makes it smaller.
    """
    full = _encoder.encode(event)
    head = full[0]
    if _FIXARRAY < head <= _FIXARRAY_LAST:
        full = bytes((head - 1,)) + full[1 + len(_TAGS[type_name(event)]) :]
    return packing.pack(full)


def decode_event(type_: str, version: int, payload: bytes) -> AnyEvent:
    try:
        cls = EVENT_TYPES[type_]
    except KeyError:
        raise UnknownEventType(
            f"event type {type_!r} is not known to this version of trajectory-recorder; "
            "upgrade the package to read this log"
        ) from None
    try:
        payload = packing.unpack(payload)
    except packing.UnknownDictionary as exc:
        raise UnknownEventType(str(exc)) from None
    first = payload[0] if payload else 0
    if _FIXARRAY <= first < _FIXARRAY_LAST:  # `encode_event` left its tag out
        payload = _TAGGED_HEADS[type_][first - _FIXARRAY] + payload[1:]
    if version == cls.VERSION and not _is_map(payload):
        return _decoders[type_].decode(payload)
    if version > cls.VERSION:
        raise UnknownEventType(
            f"event {type_!r} was written at schema version {version}, newer than this "
            f"code's {cls.VERSION}; upgrade the package to read this log"
        )
    raw = _as_dict(type_, version, msgspec.msgpack.decode(payload))
    for v in range(version, cls.VERSION):
        try:
            raw = UPCASTERS[(type_, v)](raw)
        except KeyError:
            raise UnknownEventType(
                f"no upcaster from {type_!r} v{v} to v{v + 1}; this is a bug in the schema module"
            ) from None
    raw["type"] = type_
    return msgspec.convert(_as_array(raw, cls), cls)


def _is_map(payload: bytes) -> bool:
    """A payload written as a msgpack map (before revision 0005) rather than an array."""
    first = payload[0] if payload else 0
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


def _as_dict(type_: str, version: int, raw: Any) -> dict[str, Any]:
    """A stored payload (an old map, or an array at `version`'s layout) as a dict by name."""
    if isinstance(raw, dict):
        return raw
    layout = ARRAY_LAYOUTS.get((type_, version))
    if layout is None or not isinstance(raw, list) or len(raw) > len(layout) + 1:
        raise UnknownEventType(
            f"event {type_!r} v{version} is stored in a layout this code does not know; "
            "this is a bug in the schema module (ARRAY_LAYOUTS lacks it)"
        )
    return dict(zip(("type", *layout), raw, strict=False))


def _as_array(raw: dict[str, Any], cls: type[Event]) -> list[Any]:
    """A dict by field name as `cls`'s array form; a field it lacks takes its default."""
    out: list[Any] = [raw["type"]]
    for f in msgspec.structs.fields(cls):
        if f.name in raw:
            out.append(raw[f.name])
        elif f.default is not msgspec.NODEFAULT:
            out.append(f.default)
        elif f.default_factory is not msgspec.NODEFAULT:
            out.append(f.default_factory())
        else:
            raise msgspec.ValidationError(f"Object missing required field `{f.name}`")
    return out
