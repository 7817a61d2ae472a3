"""Malformed HTTP requests: each gets a 4xx in Anthropic's shape, nothing half-recorded."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from recorder.log import events as ev
from recorder.server.app import free_port
from tests.server.conftest import Harness, make_harness
from tools.test_engine.scripted import Reply

OK_MESSAGE = {"role": "user", "content": "hello"}


def body(**fields: Any) -> bytes:
    base: dict[str, Any] = {"model": "m", "max_tokens": 64, "messages": [OK_MESSAGE]}
    for key, value in fields.items():
        if value is _DROP:
            base.pop(key)
        else:
            base[key] = value
    return json.dumps(base).encode().replace(json.dumps(DEEP).encode(), DEEP_JSON)


_DROP = object()
DEEP = "<3000 levels>"  # a marker `body` replaces (json.dumps itself cannot nest so deep)
DEEP_JSON = b'{"a": ' * 3000 + b"1" + b"}" * 3000
HUGE = 2**70  # beyond 64 bits
TOOL_USE = {
    "role": "assistant",
    "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}],
}
BASH = {"name": "Bash", "input_schema": {"type": "object"}}

# (case id, raw body, expected status, expected error type, substring of the message)
BODY_CASES: list[tuple[str, bytes, int, str, str]] = [
    ("bad_json", b'{"model": "m", "max_tokens": 1,', 400, "invalid_request_error", "JSON"),
    ("not_an_object", b"[1, 2, 3]", 400, "invalid_request_error", ""),
    ("empty_body", b"", 400, "invalid_request_error", ""),
    (
        "invalid_utf8",
        b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        400,
        "invalid_request_error",
        "UTF-8",
    ),
    ("missing_messages", body(messages=_DROP), 400, "invalid_request_error", "messages"),
    (
        "messages_not_list",
        body(messages={"role": "user"}),
        400,
        "invalid_request_error",
        "messages",
    ),
    ("empty_messages", body(messages=[]), 400, "invalid_request_error", "messages"),
    ("missing_max_tokens", body(max_tokens=_DROP), 400, "invalid_request_error", "max_tokens"),
    ("max_tokens_string", body(max_tokens="many"), 400, "invalid_request_error", "max_tokens"),
    ("max_tokens_negative", body(max_tokens=-5), 400, "invalid_request_error", "max_tokens"),
    ("max_tokens_zero", body(max_tokens=0), 400, "invalid_request_error", "max_tokens"),
    (
        "bad_role",
        body(messages=[{"role": "tool", "content": "x"}]),
        400,
        "invalid_request_error",
        "messages.0.role",
    ),
    ("missing_content", body(messages=[{"role": "user"}]), 400, "invalid_request_error", "content"),
    (
        "content_int",
        body(messages=[{"role": "user", "content": 7}]),
        400,
        "invalid_request_error",
        "messages.0.content",
    ),
    (
        "image_block_without_source_type",  # a valid image block is served (test_claude_traffic)
        body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
        400,
        "invalid_request_error",
        "messages.0.content.0.source.type",
    ),
    (
        "document_block",
        body(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
        400,
        "invalid_request_error",
        "document",
    ),
    (
        "block_without_type",
        body(messages=[{"role": "user", "content": [{"text": "x"}]}]),
        400,
        "invalid_request_error",
        "messages.0.content.0",
    ),
    (
        "text_not_string",
        body(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        400,
        "invalid_request_error",
        "messages.0.content.0.text",
    ),
    (
        "empty_content_list",
        body(messages=[{"role": "user", "content": []}]),
        400,
        "invalid_request_error",
        "messages.0.content",
    ),
    (
        "tool_use_without_id",
        body(
            messages=[
                OK_MESSAGE,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "name": "Bash", "input": {}}],
                },
                OK_MESSAGE,
            ]
        ),
        400,
        "invalid_request_error",
        "id",
    ),
    (
        "tool_input_not_object",
        body(
            messages=[
                OK_MESSAGE,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "Bash", "input": "ls"}],
                },
                OK_MESSAGE,
            ]
        ),
        400,
        "invalid_request_error",
        "input",
    ),
    (
        "unknown_tool_result_id",
        body(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}],
                }
            ]
        ),
        400,
        "invalid_request_error",
        "nope",
    ),
    (
        "tool_result_in_assistant",
        body(
            messages=[
                OK_MESSAGE,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}],
                },
                OK_MESSAGE,
            ]
        ),
        400,
        "invalid_request_error",
        "tool_result",
    ),
    (
        "assistant_last",
        body(messages=[OK_MESSAGE, TOOL_USE]),
        400,
        "invalid_request_error",
        "last message",
    ),
    ("system_int", body(system=42), 400, "invalid_request_error", "system"),
    (
        "system_image_block",
        body(system=[{"type": "image", "source": {}}]),
        400,
        "invalid_request_error",
        "system",
    ),
    ("tools_not_list", body(tools={"name": "Bash"}), 400, "invalid_request_error", "tools"),
    (
        "tool_missing_name",
        body(tools=[{"input_schema": {"type": "object"}}]),
        400,
        "invalid_request_error",
        "name",
    ),
    (
        "tool_missing_schema",
        body(tools=[{"name": "Bash"}]),
        400,
        "invalid_request_error",
        "input_schema",
    ),
    ("duplicate_tool_names", body(tools=[BASH, BASH]), 400, "invalid_request_error", "duplicate"),
    (
        "tool_choice_unknown",
        body(tools=[BASH], tool_choice={"type": "sometimes"}),
        400,
        "invalid_request_error",
        "tool_choice",
    ),
    ("temperature_too_high", body(temperature=3.5), 400, "invalid_request_error", "temperature"),
    ("top_p_string", body(top_p="high"), 400, "invalid_request_error", "top_p"),
    (
        "stop_sequences_not_list",
        body(stop_sequences="STOP"),
        400,
        "invalid_request_error",
        "stop_sequences",
    ),
    (
        "thinking_unknown_type",
        body(thinking={"type": "maybe"}),
        400,
        "invalid_request_error",
        "thinking",
    ),
    ("stream_not_bool", body(stream="yes"), 400, "invalid_request_error", "stream"),
    (
        "deep_tool_use_input",
        body(
            messages=[
                OK_MESSAGE,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "Bash", "input": DEEP}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}],
                },
            ]
        ),
        400,
        "invalid_request_error",
        "nested 300",
    ),
    (
        "deep_input_schema",
        body(tools=[{"name": "Bash", "input_schema": DEEP}]),
        400,
        "invalid_request_error",
        "nested",
    ),
    ("deep_metadata", body(metadata=DEEP), 400, "invalid_request_error", "nested"),
    ("deep_array", b"[" * 100_000 + b"]" * 100_000, 400, "invalid_request_error", "nested"),
    ("max_tokens_beyond_64_bits", body(max_tokens=HUGE), 400, "invalid_request_error", "64 bits"),
    ("top_k_beyond_64_bits", body(top_k=HUGE), 400, "invalid_request_error", "64 bits"),
    ("negative_beyond_64_bits", body(top_k=-HUGE), 400, "invalid_request_error", "64 bits"),
    (
        "metadata_int_beyond_64_bits",
        body(metadata={"user_id": HUGE}),
        400,
        "invalid_request_error",
        "64 bits",
    ),
    (
        "tool_choice_names_unknown_tool",
        body(tools=[BASH], tool_choice={"type": "tool", "name": "Edit"}),
        400,
        "invalid_request_error",
        "tool_choice.name",
    ),
    (
        "tool_choice_any_without_tools",
        body(tool_choice={"type": "any"}),
        400,
        "invalid_request_error",
        "tool_choice",
    ),
    (
        "tool_choice_tool_without_tools",
        body(tool_choice={"type": "tool", "name": "Bash"}),
        400,
        "invalid_request_error",
        "tool_choice",
    ),
    (
        "prompt_too_long",
        body(messages=[{"role": "user", "content": "word " * 9000}]),
        400,
        "invalid_request_error",
        "prompt is too long",
    ),
]


@pytest.fixture
async def small_harness(tokenizer: Any, sqlite_url: str) -> AsyncIterator[Harness]:
    h = await make_harness(tokenizer, sqlite_url, max_body_bytes=256 * 1024)
    try:
        yield h
    finally:
        await h.close()


def assert_error_shape(data: Any, error_type: str, needle: str) -> None:
    assert data["type"] == "error", data
    assert data["error"]["type"] == error_type, data
    assert isinstance(data["error"]["message"], str) and data["error"]["message"]
    assert needle.lower() in data["error"]["message"].lower(), data


async def post(
    h: Harness, raw: bytes, headers: dict[str, str], path: str = "/v1/messages"
) -> tuple[int, Any]:
    assert h.http is not None
    async with h.http.post(
        h.url + path, data=raw, headers={"Content-Type": "application/json", **headers}
    ) as resp:
        return resp.status, json.loads(await resp.read())


@dataclass(frozen=True)
class Dialect:
    """One agent-facing API: where its requests go, its bad bodies, its error shape.

    A new dialect adds one entry to DIALECTS: its path, its rows (same
    columns as BODY_CASES), a well-formed body with the answer text it
    expects, and the check of its error shape.
    """

    name: str
    path: str
    cases: list[tuple[str, bytes, int, str, str]]
    good_body: Callable[[], bytes]
    answer_text: Callable[[Any], str]
    check_error: Callable[[Any, str, str], None]


def openai_body(**fields: Any) -> bytes:
    """A Chat Completions body (or, with `input`, a Responses body) with `fields` set."""
    base: dict[str, Any] = {"model": "m", "max_tokens": 64, "messages": [OK_MESSAGE]}
    base.update(fields)
    return json.dumps(base).encode().replace(json.dumps(DEEP).encode(), DEEP_JSON)


def responses_body(**fields: Any) -> bytes:
    base: dict[str, Any] = {"model": "m", "max_output_tokens": 64, "input": "hi"}
    base.update(fields)
    return json.dumps(base).encode().replace(json.dumps(DEEP).encode(), DEEP_JSON)


def assert_openai_error_shape(data: Any, error_type: str, needle: str) -> None:
    assert data["error"]["type"] == error_type, data
    assert needle.lower() in data["error"]["message"].lower(), data


_FN = {"type": "function", "function": {"name": "Bash", "parameters": DEEP}}
OPENAI_CHAT_CASES = [
    ("deep tool parameters", openai_body(tools=[_FN]), 400, "invalid_request_error", "levels"),
    ("deep metadata", openai_body(metadata={"a": DEEP}), 400, "invalid_request_error", "levels"),
    ("huge max_tokens", openai_body(max_tokens=HUGE), 400, "invalid_request_error", "64 bits"),
    ("huge seed", openai_body(seed=HUGE), 400, "invalid_request_error", "64 bits"),
]
_RESP_FN = {"type": "function", "name": "Bash", "parameters": DEEP}
OPENAI_RESPONSES_CASES = [
    ("deep tool parameters", responses_body(tools=[_RESP_FN]), 400, "invalid_request_error", "levels"),
    ("deep input", responses_body(input=[{"role": "user", "content": DEEP}]), 400,
     "invalid_request_error", "levels"),
    ("huge max_output_tokens", responses_body(max_output_tokens=HUGE), 400,
     "invalid_request_error", "64 bits"),
]  # fmt: skip


DIALECTS = [
    Dialect(
        name="anthropic",
        path="/v1/messages",
        cases=BODY_CASES,
        good_body=body,
        answer_text=lambda data: str(data["content"][0]["text"]),
        check_error=lambda data, error_type, needle: assert_error_shape(data, error_type, needle),
    ),
    Dialect(
        name="openai-chat",
        path="/v1/chat/completions",
        cases=OPENAI_CHAT_CASES,
        good_body=openai_body,
        answer_text=lambda data: str(data["choices"][0]["message"]["content"]),
        check_error=assert_openai_error_shape,
    ),
    Dialect(
        name="openai-responses",
        path="/v1/responses",
        cases=OPENAI_RESPONSES_CASES,
        good_body=responses_body,
        answer_text=lambda data: str(data["output"][-1]["content"][0]["text"]),
        check_error=assert_openai_error_shape,
    ),
]


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
async def test_malformed_bodies(small_harness: Harness, dialect: Dialect) -> None:
    h = small_harness
    sid = await h.open_session()
    auth = {"Authorization": f"Bearer {sid}"}
    failures = []
    for case, raw, status, error_type, needle in dialect.cases:
        got_status, data = await post(h, raw, auth, path=dialect.path)
        try:
            assert got_status == status, (got_status, data)
            dialect.check_error(data, error_type, needle)
        except AssertionError as exc:
            failures.append(f"{case}: {exc}")
    assert not failures, "\n".join(failures)
    # Every refusal is recorded as exactly one RequestRejected, nothing else.
    recorded = await h.payloads(sid)
    assert [type(e).__name__ for e in recorded] == ["SessionOpened"] + ["RequestRejected"] * len(
        dialect.cases
    )
    rejected = [e for e in recorded if isinstance(e, ev.RequestRejected)]
    assert all(e.status == 400 and e.error_type == "invalid_request_error" for e in rejected)
    assert not h.engine.requests  # the engine never saw any of them
    # The server keeps serving the same session.
    h.engine.push("still fine")
    status, data = await post(h, dialect.good_body(), auth, path=dialect.path)
    assert status == 200 and dialect.answer_text(data) == "still fine"


async def test_malformed_streaming_request_is_a_plain_400(small_harness: Harness) -> None:
    h = small_harness
    sid = await h.open_session()
    status, data = await post(h, body(stream=True, max_tokens=-1), {"x-api-key": sid})
    assert status == 400
    assert_error_shape(data, "invalid_request_error", "max_tokens")


async def test_http_level_errors(small_harness: Harness) -> None:
    h = small_harness
    sid = await h.open_session()
    auth = {"Authorization": f"Bearer {sid}"}
    assert h.http is not None
    cases: list[tuple[str, int, str, str]] = []

    status, data = await post(h, body(messages=[{"role": "user", "content": "x" * 300_000}]), auth)
    cases.append(("oversized_body", status, data, "request_too_large"))
    status, data = await post(h, body(), {})
    cases.append(("missing_auth", status, data, "authentication_error"))
    status, data = await post(h, body(), {"Authorization": "Bearer sess_does_not_exist"})
    cases.append(("unknown_session", status, data, "authentication_error"))
    status, data = await post(h, body(), {"Authorization": "Basic dXNlcjpwYXNz"})
    cases.append(("wrong_auth_scheme", status, data, "authentication_error"))
    status, data = await post(h, body(), {"x-api-key": "../../etc/passwd"})
    cases.append(("garbage_session_id", status, data, "authentication_error"))
    status, data = await post(h, body(), auth, path="/v1/nothing")
    cases.append(("unknown_path", status, data, "not_found_error"))
    async with h.http.get(h.url + "/v1/messages", headers=auth) as resp:
        cases.append(("wrong_method", resp.status, await resp.json(), "invalid_request_error"))
    status, data = await post(h, b"{", auth, path="/v1/messages/count_tokens")
    cases.append(("count_tokens_bad_json", status, data, "invalid_request_error"))

    expected_status = {
        "oversized_body": 413,
        "missing_auth": 401,
        "unknown_session": 401,
        "wrong_auth_scheme": 401,
        "garbage_session_id": 401,
        "unknown_path": 404,
        "wrong_method": 405,
        "count_tokens_bad_json": 400,
    }
    for case, got, data, error_type in cases:
        assert got == expected_status[case], (case, got, data)
        assert_error_shape(data, error_type, "")
    # None of these reached the session's log.
    assert [type(e).__name__ for e in await h.payloads(sid)] == ["SessionOpened"]
    h.engine.push(Reply(text="alive"))
    status, data = await post(h, body(), auth)
    assert status == 200 and data["content"][0]["text"] == "alive"


async def raw_exchange(h: Harness, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes (what aiohttp's client refuses to send); (status, headers, body)."""
    host, port = h.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines if ln)}
        length = int(headers.get("content-length", "0"))
        return int(status_line.split()[1]), headers, await reader.readexactly(length)
    finally:
        writer.close()


