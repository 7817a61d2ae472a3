"""The OpenAI routes through the official `openai` SDK: every error in OpenAI's shape, no 500
on a tool call's arguments, and `response_format` / `text.format` enforced or refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from recorder.log import events as ev
from tests.server.conftest import Harness, make_harness

OPENAI_PATHS = ("/v1/chat/completions", "/v1/responses")
DEEP = "[" * 1200 + "]" * 1200


def openai_client(h: Harness, sid: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=h.url + "/v1", api_key=sid, max_retries=0)


def assert_openai_shape(data: Any) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}` and nothing of Anthropic's shape."""
    assert isinstance(data, dict) and set(data) == {"error"}, data
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}, data
    assert isinstance(error["message"], str) and error["message"], data
    return error


def chat_with_arguments(args: str) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "Bash", "arguments": args}}
    return {
        "model": "m",
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ],
    }


def responses_with_arguments(args: str) -> dict[str, Any]:
    return {
        "model": "m",
        "input": [
            {"role": "user", "content": "go"},
            {"type": "function_call", "call_id": "c1", "name": "Bash", "arguments": args},
            {"type": "function_call_output", "call_id": "c1", "output": "done"},
        ],
    }


BAD_ARGUMENTS = [
    pytest.param('{"a": ' + DEEP + "}", id="deep"),
    pytest.param('{"command": "\\ud800"}', id="lone-surrogate"),
]


@pytest.mark.parametrize("args", BAD_ARGUMENTS)
@pytest.mark.parametrize("route", ["chat", "responses"])
async def test_bad_tool_call_arguments_are_400_naming_the_field(
    harness: Harness, route: str, args: str
) -> None:
    """JSON nested 1,200 deep was a 500 RecursionError, a lone surrogate a 500 UnicodeEncodeError."""
    h = harness
    sid = await h.open_session()
    client = openai_client(h, sid)
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            await client.chat.completions.create(**chat_with_arguments(args))
        else:
            await client.responses.create(**responses_with_arguments(args))
    param = "messages.1.tool_calls.0.function.arguments" if route == "chat" else "input.1.arguments"
    assert info.value.param == param, info.value.body
    assert_openai_shape(info.value.response.json())
    assert len(await h.payloads(sid, ev.RequestRejected)) == 1
    # The session goes on: a well-formed call is answered.
    h.engine.push("ok")
    if route == "chat":
        done = await client.chat.completions.create(**chat_with_arguments('{"command": "ls"}'))
        assert done.choices[0].message.content == "ok"
    else:
        answered = await client.responses.create(**responses_with_arguments('{"command": "ls"}'))
        assert answered.output_text == "ok"


@pytest.fixture
async def small_body_harness(tokenizer: Any, sqlite_url: str) -> AsyncIterator[Harness]:
    h = await make_harness(tokenizer, sqlite_url, max_body_bytes=32 * 1024)
    try:
        yield h
    finally:
        await h.close()


@pytest.mark.parametrize("path", OPENAI_PATHS)
async def test_errors_outside_the_dialect_are_in_openai_shape(
    small_body_harness: Harness, path: str
) -> None:
    """413, 405 and a body that is not the gzip it claims came back as `{"type": "error"}`."""
    h = small_body_harness
    sid = await h.open_session()
    client = openai_client(h, sid)
    route = path.removeprefix("/v1")
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 64 * 1024}]}
    with pytest.raises(openai.APIStatusError) as too_large:
        await client.post(route, body=big, cast_to=object)
    assert too_large.value.status_code == 413
    error = assert_openai_shape(too_large.value.response.json())
    assert error["code"] == "request_too_large" and too_large.value.code == "request_too_large"
    with pytest.raises(openai.APIStatusError) as wrong_method:
        await client.get(route, cast_to=object)
    assert wrong_method.value.status_code == 405
    assert_openai_shape(wrong_method.value.response.json())
    headers = {"Authorization": f"Bearer {sid}", "Content-Encoding": "gzip"}
    # A body that cannot be read closes the connection: one connection per request.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        async with http.post(h.url + path, data=b"not gzip at all", headers=headers) as resp:
            data = await resp.json(content_type=None)
        assert resp.status == 400, data
        assert assert_openai_shape(data)["type"] == "invalid_request_error"
        # Anthropic's route keeps Anthropic's shape.
        async with http.post(h.url + "/v1/messages", data=b"not gzip", headers=headers) as resp:
            data = await resp.json(content_type=None)
        assert resp.status == 400 and data["type"] == "error", data


