"""aiohttp's own rejections (before any recorder code runs), in the Anthropic error shape.

aiohttp's HTTP parser refuses some requests before a handler or middleware
sees them: a header line (or the request line) over 8,190 bytes, more than
128 headers, a malformed request line, method, header or chunked body. It
answers those from `RequestHandler.handle_error`, as `text/plain`. Here that
method is overridden to answer in the error shape of the path's dialect
(`{"type": "error", ...}`, or OpenAI's `{"error": {...}}` on its routes) with
`x-should-retry: false`: 431 for a line too long, 400 for the rest (and, for
a 500/504 aiohttp raises itself, `api_error`). aiohttp has no public hook for
the handler class (`web.Server.__call__` builds `RequestHandler` directly), so
`RecorderRunner` swaps in a `web.Server` subclass that builds this one; nothing
of aiohttp is patched.

aiohttp hands `handle_error` a placeholder request whose path is "/": the
path is taken from the request line at the start of the last chunk received
(where a client's request starts), so a request whose first chunk is cut
before its path ends is answered in Anthropic's shape.

What cannot be answered: a request whose client already closed its side (a
body shorter than its Content-Length, then EOF): the transport is closed
before any handler runs, and nobody would read an answer. (With the
connection left open, the handler's body read refuses it: bodies.py.)
"""

from __future__ import annotations

import re

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler

from recorder.dialects.errors import ApiError, error_type_for_status
from recorder.server.errors import error_for_path

_REQUEST_LINE = re.compile(rb"[A-Z]{1,16} (/[^ ?#\r\n]{0,256})[ ?#]")


class AnthropicErrorsHandler(RequestHandler):
    """aiohttp's connection handler, whose own error answers are JSON in the path's dialect."""

    __slots__ = ("_last_path",)

    def data_received(self, data: bytes) -> None:
        line = _REQUEST_LINE.match(data)
        if line is not None:
            self._last_path = line[1].decode("latin-1")
        super().data_received(data)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp's own: logs, and raises if a response already started. Its body is dropped.
        super().handle_error(request, status, exc, message)
        path = getattr(self, "_last_path", "/")
        response = error_for_path(path, parser_error(status, exc))
        response.force_close()  # as aiohttp does: the stream may be out of sync
        return response


def parser_error(status: int, exc: BaseException | None) -> ApiError:
    """The error for a request aiohttp refused (or failed) with `status` and `exc`."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else "8190"
        return ApiError(
            "invalid_request_error",
            f"a request header line (or the request line) is longer than {limit} bytes; "
            "send large data in the body",
            status=431,
        )
    if status >= 500:
        return ApiError("api_error", "internal error; see the server log", status=status)
    detail = _what(exc) if isinstance(exc, HttpProcessingError) else ""
    return ApiError(
        error_type_for_status(status),  # type: ignore[arg-type]
        f"malformed HTTP request: {detail or 'it could not be parsed'}",
        status=status,
    )


def _what(exc: HttpProcessingError) -> str:
    """aiohttp's description without the echoed request bytes and caret lines:
    "Invalid method encountered", "Bad status line: Invalid HTTP version", ..."""
    lines = (line.strip() for line in exc.message.splitlines())
    kept = [
        line.rstrip(":")
        for line in lines
        if line and not line.startswith(("b'", 'b"', "bytearray(", "^"))
    ]
    return ": ".join(kept)


class AnthropicErrorsServer(web.Server):
    """`web.Server` whose connections are `AnthropicErrorsHandler`s."""

    def __call__(self) -> RequestHandler:
        return AnthropicErrorsHandler(self, loop=self._loop, **self._kwargs)


class RecorderRunner(web.AppRunner):
    """`web.AppRunner` serving the app through `AnthropicErrorsServer`."""

    __slots__ = ()

    async def _make_server(self) -> web.Server:
        app_server = await super()._make_server()
        return AnthropicErrorsServer(
            app_server.request_handler,
            request_factory=app_server.request_factory,
            handler_cancellation=app_server.handler_cancellation,
            loop=app_server._loop,
            **app_server._kwargs,
        )