def raw_post(path: str, headers: dict[str, str], payload: bytes = b"", **extra: bytes) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", *(f"{k}: {v}" for k, v in headers.items())]
    head = "\r\n".join(lines).encode() + b"".join(
        b"\r\n" + k.encode() + b": " + v for k, v in extra.items()
    )
    return head + b"\r\n\r\n" + payload


async def test_transport_and_admin_mistakes(small_harness: Harness) -> None:
    """Mistakes outside the Messages body: each a 4xx in the Anthropic shape."""
    h = small_harness
    sid = await h.open_session()
    auth = {"Authorization": f"Bearer {sid}"}
    assert h.http is not None
    cases: list[tuple[str, int, Any, int, str, str]] = []

    # Raw: aiohttp's client gives up on a connection the server closes after answering.
    not_gzip = b"this is not gzip"
    headers = {**auth, "Content-Encoding": "gzip", "Content-Length": str(len(not_gzip))}
    status, _, raw = await raw_exchange(h, raw_post("/v1/messages", headers, not_gzip))
    cases.append(("bad_gzip", status, json.loads(raw), 400, "invalid_request_error", "gzip"))

    deep = b'{"metadata": ' + DEEP_JSON + b"}"
    status, data = await post(h, deep, h.admin_headers(), path="/sessions")
    cases.append(("deep_session_metadata", status, data, 400, "invalid_request_error", "nested"))
    huge = b'{"metadata": {"seed": ' + str(HUGE).encode() + b"}}"
    status, data = await post(h, huge, h.admin_headers(), path="/sessions")
    cases.append(("huge_int_session_metadata", status, data, 400, "invalid_request_error", "64"))
    events = b'{"events": [{"kind": "x", "detail": ' + DEEP_JSON + b"}]}"
    status, data = await post(h, events, h.admin_headers(), path=f"/sessions/{sid}/events")
    cases.append(("deep_rollout_event", status, data, 400, "invalid_request_error", "nested"))

    over = h.config.max_body_bytes + 1
    status, _, raw = await raw_exchange(
        h,
        raw_post(
            "/v1/messages",
            {
                **auth,
                "Content-Type": "application/json",
                "Content-Length": str(over),
                "Expect": "100-continue",
            },
        ),
    )
    cases.append(("expect_oversize", status, json.loads(raw), 413, "request_too_large", "large"))

    for case, got, data, want, error_type, needle in cases:
        assert got == want, (case, got, data)
        assert_error_shape(data, error_type, needle)


