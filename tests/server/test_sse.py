"""The SSE stream against a client that stops reading but keeps its connection open."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from recorder.server.app import free_port
from recorder.server.sse import SseStream

# Far more than the socket buffers on both sides can hold.
_BIG_EVENT = ("content_block_delta", {"text": "x" * (16 * 1024 * 1024)})


async def test_a_client_that_stops_reading_is_dropped_not_waited_for() -> None:
    outcome: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    async def handler(request: web.Request) -> web.StreamResponse:
        stream = SseStream(request, first_byte_after=0, write_timeout=0.2)
        try:
            await stream.send(*_BIG_EVENT)
            outcome.set_result(stream.client_gone)
        except BaseException as exc:
            outcome.set_exception(exc)
            raise
        return stream.response

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        await asyncio.get_running_loop().sock_sendall(
            sock, b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"
        )
        # The client never reads: without a write timeout the handler (and the
        # session lock a turn holds around it) would wait forever.
        assert await outcome is True
    finally:
        sock.close()
        await runner.cleanup()


async def test_an_answer_before_the_first_ping_is_one_socket_write() -> None:
    """Status line, headers, greeting, events and the chunked end leave in one write:
    each write to a local client is a send and a wake-up of the client."""
    writes: list[bytes] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        transport = request.transport
        assert transport is not None
        write, writelines = transport.write, transport.writelines
        transport.write = lambda data: (writes.append(bytes(data)), write(data))[1]  # type: ignore[method-assign]
        transport.writelines = lambda chunks: (  # type: ignore[method-assign]
            writes.append(b"".join(chunks)),
            writelines(chunks),
        )[1]
        stream = SseStream(request, first_byte_after=60)
        stream.set_greeting("message_start", {"type": "message_start"})
        stream.start_keepalive()
        response = await stream.finish([("message_stop", {"type": "message_stop"})])
        transport.write, transport.writelines = write, writelines  # type: ignore[method-assign]
        return response

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
        received = await reader.readuntil(b"0\r\n\r\n")
        writer.close()
    finally:
        await runner.cleanup()
    assert len(writes) == 1
    assert writes[0] == received
    assert received.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"event: message_start" in received and b"event: message_stop" in received
