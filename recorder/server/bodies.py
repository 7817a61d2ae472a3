"""Reading a request's body, refused when it stops arriving.

aiohttp has no read timeout for a body: a client that declares a longer
Content-Length than it sends, and waits, holds its connection and its
handler until it leaves (the idle timeout covers only the time between
requests and a half-sent header). Every handler reads its body here, so one
that stops arriving for `idle_timeout_s` is answered 400 in the Anthropic
shape instead. Progress resets the wait: a slow upload of a large body is
never cut off while bytes keep coming.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from recorder.dialects.errors import ApiError
from recorder.server.context import CTX


async def read_body(request: web.Request) -> bytes:
    """`request.read()` (its size limit and errors unchanged), or ApiError(400) on a stall."""
    if request.content.is_eof():  # all of it is here already (the usual case)
        return await request.read()
    idle_s = request.app[CTX].config.idle_timeout_s
    reading = asyncio.ensure_future(request.read())
    try:
        seen = -1
        while not reading.done():
            arrived = request.content.total_raw_bytes
            if arrived == seen:
                raise ApiError("invalid_request_error", _stalled(request, arrived, idle_s))
            seen = arrived
            await asyncio.wait({reading}, timeout=idle_s)
        return reading.result()
    finally:
        if not reading.done():
            reading.cancel()
            await asyncio.wait({reading})


def _stalled(request: web.Request, arrived: int, idle_s: float) -> str:
    declared = request.content_length
    of = f" of the {declared} its Content-Length declares" if declared is not None else ""
    return (
        f"the request body stopped arriving: {arrived} bytes{of}, then nothing for "
        f"{idle_s:g} s; send the whole body"
    )