# Requests aiohttp's parser refuses before any recorder code runs (recorder/server/protocol.py):
# (case id, raw request, status, substring of the message)
PRE_APP: list[tuple[str, bytes, int, str]] = [
    (
        "header_over_8190_bytes",
        raw_post("/v1/messages", {"Content-Length": "2", "X-Padding": "p" * 9000}, b"{}"),
        431,
        "8190 bytes",
    ),
    ("url_over_8190_bytes", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431, "8190"),
    ("garbage_request_line", b"HELLO WORLD\r\n\r\n", 400, "invalid method"),
    ("bad_http_version", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", 400, "http version"),
    ("bad_header_line", raw_post("/v1/messages", {"Bad Header": "x"}), 400, "header"),
    (
        "too_many_headers",
        raw_post("/v1/messages", {f"X-H{i}": "v" for i in range(200)}),
        400,
        "too many headers",
    ),
    (
        "bad_chunk_size",
        raw_post("/v1/messages", {"Transfer-Encoding": "chunked"}, b"zz\r\n"),
        400,
        "chunk size",
    ),
]


async def test_requests_aiohttp_refuses_get_the_anthropic_shape(small_harness: Harness) -> None:
    """Refused by aiohttp's parser: JSON in the Anthropic shape, `x-should-retry: false`, the
    connection closed, nothing recorded, and the server keeps serving."""
    h = small_harness
    sid = await h.open_session()
    auth = {"Authorization": f"Bearer {sid}"}
    for case, request, want, needle in PRE_APP:
        status, headers, raw = await raw_exchange(h, request)
        assert status == want, (case, status, raw)
        assert headers["content-type"].startswith("application/json"), (case, headers)
        assert headers.get("x-should-retry") == "false", case
        assert_error_shape(json.loads(raw), "invalid_request_error", needle)
        assert b"pppp" not in raw and b"aaaa" not in raw, case  # the request is not echoed

    # What cannot be answered: a body shorter than its Content-Length, then the client's
    # EOF. The transport closes before any handler runs; nobody would read an answer.
    host, port = h.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(raw_post("/v1/messages", {**auth, "Content-Length": "100"}, b'{"model":'))
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 60) == b""  # closed without an answer
    writer.close()

    assert [type(e).__name__ for e in await h.payloads(sid)] == ["SessionOpened"]
    h.engine.push(Reply(text="alive"))
    status, data = await post(h, body(), auth)
    assert status == 200 and data["content"][0]["text"] == "alive"


