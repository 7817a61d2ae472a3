"""Packed reductions (`reduce_session(packed=True)`, `replay.packed`) give the same bytes."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from builders import Log, small_logs
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.packed import array_header, encode_array, unpacked
from replay.reclassify import content_bytes, content_digest, encode_with_content, summarize
from replay.reducer import reduce_session
from replay.rules import Rules
from replay.samples import Sample, SessionResult, Tensor, digest_bytes, encode_result
from replay.turns import IdChecks

_encoder = msgspec.msgpack.Encoder(order="deterministic")

# Each boundary of msgpack's integer formats, on both sides.
EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**32 - 1, 2**32, 2**40]
EDGES += [-1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1]
INT_DTYPES = ["<i4", "<i8", "<u4", "<u2", "<i2", "i1", "u1"]


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_integer_arrays_encode_as_msgspec_encodes_their_lists(dtype: str) -> None:
    info = np.iinfo(dtype)
    pool = np.array([x for x in EDGES if info.min <= x <= info.max], dtype=np.int64)
    rng = np.random.default_rng(7)
    for n in [0, 1, 15, 16, 17, 300, 65535, 65536, 70000]:
        values = rng.choice(pool, n).astype(dtype)
        assert encode_array(values) == _encoder.encode(values.tolist()), (dtype, n)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=40))
def test_any_int64_array_encodes_as_its_list(values: list[int]) -> None:
    a = np.array(values, dtype=np.int64)
    assert encode_array(a) == _encoder.encode(a.tolist())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=40))
def test_float_arrays_encode_as_float64_like_msgspec(values: list[float]) -> None:
    for dtype in ("<f8", "<f4"):
        a = np.array(values, dtype=dtype)
        assert encode_array(a) == _encoder.encode(a.tolist())


def test_headers_lists_and_other_values_go_through_msgspec() -> None:
    for n in [0, 15, 16, 65535, 65536]:
        assert array_header(n) == _encoder.encode([0] * n)[: len(array_header(n))]
    assert encode_array([1, 2.5, "x"]) == _encoder.encode([1, 2.5, "x"])
    flags = np.array([True, False])  # msgpack has booleans: not ints
    assert encode_array(flags) == _encoder.encode([True, False])


def _logs() -> list[Log]:
    long = Log("long").open()
    t = long.turn(list(range(100, 400)), [70000, 5, 300, 2])  # ids past uint16
    for k in range(6):
        t = long.turn(t.then([40 + k, 200 + k]), [k, 128 + k, 2])
    long.reward(1.0).close()
    return [*small_logs(), long]


@pytest.mark.parametrize("rules", [Rules(), Rules(sample_mode="collapse_to_final")])
def test_packed_results_encode_and_digest_as_the_list_results(rules: Rules) -> None:
    for log in _logs():
        lists = reduce_session(log.events, log.arrays, rules)
        packed = reduce_session(log.events, log.arrays, rules, packed=True)
        assert any(isinstance(s.tokens, np.ndarray) for s in packed.samples) or packed.placeholder
        payload, content = encode_with_content(packed)
        assert payload == encode_result(lists) == encode_with_content(lists)[0]
        assert content == content_bytes(lists) == content_bytes(packed)
        assert summarize(packed, digest_bytes(payload)) == summarize(lists, digest_bytes(payload))
        assert encode_result(unpacked(packed)) == encode_result(lists)
        assert unpacked(packed).samples == lists.samples


def test_id_checks_find_a_negative_id_in_a_view_of_a_shared_buffer() -> None:
    whole = np.array([5, 6, -1, 7], dtype=np.int32)
    whole.flags.writeable = False
    checks = IdChecks()
    assert not checks.non_negative(whole[:3])  # the root has one, and so has the view
    assert checks.non_negative(whole[:2])  # the root has one, this view none
    clean = np.arange(10, dtype=np.int32)
    assert checks.non_negative(clean[:4]) and checks.non_negative(clean[3:].view())
    assert not IdChecks().non_negative(clean.view(np.uint8).view(np.int32) - 20)


def test_id_checks_logprobs_checked_together_fail_only_the_bad_array() -> None:
    """The session's logprobs are checked in one pass; one bad array fails
    alone, an array not given at construction is scanned, odd shapes don't raise."""
    good = np.array([-0.5, 0.0], dtype=np.float32)
    bad = np.array([-0.5, np.nan], dtype=np.float32)
    odd = np.zeros((2, 2), dtype=np.float32)
    clean = IdChecks([good, good[:1], odd])
    assert clean.logprobs_ok(good, good.astype(np.float64))
    assert clean.logprobs_ok(good[:1], good[:1].astype(np.float64))
    assert not clean.logprobs_ok(bad, bad.astype(np.float64))  # not given: scanned
    mixed = IdChecks([good, bad])
    assert mixed.logprobs_ok(good, good.astype(np.float64))
    assert not mixed.logprobs_ok(bad, bad.astype(np.float64))
    for value in (0.5, np.inf, -np.inf):
        one = np.array([value], dtype=np.float64)
        assert not IdChecks([one]).logprobs_ok(one, one)


def test_content_digest_is_the_one_earlier_versions_stored() -> None:
    """Summaries are compared with those of earlier runs (`_samples_changed`),
    whose content digests were BLAKE2b's: a run that compares with them must
    write that very digest, or it reports every session as changed. The value
    below was computed by the code of 2026-11-28 (0503dab)."""
    samples = [
        Sample(
            tokens=[1, 2, 300, 70000],
            prompt_len=2,
            response_len=2,
            loss_mask=[1, 0],
            rollout_logprobs=[-0.5, 0.0],
            weight_versions=["v1", ""],
            status="completed",
            reward=0.75,
            rollout_id="r",
            session_id="s",
            metadata={"segment_kind": "final", "rules_version": "r9-x"},
            routed_experts=Tensor.from_array(np.array([[1, 2], [3, 4]])),
        ),
        Sample(
            tokens=[5, 6],
            prompt_len=1,
            response_len=1,
            loss_mask=[1],
            rollout_logprobs=[-1.25],
            weight_versions=["v2"],
            status="truncated",
            reward=0.0,
            rollout_id="r",
            session_id="s",
            metadata={"placeholder": True},
        ),
    ]
    result = SessionResult(
        session_id="s",
        rules_version="r9-x",
        status="completed",
        reward=0.75,
        segments=[],
        samples=samples,
        placeholder=False,
        turns_total=2,
        turns_used=2,
        tito_failed_turns=0,
        aborts=0,
        diagnostics=[],
    )
    assert content_digest(result) == "3d4195a183041be2f48cfa8401469b48"
    summary = summarize(result, "d", encode_with_content(result)[1], blake2b=True)
    assert summary.content_digest == "3d4195a183041be2f48cfa8401469b48"
    assert summarize(result, "d").content_digest == ""  # BLAKE2b only when asked
