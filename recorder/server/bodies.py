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
    """The whole body, with `request.read()`'s size limit (413) and errors, or
    ApiError(400) when it stops arriving.

    The chunks are joined once, as they are (one chunk: no copy at all):
    `request.read()` copies a body twice more (into a bytearray, then bytes),
    ~0.6 MB each at 100k tokens of context. A body not all here yet (over
    ~256 kB, aiohttp's buffer pauses the socket) is read chunk by chunk, each
    awaited at most `idle_timeout_s`: no task watching it.
    """
    config = request.app[CTX].config
    content = request.content
    limit = config.max_body_bytes  # the app's client_max_size (app.py)
    raise_limits = getattr(content, "set_read_chunk_size", None)
    if raise_limits is not None:  # as request.read() does: fewer pause/resume cycles
        raise_limits(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        if content.is_eof():  # the rest is all here (usually the whole body, at once)
            chunk, last = content.read_nowait(), True
        else:
            try:
                async with asyncio.timeout(config.idle_timeout_s):
                    chunk = await content.readany()
            except TimeoutError:
                raise ApiError(
                    "invalid_request_error",
                    _stalled(request, content.total_raw_bytes, config.idle_timeout_s),
                ) from None
            last = not chunk
        if chunk:
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
        if last:
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _stalled(request: web.Request, arrived: int, idle_s: float) -> str:
    declared = request.content_length
    of = f" of the {declared} its Content-Length declares" if declared is not None else ""
    return (
        f"the request body stopped arriving: {arrived} bytes{of}, then nothing for "
        f"{idle_s:g} s; send the whole body"
    )