async def test_a_body_that_stops_arriving_is_refused(tokenizer: Any, sqlite_url: str) -> None:
    """Shorter than its Content-Length, the connection left open: a 400 in the Anthropic
    shape after the idle timeout (not a handler held until the client leaves); a slow
    body that keeps coming is read whole."""
    h = await make_harness(tokenizer, sqlite_url, idle_timeout_s=1.0)
    try:
        sid = await h.open_session()
        auth = {"Authorization": f"Bearer {sid}", "Content-Type": "application/json"}
        payload = body()
        stalled = raw_post("/v1/messages", {**auth, "Content-Length": str(len(payload) + 50)})
        status, headers, raw = await asyncio.wait_for(raw_exchange(h, stalled + payload), 60)
        assert status == 400 and headers.get("x-should-retry") == "false", raw
        assert_error_shape(json.loads(raw), "invalid_request_error", "stopped arriving")
        assert f"{len(payload)} bytes of the {len(payload) + 50}" in raw.decode()

        # Pieces 0.25 s apart for longer than the idle timeout: progress keeps it going.
        host, port = h.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(raw_post("/v1/messages", {**auth, "Content-Length": str(len(payload))}))
        h.engine.push(Reply(text="slow but whole"))
        step = len(payload) // 8 + 1
        for start in range(0, len(payload), step):
            writer.write(payload[start : start + step])
            await writer.drain()
            await asyncio.sleep(0.25)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        writer.close()
        assert head.startswith(b"HTTP/1.1 200"), head
        kinds = [type(e).__name__ for e in await h.payloads(sid)]
        assert kinds[-2:] == ["ResponseSent", "StateSnapshot"], kinds
    finally:
        await h.close()


