"""The compact stored format of revision 0005: events as msgpack arrays without
field names or type tag (packed against a fixed dictionary when long), float64
pieces as exact float32s, large int32 pieces unshuffled when that is smaller;
rows written before read back unchanged."""

from __future__ import annotations

import uuid

import msgspec
import numpy as np
import pytest

from recorder.log import events as ev
from recorder.log import packing
from recorder.log.events import ArrayRef
from recorder.log.store import EventStore, open_store
from recorder.log.store import arrays as codec
from tests.store.conftest import RawExecute, assert_downgrade_refused

REF = ArrayRef(b"\x07" * 16, 5)


def samples() -> list[ev.Event]:
    """One event of every type, with fields away from their defaults where it matters."""
    tok = ev.TokenizerIdentity(
        name_or_path="m", vocab_size=9, vocab_digest="v", chat_template_digest="c"
    )
    out: list[ev.Event] = [
        ev.SessionOpened(session_id="s", metadata={"k": 1}, tokenizer=tok, context_length=99),
        ev.SessionClosed(status="failed", reason="r"),
        ev.SessionFailed(where="w", error_type="E", message="m"),
        ev.MessagesRequest(request_id="q", turn=1, body=REF, answer_keys=("a",), n_tools=3),
        ev.RenderedInput(request_id="q", turn=1, chain_id=2, input_ids=REF, prefix_len=3),
        ev.GenerateAttempt(request_id="q", turn=1, attempt=0, rid="r", sampling_params={"t": 1}),
        ev.GenerateResult(
            request_id="q", turn=1, attempt=0, rid="r", output_ids=REF, logprobs=None,
            finish_reason="stop", latency_s=0.5,
        ),
        ev.TurnAborted(request_id="q", turn=1, attempt=0, rid="r", partial_tokens=4),
        ev.TurnResumed(request_id="q", turn=1, attempt=1, resumed_tokens=4, remaining_new_tokens=2),
        ev.TurnFailed(request_id="q", turn=1, reason="x"),
        ev.EngineError(request_id="q", turn=1, kind="timeout"),
        ev.ClientDisconnected(request_id="q", turn=1),
        ev.ResponseSent(request_id="q", turn=1, content=[{"type": "text"}], stop_reason="end"),
        ev.RequestRejected(request_id="q", status=400, error_type="e", message="m"),
        ev.SandboxEvent(kind="k", detail={"d": [1, 2]}),
        ev.RewardAssigned(reward=0.5),
        ev.StateSnapshot(format=1, state=b"\x00\x01"),
        ev.ChainDecision(
            rules_version="v", request_id="q", turn=1, chain_id=0, action="new", reason="side"
        ),
        ev.TitoVerdict(rules_version="v", request_id="q", turn=1, ok=False, first_divergence=2),
        ev.ClampApplied(
            rules_version="v", request_id="q", turn=1, requested=9, clamped_to=3, context_length=9
        ),
    ]  # fmt: skip
    assert {ev.type_name(e) for e in out} == set(ev.EVENT_TYPES)
    return out


def as_map(event: ev.Event) -> bytes:
    """The payload code before revision 0005 wrote: a map by field name with its tag."""
    raw = msgspec.structs.asdict(event)
    defaults = {f.name: f.default for f in msgspec.structs.fields(event)}
    kept = {k: v for k, v in raw.items() if defaults.get(k, msgspec.NODEFAULT) != v}
    return msgspec.msgpack.encode({"type": ev.type_name(event), **kept})


@pytest.mark.parametrize("event", samples(), ids=ev.type_name)
def test_every_event_is_stored_as_an_array_without_names_and_reads_back(event: ev.Event) -> None:
    payload = ev.encode_event(event)
    name = ev.type_name(event)
    assert ev.decode_event(name, type(event).VERSION, payload) == event
    assert name.encode() not in payload  # the type column holds it
    assert b"request_id" not in payload and b"rules_version" not in payload
    assert len(payload) < len(as_map(event))


