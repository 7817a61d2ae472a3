"""engine_http: the answer reader (pure) and the keep-alive pool against raw asyncio servers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from recorder.model.engine_http import (
    AnswerReader,
    BadAnswer,
    CannotConnect,
    ConnectionLost,
    LeanPool,
    plain_origin,
)
from tools.test_engine import free_port

OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{"a":1}'


def _read(data: bytes, step: int = 1, eof: bool = False) -> AnswerReader:
    reader = AnswerReader()
    done = False
    for at in range(0, len(data), step):
        assert not done, "an answer was whole before its last byte"
        done = reader.feed(data[at : at + step])
    if eof:
        assert not done
        done = reader.feed_eof()
    assert done
    return reader


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_content_length_answer_in_any_pieces(step: int) -> None:
    reader = _read(OK, step)
    assert (reader.status, reader.body, reader.reusable) == (200, b'{"a":1}', True)


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_chunked_answer_with_extensions_and_trailers(step: int) -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    plain = _read(head + b'3\r\n{"a\r\n4;ext=1\r\n":1}\r\n0\r\n\r\n', step)
    assert (plain.body, plain.reusable) == (b'{"a":1}', True)
    trailed = _read(head + b'7\r\n{"a":1}\r\n0\r\nX-Trailer: 1\r\n\r\n', step)
    assert trailed.body == b'{"a":1}'


def test_interim_answers_are_skipped() -> None:
    reader = _read(b"HTTP/1.1 100 Continue\r\n\r\n" + OK, 4)
    assert (reader.status, reader.body) == (200, b'{"a":1}')


def test_which_answers_leave_the_connection_reusable() -> None:
    close = OK.replace(b"Content-Length", b"Connection: close\r\nContent-Length")
    assert not _read(close, 1000).reusable
    old = OK.replace(b"HTTP/1.1", b"HTTP/1.0")
    assert not _read(old, 1000).reusable
    old_kept = old.replace(b"Content-Length", b"Connection: Keep-Alive\r\nContent-Length")
    assert _read(old_kept, 1000).reusable
    reader = AnswerReader()
    assert reader.feed(OK + b"HTTP/1.1")  # bytes past the answer: out of step
    assert reader.body == b'{"a":1}' and not reader.reusable


def test_an_answer_without_length_ends_with_the_connection() -> None:
    reader = _read(b'HTTP/1.1 500 Oops\r\n\r\n{"error":"x"}', 4, eof=True)
    assert (reader.status, reader.body, reader.reusable) == (500, b'{"error":"x"}', False)
    assert not AnswerReader().feed_eof()  # nothing came: no answer


def test_no_content_answer_is_whole_at_its_head() -> None:
    reader = _read(b"HTTP/1.1 204 No Content\r\n\r\n", 1000)
    assert (reader.status, reader.body, reader.reusable) == (204, b"", True)


@pytest.mark.parametrize(
    "data",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/2 200\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nabc\r\n",
    ],
)
def test_what_is_not_http_is_refused(data: bytes) -> None:
    with pytest.raises(BadAnswer):
        AnswerReader().feed(data)


def test_a_head_without_end_is_refused_past_its_limit() -> None:
    reader = AnswerReader()
    assert not reader.feed(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(BadAnswer):
        reader.feed(b"X-Long: " + b"a" * 70_000)


def test_only_plain_http_origins_are_taken() -> None:
    origin = plain_origin("http://127.0.0.1:30000/")
    assert origin is not None and (origin.host, origin.port, origin.path) == (
        "127.0.0.1",
        30000,
        "",
    )
    prefixed = plain_origin("http://engine/sglang/")
    assert prefixed is not None and (prefixed.port, prefixed.path) == (80, "/sglang")
    assert prefixed.head("/generate", 5).startswith(b"POST /sglang/generate HTTP/1.1\r\n")
    assert prefixed.head("/generate", 5).endswith(b"Content-Length: 5\r\n\r\n")
    for url in ("https://engine:1", "http://user:pw@engine:1", "http://engine:1/?q=1"):
        assert plain_origin(url) is None


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.Server, int, list[int]]:
    """A raw server; the list counts the connections it accepted."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], accepted


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return await reader.readexactly(length)


