"""How a turn's answer travels: one JSON body, or server-sent events.

Both take the same calls from the turn pipeline (`started`, `answer`,
`fail`), so the pipeline never branches on the transport; each takes the
dialect that writes the answer (recorder/dialects), so it never branches on
the wire format either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from recorder.dialects.answer import Answer, usage_for
from recorder.dialects.errors import ApiError
from recorder.server import errors
from recorder.server.sse import SseStream

if TYPE_CHECKING:
    from recorder.dialects.base import Dialect


def _anthropic() -> Dialect:
    from recorder.dialects.anthropic import ANTHROPIC

    return ANTHROPIC


def error_response(err: ApiError, dialect: Dialect) -> web.Response:
    """The error in the dialect's shape, with its status (one response builder for all)."""
    return errors.error_response(err, dialect.error(err))


class JsonResponder:
    """Non-streaming: nothing is sent until the answer (or the error) is ready."""

    streaming = False

    def __init__(
        self, headers: dict[str, str] | None = None, *, dialect: Dialect | None = None
    ) -> None:
        self._headers = headers or {}
        self.dialect = dialect or _anthropic()

    async def started(self, message_id: str, model: str, usage: dict[str, int]) -> None:
        return None

    async def answer(self, answer: Answer) -> web.StreamResponse:
        return web.Response(
            body=msgspec.json.encode(self.dialect.message(answer)),
            content_type="application/json",
            headers=self._headers,
        )

    async def fail(self, err: ApiError) -> web.StreamResponse:
        response = error_response(err, self.dialect)
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
        dialect: Dialect | None = None,
    ) -> None:
        self.dialect = dialect or _anthropic()
        self._stream = SseStream(
            request,
            ping_interval=ping_interval,
            first_byte_after=first_byte_after,
            write_timeout=write_timeout,
            headers=headers,
            ping=self.dialect.ping,
        )
        self._headers = headers or {}
        # If the stream must open before the turn is planned (a long wait for
        # the session lock), it still opens with message_start; usage is then
        # provisional and message_delta carries the real numbers.
        self._stream.set_greeting(*self.dialect.opening(message_id, model, _NO_USAGE))

    @property
    def stream(self) -> SseStream:
        return self._stream

    def keep_alive(self) -> None:
        self._stream.start_keepalive()

    async def started(self, message_id: str, model: str, usage: dict[str, int]) -> None:
        """`message_start` with the real input size, unless the stream already opened."""
        self._stream.set_greeting(*self.dialect.opening(message_id, model, usage))

    async def answer(self, answer: Answer) -> web.StreamResponse:
        return await self._stream.finish(self.dialect.frames(answer))

    async def fail(self, err: ApiError) -> web.StreamResponse:
        await self._stream.stop_keepalive()
        if not self._stream.opened:
            response = error_response(err, self.dialect)
            response.headers.update(self._headers)
            return response
        await self._stream.send(*self.dialect.error_frame(err))
        return await self._stream.finish()

    async def close(self) -> None:
        await self._stream.stop_keepalive()


Responder = JsonResponder | SseResponder

_NO_USAGE = usage_for(0, 0, 0)