async def _raw(h: Harness, request: bytes) -> tuple[int, Any]:
    host, port = h.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 60)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("path", OPENAI_PATHS)
async def test_parser_refusals_are_in_openai_shape(harness: Harness, path: str) -> None:
    """A header line over aiohttp's limit (431) and a malformed header (400), refused by the
    HTTP parser before any handler runs."""
    long_line = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 9000}\r\nContent-Length: 0\r\n\r\n"
    )
    status, data = await _raw(harness, long_line.encode())
    assert status == 431, data
    assert_openai_shape(data)
    malformed = f"POST {path} HTTP/1.1\r\nHost: x\r\nBad Header\r\nContent-Length: 0\r\n\r\n"
    status, data = await _raw(harness, malformed.encode())
    assert status == 400, data
    assert_openai_shape(data)
    status, data = await _raw(harness, long_line.replace(path, "/v1/messages").encode())
    assert status == 431 and data["type"] == "error", data


@pytest.mark.parametrize("route", ["chat", "responses"])
async def test_json_object_is_enforced_by_the_engines_json_constraint(
    harness: Harness, route: str
) -> None:
    """`{"type": "json_object"}` was dropped: the engine decoded free text."""
    h = harness
    sid = await h.open_session()
    client = openai_client(h, sid)
    h.engine.push('{"ok": true}')
    if route == "chat":
        await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "answer in JSON"}],
            response_format={"type": "json_object"},
        )
    else:
        await client.responses.create(
            model="m", input="answer in JSON", text={"format": {"type": "json_object"}}
        )
    assert json.loads(h.engine.requests[-1].json_schema or "null") == {"type": "object"}


BAD_FORMATS = [
    ("chat", {"type": "xml"}, "response_format.type"),
    (
        "chat",
        {"type": "json_schema", "json_schema": {"name": "x"}},
        "response_format.json_schema.schema",
    ),
    ("chat", {"type": "json_schema"}, "response_format.json_schema.schema"),
    ("responses", {"type": "xml"}, "text.format.type"),
    ("responses", {"type": "json_schema", "name": "x"}, "text.format.schema"),
]


@pytest.mark.parametrize(("route", "fmt", "param"), BAD_FORMATS)
async def test_invalid_output_formats_are_400(
    harness: Harness, route: str, fmt: dict[str, Any], param: str
) -> None:
    """These were answered 200 with free text; OpenAI's API refuses them."""
    h = harness
    sid = await h.open_session()
    client = openai_client(h, sid)
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "x"}],
                response_format=fmt,  # type: ignore[arg-type]
            )
        else:
            await client.responses.create(model="m", input="x", text={"format": fmt})  # type: ignore[typeddict-item]
    assert info.value.param == param, info.value.body
    assert_openai_shape(info.value.response.json())
    assert h.engine.requests == []


async def test_storage_errors_escaping_a_handler_are_in_the_paths_shape() -> None:
    """The middleware's 529 (a storage error no responder caught: the session's lock or its
    catch-up during an outage) came back as `{"type": "error"}` on the OpenAI paths too."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from recorder.log.store.base import StorageUnavailable
    from recorder.server.errors import api_errors

    async def outage(request: web.Request) -> web.Response:
        raise StorageUnavailable("the event log cannot be reached: the database is unreachable")

    app = web.Application(middlewares=[api_errors])
    for path in (*OPENAI_PATHS, "/v1/messages"):
        app.router.add_post(path, outage)
    async with TestServer(app) as server:
        client = openai.AsyncOpenAI(
            base_url=str(server.make_url("/v1")), api_key="k", max_retries=0
        )
        for route in ("/chat/completions", "/responses"):
            with pytest.raises(openai.APIStatusError) as info:
                await client.post(route, body={}, cast_to=object)
            assert info.value.status_code == 529
            error = assert_openai_shape(info.value.response.json())
            assert (error["type"], error["code"]) == ("server_error", "overloaded")
            assert "unreachable" in error["message"]
        async with (
            aiohttp.ClientSession() as http,
            http.post(server.make_url("/v1/messages"), json={}) as resp,
        ):
            data = await resp.json()
        assert resp.status == 529 and data["type"] == "error", data
