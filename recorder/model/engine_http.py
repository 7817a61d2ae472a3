"""Keep-alive HTTP/1.1 POSTs of pre-made JSON to a plain-HTTP engine: `/generate`'s transport.

A turn's engine call is one POST of bytes already built (`GenerateBodies`) and
one JSON answer. Through aiohttp's client that costs ~130 us of CPU per
request above the socket work (a request and a response object, header
multidicts, a task that writes the body, timer handles), a few percent of a
turn's CPU. Here it is one write of a fixed header and the body, and one
parse of the answer as its bytes arrive, on a connection kept alive for the
next turn.

Only what `/generate` needs: `http://` origins (anything else stays on
aiohttp, see `EngineClient`), answers with a Content-Length, chunked, or
ended by the connection closing; 1xx interim answers skipped. Failures are
told apart as aiohttp's are, since the caller's recovery depends on them:
`CannotConnect` (nothing was sent: the engine never saw the request),
`ConnectionLost` (it was sent, the engine may be running it), `BadAnswer`
(not HTTP), and `TimeoutError` from the caller's own deadline. A connection
whose exchange did not end cleanly (cancelled, timed out, failed, or bytes
beyond the answer) is closed, never reused.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable

from yarl import URL

# Above this the body goes out in its own write after the header: joining them
# would copy the whole body (~0.6 MB of ids at 100k tokens) once more.
_JOIN_BELOW = 64 * 1024
_MAX_HEAD = 64 * 1024  # an answer's status line and headers
# Idle connections kept per engine, and for how long (aiohttp's connector keeps
# them 15 s): after a burst of turns, the engine is not held to hundreds of sockets.
_MAX_IDLE = 64
_IDLE_S = 15.0


class CannotConnect(Exception):
    """No connection to the engine: the request never left."""


class ConnectionLost(Exception):
    """The connection ended before the whole answer arrived: the engine may have the request."""


class BadAnswer(ValueError):
    """The engine's bytes are not an HTTP/1.x answer."""


class Origin:
    """Where an engine listens, and the fixed start of every request head to it."""

    __slots__ = ("_head", "host", "path", "port")

    def __init__(self, host: str, port: int, path: str) -> None:
        self.host, self.port, self.path = host, port, path
        self._head: dict[str, bytes] = {}

    def head(self, path: str, length: int) -> bytes:
        start = self._head.get(path)
        if start is None:
            host = self.host if ":" not in self.host else f"[{self.host}]"
            start = (
                f"POST {self.path}{path} HTTP/1.1\r\nHost: {host}:{self.port}\r\n"
                "Content-Type: application/json\r\nAccept: */*\r\nContent-Length: "
            ).encode("latin-1")
            self._head[path] = start
        return start + str(length).encode() + b"\r\n\r\n"


def plain_origin(url: str) -> Origin | None:
    """The origin of an `http://host:port[/prefix]` URL; None for anything this module
    does not speak (https, credentials, a query): those stay on aiohttp."""
    parsed = URL(url.rstrip("/"))
    if parsed.scheme != "http" or not parsed.host or parsed.user or parsed.password:
        return None
    if parsed.query_string or parsed.fragment:
        return None
    return Origin(parsed.host, parsed.port or 80, parsed.raw_path.rstrip("/"))


