"""What aiohttp's server side costs per turn: our configuration of it against a bare asyncio protocol.

Issue 25 asks for ≤ 1.5 ms of CPU per turn at small context; the "floor" of
`bench_middleware --section cpu` (an aiohttp middleware doing only the I/O)
is above that. This measures how much of a turn is aiohttp's server itself,
so the decision to replace it rests on a figure: both servers answer the same
keep-alive POSTs (a Claude-Code-shaped request of `--body-kb` kB) with the
same streamed answer (one chunked SSE write, as `SseStream.finish` makes it),
and the table prints each server process's CPU per request (all threads,
`/proc`), medians over rounds that alternate the two servers.

  aiohttp   `web.Application` with a middleware and the `RecorderRunner`
            our server runs (`recorder.server.protocol`), handler reads the
            whole body and answers through a chunked `StreamResponse`.
  bare      an `asyncio.Protocol` that finds the header end and
            Content-Length with bytes methods, collects the body and writes
            the same chunked answer in one `transport.write`: no header
            parsing, no request object, no routing. A lower bound for any
            server of ours (a real one parses headers and checks limits), so
            aiohttp - bare is the most replacing aiohttp could save.

Both run on the loop `--loop` names (asyncio or uvloop). The client is one
process per server sending pre-made request bytes over raw sockets.

    python -m tools.bench_http_server [--requests 2000] [--rounds 5] [--body-kb 4,400]
        [--loop asyncio|uvloop] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.benchkit.cpu import cpu_ns  # noqa: E402

ANSWER_EVENTS = 6  # message_start, a text block (start, delta, stop), message_delta, message_stop
SSE_BODY = b"".join(
    b"event: e\ndata: " + b'{"type":"content_block_delta","index":0,"delta":{"text":"' + b"x" * 180
    + b'"}}\n\n'
    for _ in range(ANSWER_EVENTS)
)  # fmt: skip
CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(SSE_BODY), SSE_BODY)
END = b"\r\n0\r\n\r\n"
HEADERS = {
    "content-type": "text/event-stream",
    "cache-control": "no-cache",
    "request-id": "req_0123456789abcdef0123",
}


def request_bytes(body_kb: int) -> bytes:
    """A POST /v1/messages with Claude Code's usual headers and a JSON body of `body_kb` kB."""
    body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"'
    body += b"a" * max(0, body_kb * 1024 - len(body) - 4) + b'"}]}'
    head = (
        "POST /v1/messages?beta=true HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        "accept: application/json\r\ncontent-type: application/json\r\n"
        "user-agent: claude-cli/2.1.330 (external, cli)\r\nx-api-key: sess-0123\r\n"
        "anthropic-version: 2023-06-01\r\nanthropic-beta: claude-code-20250219\r\n"
        "x-stainless-lang: js\r\nx-stainless-retry-count: 0\r\nx-stainless-timeout: 600\r\n"
        f"accept-encoding: gzip, deflate\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


# -- the two servers -----------------------------------------------------------


def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    from recorder.server.protocol import RecorderRunner

    @web.middleware
    async def passthrough(request: web.Request, handler: Callable) -> web.StreamResponse:
        return await handler(request)

    async def messages(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(status=200, headers=HEADERS)
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write_eof(SSE_BODY)
        return response

    async def main() -> None:
        app = web.Application(middlewares=[passthrough], client_max_size=64 << 20)
        app.add_routes([web.post("/v1/messages", messages)])
        runner = RecorderRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    _run(main)


class _Bare(asyncio.Protocol):
    """Just enough HTTP/1.1 to answer keep-alive POSTs with a Content-Length."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            at = self.buffer.find(b"content-length:", 0, end)
            stop = self.buffer.find(b"\r\n", at, end + 2)
            total = end + 4 + int(self.buffer[at + 15 : stop])
            if len(self.buffer) < total:
                return
            body = bytes(memoryview(self.buffer)[end + 4 : total])  # as a handler gets it
            del self.buffer[:total]
            self.transport.write(_bare_answer(body))  # type: ignore[attr-defined]


def _bare_answer(body: bytes) -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in HEADERS.items())
    return b"HTTP/1.1 200 OK\r\n" + head.encode() + b"transfer-encoding: chunked\r\n\r\n" + CHUNKED


def serve_bare(port: int) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        await loop.create_server(_Bare, "127.0.0.1", port)
        await asyncio.Event().wait()

    _run(main)


def _run(main: Callable) -> None:
    if os.environ.get("BENCH_LOOP") == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


# -- client ----------------------------------------------------------------------


def drive(port: int, request: bytes, n: int, concurrency: int) -> None:
    """Send `n` requests over `concurrency` keep-alive connections, one at a time each."""
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(concurrency)]
    for i in range(n):
        conn = conns[i % concurrency]
        conn.sendall(request)
        got = b""
        while not got.endswith(END):
            chunk = conn.recv(1 << 16)
            if not chunk:
                raise ConnectionError("server closed the connection")
            got += chunk
    for conn in conns:
        conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int) -> None:
    for _ in range(400):
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return
        except OSError:
            asyncio.run(asyncio.sleep(0.025))
    raise RuntimeError(f"server on {port} never listened")


def measure(args: argparse.Namespace) -> dict[tuple[str, int], list[float]]:
    os.environ["BENCH_LOOP"] = args.loop
    ctx = mp.get_context("spawn")
    servers = {"aiohttp": serve_aiohttp, "bare": serve_bare}
    procs, ports = {}, {}
    for name, target in servers.items():
        ports[name] = _free_port()
        procs[name] = ctx.Process(target=target, args=(ports[name],), daemon=True)
        procs[name].start()
        _wait_listening(ports[name])
    results: dict[tuple[str, int], list[float]] = {}
    try:
        for kb in args.body_kb:
            request = request_bytes(kb)
            for name in servers:  # warm-up
                drive(ports[name], request, 50, args.concurrency)
            for _ in range(args.rounds):
                for name in servers:
                    pid = procs[name].pid
                    assert pid is not None
                    before = cpu_ns(pid)
                    drive(ports[name], request, args.requests, args.concurrency)
                    per = (cpu_ns(pid) - before) / 1e6 / args.requests
                    results.setdefault((name, kb), []).append(per)
    finally:
        for proc in procs.values():
            proc.kill()
    return results


def table(results: dict[tuple[str, int], list[float]], args: argparse.Namespace) -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [
        f"server CPU per request (ms, all threads, /proc), median of {args.rounds} rounds x "
        f"{args.requests} requests, loop {args.loop}, {args.concurrency} connection(s); "
        f"load average {load}",
        f"{'body':>8}  {'aiohttp (ours)':>14}  {'bare protocol':>13}  {'aiohttp - bare':>14}",
    ]
    for kb in args.body_kb:
        a = statistics.median(results[("aiohttp", kb)])
        b = statistics.median(results[("bare", kb)])
        lines.append(f"{kb:>6}kB  {a:>14.3f}  {b:>13.3f}  {a - b:>14.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="requests per server per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--body-kb", type=lambda s: [int(x) for x in s.split(",")], default=[4, 400])
    ap.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    ap.add_argument("--concurrency", type=int, default=1, help="keep-alive connections")
    args = ap.parse_args(argv)
    print(table(measure(args), args))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
