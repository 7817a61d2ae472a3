"""parse_request never fails with anything but InvalidRequest, whatever the body."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recorder.dialects.chat import ChatRequest, InvalidRequest
from recorder.dialects.translate import parse_request

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.floats(allow_nan=False)
    | st.text(max_size=5)
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)
_block_types = st.sampled_from(
    ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "x"]
)
_block = st.fixed_dictionaries(
    {"type": _block_types},
    optional={
        "text": _scalars,
        "id": st.sampled_from(["a", "b", ""]),
        "name": _scalars,
        "input": _json,
        "tool_use_id": st.sampled_from(["a", "b", "c"]),
        "content": _scalars
        | st.lists(st.fixed_dictionaries({"type": _block_types, "text": _scalars})),
        "is_error": _scalars,
        "thinking": _scalars,
        "cache_control": _json,
    },
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "bot"])},
    optional={"content": st.text(max_size=5) | st.lists(_block, max_size=3) | _scalars},
)
_body = st.fixed_dictionaries(
    {"messages": st.lists(_message, max_size=4)},
    optional={
        "model": _scalars,
        "max_tokens": st.integers(-2, 5) | _scalars,
        "system": _scalars | st.lists(_block, max_size=2),
        "tools": st.lists(
            st.fixed_dictionaries(
                {"name": _scalars}, optional={"input_schema": _json, "type": _scalars}
            ),
            max_size=2,
        ),
        "tool_choice": _json
        | st.fixed_dictionaries({"type": st.sampled_from(["auto", "tool", "q"])}),
        "thinking": _json,
        "temperature": _scalars,
        "stream": _scalars,
        "extra": _json,
    },
)


def _parse(raw: bytes) -> ChatRequest | None:
    try:
        return parse_request(raw)
    except InvalidRequest as exc:
        assert str(exc).startswith(f"{exc.field}: ")
        return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_body)
def test_structured_garbage_is_refused_cleanly(body: dict[str, Any]) -> None:
    req = _parse(json.dumps(body).encode())
    if req is not None:
        assert len(req.message_digests) == len(req.messages)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64) | _json.map(lambda v: json.dumps(v).encode()))
def test_arbitrary_bytes_are_refused_cleanly(raw: bytes) -> None:
    _parse(raw)
