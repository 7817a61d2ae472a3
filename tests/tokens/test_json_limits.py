"""JSON limits on raw bytes (recorder/dialects/json_limits.py): depth and 64-bit integers."""

from __future__ import annotations

import json

import pytest

from recorder.dialects.json_limits import _CHUNK, INT64_MAX, INT64_MIN, MAX_DEPTH, json_problem


def _body(value: object) -> bytes:
    return json.dumps({"model": "m", "metadata": {"v": value}}).encode()


@pytest.mark.parametrize(
    "value", [INT64_MAX, INT64_MIN, 10**18, -(10**18), 1.2345678901234567890123, "9" * 40]
)
def test_values_within_the_limits_pass(value: object) -> None:
    body = _body(value) if not isinstance(value, float) else b'{"v": 1.2345678901234567890123e5}'
    assert json_problem(body) is None


@pytest.mark.parametrize("value", [INT64_MAX + 1, INT64_MIN - 1, 10**30, -(10**40)])
def test_integers_beyond_64_bits_are_named(value: int) -> None:
    problem = json_problem(_body(value))
    assert problem is not None and "out of range" in problem and str(value)[:10] in problem


def test_a_digit_run_across_a_scan_chunk_is_found() -> None:
    """Bodies over a MB are scanned for digit runs in chunks that overlap."""
    for offset in (-25, -10, -1, 0, 5):
        prefix = b'{"a":"' + b"x" * (_CHUNK + offset - 6) + b'","b":'
        body = prefix + b"1" * 25 + b"}"
        assert json_problem(body) is not None, offset
        assert json_problem(prefix + b"1" * 18 + b"}") is None, offset


def test_nesting_beyond_the_depth_limit_is_named() -> None:
    deep = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    problem = json_problem(b'{"a":' + deep + b"}")
    assert problem is not None and "levels deep" in problem
    assert json_problem(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) is None