async def test_one_connection_carries_many_posts() -> None:
    async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    server, port, accepted = await _serve(answer_each)
    pool = LeanPool()
    origin = plain_origin(f"http://127.0.0.1:{port}")
    assert origin is not None
    try:
        sent: list[int] = []
        for i in range(3):
            big = b"x" * (100_000 if i == 1 else 10)  # a body written apart from its head
            status, body = await pool.post(origin, "/generate", big, on_sent=lambda: sent.append(1))
            assert (status, body) == (200, big)
        assert len(accepted) == 1 and len(sent) == 3
    finally:
        pool.close()
        server.close()


async def test_a_closed_connection_is_not_reused() -> None:
    async def answer_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(OK)
        await writer.drain()

    server, port, accepted = await _serve(answer_then_close)
    pool = LeanPool()
    origin = plain_origin(f"http://127.0.0.1:{port}")
    assert origin is not None
    try:
        for _ in range(3):
            assert await pool.post(origin, "/generate", b"{}") == (200, b'{"a":1}')
            await asyncio.sleep(0.05)  # the engine's close reaches the idle connection
        assert len(accepted) == 3
    finally:
        pool.close()
        server.close()


async def test_a_connection_dropped_mid_answer_is_lost() -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")
        await writer.drain()

    server, port, _ = await _serve(drop)
    pool = LeanPool()
    origin = plain_origin(f"http://127.0.0.1:{port}")
    assert origin is not None
    try:
        with pytest.raises(ConnectionLost):
            await pool.post(origin, "/generate", b"{}")
    finally:
        pool.close()
        server.close()


async def test_a_refused_connection_cannot_connect() -> None:
    origin = plain_origin(f"http://127.0.0.1:{free_port()}")
    assert origin is not None
    with pytest.raises(CannotConnect):
        await LeanPool().post(origin, "/generate", b"{}", on_sent=pytest.fail)


async def test_a_cancelled_post_closes_its_connection() -> None:
    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await reader.read()  # until the client closes

    server, port, accepted = await _serve(never)
    pool = LeanPool()
    origin = plain_origin(f"http://127.0.0.1:{port}")
    assert origin is not None
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await pool.post(origin, "/generate", b"{}")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await pool.post(origin, "/generate", b"{}")
        assert len(accepted) == 2  # the first connection's state was unknown: not reused
    finally:
        pool.close()
        server.close()


async def _echo_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        try:
            body = await _read_request(reader)
        except asyncio.IncompleteReadError:
            return
        await asyncio.sleep(0.02)  # long enough for concurrent posts to overlap
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


async def test_idle_connections_are_bounded_in_number_and_time(monkeypatch) -> None:
    import recorder.model.engine_http as engine_http

    monkeypatch.setattr(engine_http, "_MAX_IDLE", 1)
    server, port, accepted = await _serve(_echo_each)
    pool = LeanPool()
    origin = plain_origin(f"http://127.0.0.1:{port}")
    assert origin is not None
    try:
        pair = [pool.post(origin, "/generate", b"{}") for _ in range(2)]
        assert await asyncio.gather(*pair) == [(200, b"{}")] * 2
        assert len(accepted) == 2  # two at once: two connections, one kept idle
        pair = [pool.post(origin, "/generate", b"{}") for _ in range(2)]
        await asyncio.gather(*pair)
        assert len(accepted) == 3
        monkeypatch.setattr(engine_http, "_IDLE_S", 0.0)
        await asyncio.sleep(0.01)
        await pool.post(origin, "/generate", b"{}")
        assert len(accepted) == 4  # the idle one was too old: closed, not reused
    finally:
        pool.close()
        server.close()
