"""The aiohttp application and its lifecycle (start on a port, graceful stop).

`RecorderServer` is what `recorder serve`, the tests and the benchmark run:
it owns the listening socket and, on stop, refuses new turns, lets in-flight
turns finish for a grace period, cancels the rest (each records why), then
closes the engine client and the store (which flushes the log).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.web_urldispatcher import _default_expect_handler

from recorder.dialects.errors import ApiError
from recorder.server import admin, api
from recorder.server.closes import CloseWatch
from recorder.server.context import CTX, ServerConfig, ServerContext
from recorder.server.errors import api_errors, error_for_path, too_large_message
from recorder.server.protocol import RecorderRunner
from recorder.server.restore import catch_up, load_session_state
from recorder.server.sessions import SessionRegistry

if TYPE_CHECKING:
    from recorder.log.store.base import EventStore
    from recorder.model.engine import EngineClient
    from recorder.model.parsers import OutputParser
    from recorder.model.tokenizer import Tokenizer
    from replay.rules import Rules

log = logging.getLogger("recorder.server")


def create_app(ctx: ServerContext) -> web.Application:
    app = web.Application(middlewares=[api_errors], client_max_size=ctx.config.max_body_bytes)
    app[CTX] = ctx
    expect = _expect_handler(ctx.config.max_body_bytes)
    app.add_routes(
        web.RouteDef(r.method, r.path, r.handler, {**r.kwargs, "expect_handler": expect})
        for r in [*api.routes(), *admin.routes()]
    )
    return app


def _expect_handler(max_body_bytes: int) -> Callable[[web.Request], Awaitable[web.Response | None]]:
    """`Expect: 100-continue`: refuse a declared body over the limit before it is sent.

    aiohttp's default answers `100 Continue` whatever the Content-Length, so
    the client uploads the whole body only to get the 413 afterwards.
    """

    async def expect(request: web.Request) -> web.Response | None:
        length = request.content_length
        if length is not None and length > max_body_bytes:
            response = error_for_path(
                request.path,
                ApiError(
                    "request_too_large",
                    too_large_message(f"Content-Length {length} > {max_body_bytes}"),
                ),
            )
            response.force_close()
            return response
        await _default_expect_handler(request)
        return None

    return expect


def freeze_startup_heap() -> None:
    """Exempt everything startup built (modules, tokenizer, templates) from the cyclic GC.

    A full collection walks every tracked object with the GIL held: after
    importing transformers that is 100k+ objects and 30-100 ms, a pause that
    lands on whichever turns are running. Frozen objects are never walked
    again; what the server allocates afterwards is collected as usual.
    """
    gc.collect()
    gc.freeze()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def make_context(
    *,
    config: ServerConfig,
    store: EventStore,
    engine: EngineClient,
    tokenizer: Tokenizer,
    parser: OutputParser,
    rules: Rules,
) -> ServerContext:
    """The server's shared objects, wired together (the one composition root).

    The session registry loads a session it does not hold from the log, and
    brings a held one to the log's head, through restore.py; restore.py reads
    the store, engine and tokenizer from the context, so the two are joined
    here rather than inside either.
    """
    ctx = ServerContext(
        config=config, store=store, engine=engine, tokenizer=tokenizer, parser=parser, rules=rules
    )
    ctx.registry = SessionRegistry(
        functools.partial(load_session_state, ctx),
        catch_up=functools.partial(catch_up, ctx),
        locks=store.session_locks,
        outage=store.as_unavailable,
        sole_writer=config.sole_writer,
        max_held_bytes=int(config.max_cached_mb * (1 << 20)),
    )
    return ctx


class RecorderServer:
    """A running recorder HTTP server bound to `host:port` (port 0 picks a free one)."""

    def __init__(
        self,
        ctx: ServerContext,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        reuse_port: bool = False,
    ) -> None:
        """`reuse_port`: share the port with other processes (`recorder serve --workers N`);
        the kernel spreads new connections across them."""
        self.ctx = ctx
        self.host = host
        self.port = port or free_port(host)
        self.reuse_port = reuse_port
        self._runner: RecorderRunner | None = None
        self._site: web.TCPSite | None = None
        self._close_watch: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = create_app(self.ctx)
        # handler_cancellation: a client that disconnects cancels its handler,
        # which aborts the engine request and records the disconnect.
        # keepalive_timeout also closes a connection that sent half a header
        # and stalled (aiohttp counts it idle), which otherwise stays open.
        # RecorderRunner: what aiohttp refuses itself is answered in the Anthropic shape.
        self._runner = RecorderRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=1.0,
            keepalive_timeout=self.ctx.config.idle_timeout_s,
        )
        await self._runner.setup()
        self._site = web.TCPSite(
            self._runner,
            self.host,
            self.port,
            reuse_address=True,
            reuse_port=self.reuse_port or None,
        )
        await self._site.start()
        config = self.ctx.config
        if config.watches_closes:
            watch = CloseWatch(self.ctx.store, self.ctx.registry)
            self._close_watch = asyncio.create_task(watch.run(config.close_watch_interval_s))
        log.info("recorder listening on %s", self.url)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting, finish or cancel in-flight turns, release everything.

        Closing the store (which flushes the log) is the caller's job: it
        opened it.
        """
        grace = self.ctx.config.shutdown_grace_s if grace_s is None else grace_s
        self.ctx.stopping = True
        if self._close_watch is not None:
            self._close_watch.cancel()
            await asyncio.gather(self._close_watch, return_exceptions=True)
            self._close_watch = None
        if self._site is not None:
            await self._site.stop()
        inflight = set(self.ctx.inflight)
        if inflight:
            log.info("waiting up to %.0fs for %d in-flight turns", grace, len(inflight))
            _, pending = await asyncio.wait(inflight, timeout=grace)
            for task in pending:
                task.cancel()
            if pending:
                log.warning("cancelled %d turns still running after the grace period", len(pending))
                await asyncio.wait(pending, timeout=30)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.ctx.engine.close()
        close = getattr(self.ctx.parser, "close", None)
        if close is not None:
            await close()