async def test_admin_token_that_is_not_utf8(tokenizer: Any, sqlite_url: str) -> None:
    h = await make_harness(tokenizer, sqlite_url, admin_token="s3cret")
    try:
        request = raw_post(
            "/sessions",
            {"Content-Type": "application/json", "Content-Length": "2"},
            b"{}",
            Authorization=b"Bearer s3cr\xffet",
        )
        status, _, raw = await raw_exchange(h, request)
        assert status == 401, raw
        assert_error_shape(json.loads(raw), "authentication_error", "admin")
        assert (await h.admin("POST", "/sessions", {}))[0] == 201  # still serving
    finally:
        await h.close()


async def test_errors_a_retry_cannot_fix_say_so(small_harness: Harness) -> None:
    """`x-should-retry: false` stops Claude Code's silent retries of a 400/401/404/409."""
    h = small_harness
    assert h.http is not None
    sid = await h.open_session()
    assert (await h.admin("POST", f"/sessions/{sid}/close", {"status": "completed"}))[0] == 200
    json_admin = {**h.admin_headers(), "Content-Type": "application/json"}
    cases = [
        ("unknown_session", {"Authorization": "Bearer sess_nope"}, body(), "/v1/messages", 401),
        ("closed_session", {"Authorization": f"Bearer {sid}"}, body(), "/v1/messages", 409),
        ("bad_body", {"Authorization": f"Bearer {sid}"}, b"{", "/v1/messages", 409),
        ("unknown_path", {}, body(), "/v1/nothing", 404),
        ("bad_admin_body", json_admin, b"[", "/sessions", 400),
        ("admin_body_not_json", h.admin_headers(), b"{}", "/sessions", 415),
    ]
    for case, headers, raw, path, status in cases:
        async with h.http.post(h.url + path, data=raw, headers=headers) as resp:
            assert resp.status == status, (case, resp.status, await resp.text())
            assert resp.headers.get("x-should-retry") == "false", case