class AnswerReader:
    """An HTTP/1.x answer read from the bytes as they come (pure: no I/O).

    `feed` returns True once the answer is whole; then `status`, `body` and
    `reusable` (the connection may carry the next request) are set.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._body_at = -1  # where the body starts, once the head is read
        self._length = -1  # Content-Length; -1: chunked or until the connection closes
        self._chunked = False
        self._at = 0  # chunked: where the next chunk's size line starts
        self._pieces: list[bytes] = []
        self._keep_alive = False
        self.status = 0
        self.body = b""
        self.reusable = False

    def feed(self, data: bytes) -> bool:
        self._buf += data
        if self._body_at < 0 and not self._read_head():
            return False
        if self._chunked:
            return self._read_chunks()
        if self._length >= 0:
            end = self._body_at + self._length
            if len(self._buf) < end:
                return False
            self._finish(bytes(self._buf[self._body_at : end]), extra=len(self._buf) > end)
            return True
        return False  # the body ends when the connection does (`feed_eof`)

    def feed_eof(self) -> bool:
        """The engine closed its side: True if that ended the answer (no length given)."""
        if self._body_at >= 0 and not self._chunked and self._length < 0:
            self._keep_alive = False
            self._finish(bytes(self._buf[self._body_at :]), extra=False)
            return True
        return False

    def _finish(self, body: bytes, *, extra: bool) -> None:
        self.body = body
        self.reusable = self._keep_alive and not extra
        self._buf = bytearray()

    def _read_head(self) -> bool:
        """Parse the status line and headers once they are all here (1xx ones skipped)."""
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > _MAX_HEAD:
                    raise BadAnswer(f"no end of the answer's headers in {len(self._buf)} bytes")
                return False
            lines = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
            version, status = _status_line(lines[0])
            if 100 <= status < 200:
                del self._buf[: end + 4]
                continue
            self.status = status
            self._headers(version, lines[1:])
            self._body_at = end + 4
            if status in (204, 304):
                self._chunked, self._length = False, 0
            return True

    def _headers(self, version: str, lines: list[str]) -> None:
        connection = ""
        lengths: set[str] = set()
        for line in lines:
            name, sep, value = line.partition(":")
            if not sep:
                raise BadAnswer(f"a header line without a colon: {line[:100]!r}")
            name, value = name.strip().lower(), value.strip()
            if name == "content-length":
                lengths.add(value)
            elif name == "transfer-encoding":
                self._chunked = value.lower().rsplit(",", 1)[-1].strip() == "chunked"
            elif name == "connection":
                connection += "," + value.lower()
        tokens = {t.strip() for t in connection.split(",")}
        if version == "HTTP/1.1":
            self._keep_alive = "close" not in tokens
        else:
            self._keep_alive = "keep-alive" in tokens
        if self._chunked:
            return
        if len(lengths) > 1:
            raise BadAnswer(f"conflicting Content-Length headers: {sorted(lengths)}")
        if lengths:
            value = lengths.pop()
            if not value.isdigit():
                raise BadAnswer(f"Content-Length is not a number: {value[:40]!r}")
            self._length = int(value)

    def _read_chunks(self) -> bool:
        buf = self._buf
        at = max(self._at, self._body_at)
        while True:
            line_end = buf.find(b"\r\n", at)
            if line_end < 0:
                self._at = at
                return False
            size_text = bytes(buf[at:line_end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise BadAnswer(f"a chunk size that is not hex: {size_text[:40]!r}") from None
            data_at = line_end + 2
            if size == 0:
                if buf[data_at : data_at + 2] == b"\r\n":
                    end = data_at + 2
                else:
                    trailers = buf.find(b"\r\n\r\n", data_at)
                    if trailers < 0:
                        self._at = at
                        return False
                    end = trailers + 4
                self._finish(b"".join(self._pieces), extra=len(buf) > end)
                return True
            if len(buf) < data_at + size + 2:
                self._at = at
                return False
            if buf[data_at + size : data_at + size + 2] != b"\r\n":
                raise BadAnswer("a chunk not followed by CRLF")
            self._pieces.append(bytes(buf[data_at : data_at + size]))
            at = data_at + size + 2


def _status_line(line: str) -> tuple[str, int]:
    version, _, rest = line.partition(" ")
    code = rest[:3]
    if version not in ("HTTP/1.1", "HTTP/1.0") or not code.isdigit():
        raise BadAnswer(f"not an HTTP/1.x status line: {line[:100]!r}")
    return version, int(code)


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._reader: AnswerReader | None = None
        self._answer: asyncio.Future[AnswerReader] | None = None
        self._paused = False
        self._drained: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        if reader is None:  # bytes nobody asked for: out of step, never reused
            self.close()
            return
        try:
            done = reader.feed(data)
        except BadAnswer as exc:
            self._fail(exc)
            self.close()
            return
        if done:
            self._settle(reader)

    def eof_received(self) -> bool:
        reader = self._reader
        if reader is not None and reader.feed_eof():
            self._settle(reader)
        return False  # the transport closes itself; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(ConnectionLost(f"the engine closed the connection ({exc or 'EOF'})"))
        self._wake_writer()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writer()

    # -- one exchange ----------------------------------------------------------

    async def exchange(
        self, head: bytes, body: bytes, on_sent: Callable[[], None] | None
    ) -> AnswerReader:
        """Send `head` + `body`, call `on_sent` once they are handed to the socket,
        return the whole answer."""
        transport = self.transport
        if transport is None or self.lost or transport.is_closing():
            raise ConnectionLost("the connection to the engine is closed")
        loop = asyncio.get_running_loop()
        self._reader = AnswerReader()
        answer = self._answer = loop.create_future()
        try:
            if len(body) < _JOIN_BELOW:
                transport.write(head + body)
            else:
                transport.write(head)
                transport.write(body)
            while self._paused and not self.lost:
                self._drained = loop.create_future()
                await self._drained
            failed = answer.done() and answer.exception() is not None
            if on_sent is not None and not failed:
                on_sent()
            return await answer
        finally:
            self._reader = self._answer = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.lost = True

    def _settle(self, reader: AnswerReader) -> None:
        answer = self._answer
        self._reader = None
        if answer is not None and not answer.done():
            answer.set_result(reader)

    def _fail(self, exc: Exception) -> None:
        answer = self._answer
        self._reader = None
        if answer is not None and not answer.done():
            answer.set_exception(exc)

    def _wake_writer(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)


class LeanPool:
    """Keep-alive connections per origin, for POSTs of pre-made bytes.

    `limit` > 0 caps the connections in use at once (the rest wait), as
    aiohttp's connector `limit` does; 0: no cap.
    """

    def __init__(self, *, limit: int = 0, connect_timeout_s: float = 10.0) -> None:
        # Per (host, port): idle connections with when each was last used, newest last.
        self._idle: defaultdict[tuple[str, int], list[tuple[_Connection, float]]]
        self._idle = defaultdict(list)
        self._slots = asyncio.Semaphore(limit) if limit > 0 else None
        self._connect_timeout_s = connect_timeout_s
        self._origins: dict[str, Origin | None] = {}

    def origin(self, url: str) -> Origin | None:
        """`plain_origin(url)`, remembered (None: use aiohttp for this engine)."""
        try:
            return self._origins[url]
        except KeyError:
            found = self._origins[url] = plain_origin(url)
            return found

    async def post(
        self,
        origin: Origin,
        path: str,
        body: bytes,
        *,
        on_sent: Callable[[], None] | None = None,
    ) -> tuple[int, bytes]:
        """(status, body) of one POST; raises CannotConnect, ConnectionLost, BadAnswer
        (the caller's deadline: TimeoutError, from its own `asyncio.timeout`)."""
        if self._slots is None:
            return await self._post(origin, path, body, on_sent)
        async with self._slots:
            return await self._post(origin, path, body, on_sent)

    async def _post(
        self, origin: Origin, path: str, body: bytes, on_sent: Callable[[], None] | None
    ) -> tuple[int, bytes]:
        key = (origin.host, origin.port)
        conn = self._idle_connection(key) or await self._connect(origin)
        try:
            answer = await conn.exchange(origin.head(path, len(body)), body, on_sent)
        except BaseException:
            conn.close()
            raise
        idle = self._idle[key]
        if answer.reusable and not conn.lost and len(idle) < _MAX_IDLE:
            idle.append((conn, asyncio.get_running_loop().time()))
        else:
            conn.close()
        return answer.status, answer.body

    def _idle_connection(self, key: tuple[str, int]) -> _Connection | None:
        """The most recently used live idle connection; those idle too long are closed."""
        idle = self._idle.get(key)
        if not idle:
            return None
        stale_before = asyncio.get_running_loop().time() - _IDLE_S
        if idle[0][1] < stale_before:  # the oldest idle too long: close all such
            fresh = [(conn, used) for conn, used in idle if used >= stale_before]
            for conn, used in idle:
                if used < stale_before:
                    conn.close()
            idle[:] = fresh
        while idle:
            conn, _ = idle.pop()
            if not conn.lost and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(_Connection, origin.host, origin.port)
        except TimeoutError:
            raise  # a timeout, as aiohttp's connect timeout is
        except OSError as exc:
            raise CannotConnect(f"{origin.host}:{origin.port}: {exc}") from exc
        return conn

    def close(self) -> None:
        for conns in self._idle.values():
            for conn, _ in conns:
                conn.close()
        self._idle.clear()
