"""How a turn's answer travels: one JSON body, or server-sent events.

Both take the same calls from the turn pipeline (`started`, `answer`,
`fail`), so the pipeline never branches on the transport.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from recorder.server.answer import (
    Answer,
    content_events,
    message_json,
    message_start_event,
    usage_for,
)
from recorder.server.errors import ApiError, error_payload, error_response
from recorder.server.sse import SseStream


class JsonResponder:
    """Non-streaming: nothing is sent until the answer (or the error) is ready."""

    streaming = False

    def __init__(self, headers: dict[str, str] | None = None) -> None:
        self._headers = headers or {}

    async def started(self, message_id: str, model: str, usage: dict[str, int]) -> None:
        return None

    async def answer(self, answer: Answer) -> web.StreamResponse:
        return web.Response(
            body=msgspec.json.encode(message_json(answer)),
            content_type="application/json",
            headers=self._headers,
        )

    async def fail(self, err: ApiError) -> web.StreamResponse:
        response = error_response(err)
        response.headers.update(self._headers)
        return response

    async def close(self) -> None:
        return None


class SseResponder:
    """Streaming: `message_start` + pings keep the client waiting while the engine works.

    An error before the stream opened is a plain HTTP error (right status);
    after, it is an `event: error` (the status line is long gone).
    """

    streaming = True

    def __init__(
        self,
        request: web.Request,
        *,
        message_id: str,
        model: str,
        ping_interval: float,
        first_byte_after: float,
        write_timeout: float = 60.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._stream = SseStream(
            request,
            ping_interval=ping_interval,
            first_byte_after=first_byte_after,
            write_timeout=write_timeout,
            headers=headers,
        )
        self._headers = headers or {}
        # If the stream must open before the turn is planned (a long wait for
        # the session lock), it still opens with message_start; usage is then
        # provisional and message_delta carries the real numbers.
        self._stream.set_greeting(*message_start_event(message_id, model, _NO_USAGE))

    @property
    def stream(self) -> SseStream:
        return self._stream

    def keep_alive(self) -> None:
        self._stream.start_keepalive()

    async def started(self, message_id: str, model: str, usage: dict[str, int]) -> None:
        """`message_start` with the real input size, unless the stream already opened."""
        self._stream.set_greeting(*message_start_event(message_id, model, usage))

    async def answer(self, answer: Answer) -> web.StreamResponse:
        await self._stream.stop_keepalive()
        await self._stream.send_many(content_events(answer))
        return await self._stream.finish()

    async def fail(self, err: ApiError) -> web.StreamResponse:
        await self._stream.stop_keepalive()
        if not self._stream.opened:
            response = error_response(err)
            response.headers.update(self._headers)
            return response
        await self._stream.send("error", error_payload(err.error_type, err.message))
        return await self._stream.finish()

    async def close(self) -> None:
        await self._stream.stop_keepalive()


Responder = JsonResponder | SseResponder

_NO_USAGE = usage_for(0, 0, 0)