async def test_engine_errors_keep_the_engine_url_in_the_log(
    tokenizer: Any, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    h = await make_harness(tokenizer, sqlite_url, engine_urls=[dead], max_attempts=1)
    try:
        sid = await h.open_session()
        status, data = await post(h, body(), {"Authorization": f"Bearer {sid}"})
        assert status == 529, data
        assert_error_shape(data, "overloaded_error", "cannot be reached")
        assert dead.removeprefix("http://") not in data["error"]["message"], data
        assert dead in caplog.text  # the operator still sees which engine
    finally:
        await h.close()


async def test_stalled_connections_are_closed(tokenizer: Any, sqlite_url: str) -> None:
    """Half a header, then silence: the server closes it while still serving others."""
    h = await make_harness(tokenizer, sqlite_url, idle_timeout_s=0.5)
    try:
        sid = await h.open_session()
        host, port = h.url.removeprefix("http://").split(":")
        stalled = []
        for _ in range(20):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nX-Half: ")
            stalled.append((reader, writer))
        # The others are served meanwhile.
        status, data = await post(h, body(), {"Authorization": f"Bearer {sid}"})
        assert status == 200, data
        for reader, writer in stalled:
            # EOF, not an answer: the server hung up. (wait_for only guards a hang.)
            assert await asyncio.wait_for(reader.read(), 60) == b""
            writer.close()
    finally:
        await h.close()


def test_what_aiohttp_fails_itself_is_an_api_error() -> None:
    """A 500/504 aiohttp raises around a handler (not a parser refusal): `api_error`."""
    from recorder.server.protocol import parser_error

    for status in (500, 504):
        err = parser_error(status, RuntimeError("x"))
        assert (err.status, err.error_type) == (status, "api_error")