@pytest.mark.parametrize("event", samples(), ids=ev.type_name)
def test_a_map_payload_written_before_reads_as_the_same_event(event: ev.Event) -> None:
    assert ev.decode_event(ev.type_name(event), type(event).VERSION, as_map(event)) == event


def test_an_array_payload_in_a_layout_this_code_lacks_is_refused() -> None:
    """An array at an old version needs that version's field names to be upcast."""
    payload = msgspec.msgpack.encode([0.5, {}])  # fixarray: read as tagless
    with pytest.raises(ev.UnknownEventType, match="ARRAY_LAYOUTS"):
        ev.decode_event("reward_assigned", 1, payload)


def test_an_event_with_more_than_fifteen_elements_keeps_its_tag() -> None:
    """A payload longer than a fixarray keeps its tag, so the first byte tells them apart."""
    payload = msgspec.msgpack.encode(["reward_assigned", 0.25, {}, *range(14)])
    assert payload[0] == 0xDC
    # Read with its own tag (trailing elements a newer writer appended are ignored).
    assert ev.decode_event("reward_assigned", 2, payload) == ev.RewardAssigned(reward=0.25)
    short = msgspec.msgpack.encode(["reward_assigned", 0.25, {}])
    tagless = ev.encode_event(ev.RewardAssigned(reward=0.25))
    assert ev.decode_event("reward_assigned", 2, tagless) == ev.RewardAssigned(reward=0.25)
    assert len(tagless) == len(short) - len(msgspec.msgpack.encode("reward_assigned"))


async def test_old_map_rows_and_new_array_rows_read_side_by_side(
    store: EventStore, store_url: str, raw_execute: RawExecute
) -> None:
    old = ev.SandboxEvent(kind="before", detail={"n": 1})
    event_id = uuid.uuid4()
    await raw_execute(
        store_url,
        "INSERT INTO events (session_id, seq, event_id, type, version, ts, payload) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7)",
        "s",
        0,
        event_id.bytes if store_url.startswith("sqlite") else event_id,
        "sandbox_event",
        1,
        1.0,
        as_map(old),
    )
    new = ev.SandboxEvent(kind="after", detail={"n": 2})
    await store.append("s", [ev.NewEvent(event=new)], expected_seq=1)
    assert [r.event for r in await store.read_session("s")] == [old, new]


