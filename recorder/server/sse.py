"""Server-sent events for the Messages API, opened lazily and kept alive.

The stream is opened (status 200 sent) only when there is something to say or
when the client has waited `first_byte_after` seconds. Until then a failure can
still be answered as a plain HTTP error with the right status: clients retry a
529 status but not an `event: error`, and a 400 for a prompt that does not fit
is more useful than a mid-stream error. The greeting (`message_start`) goes
out first whenever the stream opens.
Once open, a `ping` goes out every `ping_interval` seconds while the engine
works or is paused: Claude Code gives up on a stream silent for ~20 s.
A write the client does not take within `write_timeout` (a peer that stopped
reading but keeps the connection open) drops the connection: the turn runs
under its session's lock, which must never wait on a client forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from recorder.dialects.sse import SseFrame, encode_sse

log = logging.getLogger("recorder.server")

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}

PING = ("ping", {"type": "ping"})


class _SseResponse(web.StreamResponse):
    """A streamed response whose status line and headers leave with its first write.

    aiohttp's `StreamResponse` sends them on `prepare` by themselves: one more
    socket write (and one more wake-up of the client) per turn. `web.Response`
    buffers them the same way; the stream's first write always follows at once.
    """

    _send_headers_immediately = False


class SseStream:
    """One SSE response; every write goes through one lock so frames never interleave."""

    def __init__(
        self,
        request: web.Request,
        *,
        first_byte_after: float = 1.0,
        ping_interval: float = 5.0,
        write_timeout: float = 60.0,
        headers: dict[str, str] | None = None,
        ping: bytes | None = None,
    ) -> None:
        self._request = request
        # OpenAI clients read only `data:` events: they are kept alive by an SSE comment.
        self._ping = ping if ping is not None else encode_sse(*PING)
        self._first_byte_after = first_byte_after
        self._ping_interval = ping_interval
        self._write_timeout = write_timeout
        self._headers = {**SSE_HEADERS, **(headers or {})}
        self._response: web.StreamResponse | None = None
        self._lock = asyncio.Lock()
        # The first ping is a timer, not a task: most answers come back before it
        # is due, and a task per turn costs loop iterations to start and cancel.
        self._first_ping: asyncio.TimerHandle | None = None
        self._keepalive: asyncio.Task[None] | None = None
        # Encoded when the stream opens: a provisional greeting is usually replaced first.
        self._greeting: SseFrame | None = None
        self.client_gone = False

    @property
    def opened(self) -> bool:
        return self._response is not None

    @property
    def response(self) -> web.StreamResponse:
        if self._response is None:
            raise RuntimeError("the SSE stream was never opened")
        return self._response

    def set_greeting(self, event: str | None, data: Any) -> bool:
        """The stream's first event, sent when it opens; False if it already opened."""
        if self._response is not None:
            return False
        self._greeting = (event, data)
        return True

    def start_keepalive(self) -> None:
        if self._keepalive is None and self._first_ping is None:
            self._first_ping = asyncio.get_running_loop().call_later(
                self._first_byte_after, self._start_pinging
            )

    def _start_pinging(self) -> None:
        self._first_ping = None
        self._keepalive = asyncio.get_running_loop().create_task(self._keep_alive())

    async def stop_keepalive(self) -> None:
        timer, self._first_ping = self._first_ping, None
        if timer is not None:
            timer.cancel()
        task, self._keepalive = self._keepalive, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def send(self, event: str | None, data: Any) -> None:
        await self.send_many([(event, data)])

    async def send_many(self, events: Iterable[SseFrame]) -> None:
        """Write several events in one socket write (open the stream first if needed)."""
        payload = b"".join(encode_sse(name, data) for name, data in events)
        async with self._lock:
            await self._open_locked()
            await self._write_locked(payload)

    async def finish(self, events: Iterable[SseFrame] = ()) -> web.StreamResponse:
        """End the stream, after `events`: a stream that opens now sends its headers,
        greeting, events and end in one socket write (an answer that came back
        before any ping, the usual case), else its events and end in one."""
        await self.stop_keepalive()
        payload = b"".join(encode_sse(name, data) for name, data in events)
        async with self._lock:
            if self._response is None and self._greeting is not None:
                payload, self._greeting = encode_sse(*self._greeting) + payload, None
            await self._open_locked()
            await self._write_locked(payload, last=True)
        return self.response

    async def _open_locked(self) -> None:
        if self._response is not None:
            return
        response = _SseResponse(status=200, headers=self._headers)
        response.enable_chunked_encoding()
        await response.prepare(self._request)  # the headers go with the first write
        self._response = response
        if self._greeting is not None:
            greeting, self._greeting = self._greeting, None
            await self._write_locked(encode_sse(*greeting))

    async def _write_locked(self, payload: bytes, *, last: bool = False) -> None:
        """Write `payload` (`last`: and end the chunked body in the same write)."""
        if self.client_gone:
            return
        try:
            async with asyncio.timeout(self._write_timeout):
                if last:
                    await self.response.write_eof(payload)
                else:
                    await self.response.write(payload)
        except ConnectionError:
            # The client left; aiohttp cancels the handler (handler_cancellation)
            # which is where the disconnect is recorded.
            self.client_gone = True
        except TimeoutError:
            self.client_gone = True
            log.warning(
                "SSE client took no data for %.0fs; dropping its connection", self._write_timeout
            )
            transport = self._request.transport
            if transport is not None:
                transport.abort()

    async def _keep_alive(self) -> None:
        try:
            while not self.client_gone:
                async with self._lock:
                    await self._open_locked()
                    await self._write_locked(self._ping)
                await asyncio.sleep(self._ping_interval)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.debug("SSE keep-alive stopped", exc_info=True)