def exact_float32_logprobs(n: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    return (-rng.exponential(2.0, n)).astype(np.float32).astype(np.float64)


def test_float64_values_that_are_float32s_store_as_float32s_bit_exact() -> None:
    values = np.concatenate(
        [exact_float32_logprobs(500), [-0.0, 0.0, -np.inf, float(np.float32(1e-45))]]
    )
    piece = codec.encode_piece(values, "float64", None)
    assert piece.codec == codec.CODEC_F32_SHUFFLED
    plain = codec._compressor().compress(codec._shuffle(values.tobytes(), 8))
    assert len(piece.data) < len(plain)
    back = codec.decode_piece(piece).suffix
    assert back.tobytes() == values.tobytes()


@pytest.mark.parametrize(
    "odd", [1e300, 0.1, 5e-324, float("nan")], ids=["huge", "decimal", "subnormal", "nan"]
)
def test_float64_values_beyond_float32_keep_every_bit(odd: float) -> None:
    values = np.concatenate([exact_float32_logprobs(50), [odd]])
    if np.isnan(odd):  # a NaN payload float32 cannot hold
        values.view(np.uint64)[-1] = 0x7FF8_0000_0000_0001
    with np.errstate(all="raise"):
        piece = codec.encode_piece(values, "float64", None)
    assert piece.codec in (codec.CODEC_ZSTD, codec.CODEC_ZSTD_SHUFFLED)
    assert codec.decode_piece(piece).suffix.tobytes() == values.tobytes()


def test_a_float32_coded_piece_that_lies_is_caught() -> None:
    values = exact_float32_logprobs(64)
    piece = codec.encode_piece(values, "float64", None)
    other = values.copy()
    other[3] = np.float32(-9.5)
    forged = codec.encode_piece(other, "float64", None)
    bad = msgspec.structs.replace(piece, data=forged.data)
    with pytest.raises(codec.CorruptArray):
        codec.decode_piece(bad)


def test_large_token_pieces_with_repeated_runs_store_unshuffled() -> None:
    """Text repeats runs of tokens: plain zstd finds them, a byte shuffle cuts them apart."""
    rng = np.random.default_rng(2)
    lines = [rng.integers(0, 49_152, 12, dtype=np.int32) for _ in range(40)]
    tokens = np.concatenate([lines[i] for i in rng.integers(0, 40, 400)])
    piece = codec.encode_piece(tokens, "int32", None)
    assert piece.codec == codec.CODEC_ZSTD
    shuffled = codec._compressor().compress(codec._shuffle(tokens.tobytes(), 4))
    assert len(piece.data) < len(shuffled)
    assert np.array_equal(codec.decode_piece(piece).suffix, tokens)
    small = codec.encode_piece(tokens[: codec.RAW_INT32_MIN_BYTES // 8], "int32", None)
    assert small.codec == codec.CODEC_ZSTD_SHUFFLED


async def test_downgrading_below_0005_refuses_once_compact_rows_exist(store_url: str) -> None:
    """Code at 0004 reads neither array payloads nor float32 pieces: the downgrade stops."""
    store = await open_store(store_url, create=True)
    try:
        await store.append("s", [ev.NewEvent(event=ev.SandboxEvent(kind="k"))], expected_seq=0)
    finally:
        await store.close()
    await assert_downgrade_refused(store_url, "0004", "stay at revision 0005")


def test_long_payloads_are_packed_against_the_dictionary_and_read_back() -> None:
    """The protocol's recurring words (sampling keys, usage keys) cost little once packed."""
    params = {
        "max_new_tokens": 512,
        "temperature": 0.7,
        "top_p": 0.95,
        "top_k": 20,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
        "stop_token_ids": [2, 7],
    }
    attempt = ev.GenerateAttempt(
        request_id="msg_0123456789abcdef01234567",
        turn=4,
        attempt=0,
        rid="ab" * 16,
        engine_url="http://127.0.0.1:30000",
        max_new_tokens=512,
        sampling_params=params,
    )
    unpacked = msgspec.msgpack.encode(attempt)
    assert len(unpacked) >= packing.MIN_PACK_BYTES
    payload = ev.encode_event(attempt)
    assert payload[0] == packing.PACKED and payload[1] == packing.VERSION
    assert len(payload) < 0.6 * len(unpacked)
    assert packing.unpack(payload)[0] == unpacked[0] - 1  # the tagless array inside
    assert ev.decode_event("generate_attempt", 1, payload) == attempt


def test_short_or_incompressible_payloads_stay_plain() -> None:
    short = ev.TitoVerdict(rules_version="v", request_id="q", turn=1, ok=True)
    assert ev.encode_event(short)[0] != packing.PACKED
    noise = bytes(np.random.default_rng(3).integers(0, 256, 400, dtype=np.uint8))
    assert packing.pack(noise) == noise
    assert packing.unpack(noise) == noise


def test_a_payload_packed_with_an_unknown_dictionary_asks_for_an_upgrade() -> None:
    packed = packing.pack(msgspec.msgpack.encode(["x" * 200]))
    newer = bytes((packing.PACKED, packing.VERSION + 1)) + packed[2:]
    with pytest.raises(ev.UnknownEventType, match="upgrade trajectory-recorder"):
        ev.decode_event("sandbox_event", 1, newer)
    damaged = packed[:2] + b"\xff" * (len(packed) - 2)
    with pytest.raises(msgspec.DecodeError):
        ev.decode_event("sandbox_event", 1, damaged)


def test_the_dictionary_of_every_version_is_frozen() -> None:
    """Stored payloads depend on a version's exact bytes: the import checks each digest."""
    for version, data in packing.DICTIONARIES.items():
        assert packing._checked(version, data) == data
    with pytest.raises(AssertionError, match="add a new version"):
        packing._checked(1, packing.DICTIONARIES[1] + b"x")
