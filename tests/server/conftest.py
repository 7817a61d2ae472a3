"""A real recorder server over a real store, in front of the scripted engine.

Tests talk to it with the official `anthropic` SDK (or raw aiohttp for
malformed requests) exactly as an agent would.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import numpy as np
import pytest

from recorder.log.events import AnyEvent, ArrayRef, RecordedEvent
from recorder.log.store import open_store
from recorder.log.store.base import EventStore
from recorder.model.engine import EngineClient
from recorder.model.parsers import OutputParser, make_parser
from recorder.model.tokenizer import Tokenizer, load_tokenizer
from recorder.server import RecorderServer, ServerConfig, ServerContext, make_context
from replay.rules import load_rules
from tools.test_engine.scripted import ScriptedEngine

FIXTURE_TOKENIZER = Path(__file__).resolve().parent.parent / "data" / "smollm2-tokenizer"
CONTEXT_LENGTH = 8192

BASH = {
    "name": "Bash",
    "description": "Run a shell command.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
    "cache_control": {"type": "ephemeral"},
}
AGENT = {
    "name": "Agent",
    "description": "Dispatch a subagent.",
    "input_schema": {
        "type": "object",
        "properties": {"description": {"type": "string"}, "prompt": {"type": "string"}},
    },
}
TOOLS = [BASH, AGENT]
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=abc123;"},
    {
        "type": "text",
        "text": "You are a careful coding agent.",
        "cache_control": {"type": "ephemeral"},
    },
]


def tool_call_text(name: str, arguments: dict[str, Any], preface: str = "") -> str:
    call = json.dumps({"name": name, "arguments": arguments})
    return f"{preface}<tool_call>\n{call}\n</tool_call>"


def array_rows(sqlite_url: str) -> dict[bytes, tuple[bytes | None, int]]:
    """digest -> (parent digest, total length) of every stored array piece (SQLite only)."""
    db = sqlite3.connect(sqlite_url.split("///", 1)[1])
    try:
        return {
            bytes(d): (bytes(p) if p is not None else None, n)
            for d, p, n in db.execute("SELECT digest, parent, total_length FROM arrays")
        }
    finally:
        db.close()


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer(str(FIXTURE_TOKENIZER), chat_template="chatml-tools")


@dataclass
class Harness:
    """One recorder server + scripted engine + store, and helpers to drive them."""

    tokenizer: Tokenizer
    engine: ScriptedEngine
    store: EventStore
    config: ServerConfig
    parser: OutputParser
    engine_urls: list[str]
    # 0: no periodic engine checks, so only a turn can find an engine gone.
    engine_health_interval_s: float = 5.0
    server: RecorderServer | None = None
    http: aiohttp.ClientSession | None = None
    clients: list[anthropic.AsyncAnthropic] = field(default_factory=list)

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    @property
    def ctx(self) -> ServerContext:
        assert self.server is not None
        return self.server.ctx

    async def start_server(self) -> None:
        self.server = await self.server_on(self.store)

    async def server_on(self, store: EventStore) -> RecorderServer:
        """Another server like this one's, on `store` (a replica when it is another
        connection to the same log); the caller stops it."""
        client = EngineClient(
            self.engine_urls,
            timeout_s=60,
            connect_timeout_s=2,
            health_interval_s=self.engine_health_interval_s,
        )
        await client.start()
        ctx = make_context(
            config=self.config,
            store=store,
            engine=client,
            tokenizer=self.tokenizer,
            parser=self.parser,
            rules=load_rules(None),
        )
        server = RecorderServer(ctx)
        await server.start()
        return server

    async def stop_server(self, grace_s: float | None = None) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None

    async def restart(self, *, reopen_store: bool = True) -> None:
        """A new server process, as far as the log is concerned: nothing kept in memory."""
        await self.stop_server()
        if reopen_store:
            url = self.store.url
            await self.store.close()
            self.store = await open_store(url)
        await self.start_server()

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.admin_token}"}

    async def open_session(self, **fields: Any) -> str:
        assert self.http is not None
        async with self.http.post(
            self.url + "/sessions", json=fields, headers=self.admin_headers()
        ) as resp:
            data = await resp.json()
            assert resp.status == 201, data
            return str(data["session_id"])

    async def admin(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        assert self.http is not None
        async with self.http.request(
            method, self.url + path, json=body, headers=self.admin_headers()
        ) as resp:
            return resp.status, await resp.json()

    def client(self, session_id: str, **kwargs: Any) -> anthropic.AsyncAnthropic:
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60)
        client = anthropic.AsyncAnthropic(base_url=self.url, auth_token=session_id, **kwargs)
        self.clients.append(client)
        return client

    async def events(self, session_id: str) -> list[RecordedEvent]:
        return await self.store.read_session(session_id)

    async def payloads(self, session_id: str, type_: type | None = None) -> list[AnyEvent]:
        return [
            r.event
            for r in await self.events(session_id)
            if type_ is None or isinstance(r.event, type_)
        ]

    async def types(self, session_id: str) -> list[str]:
        return [r.type for r in await self.events(session_id)]

    async def array(self, ref: ArrayRef) -> list[int] | list[float]:
        arr: np.ndarray = await self.store.get_array(ref)
        return arr.tolist()

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
        await self.stop_server(grace_s=1)
        if self.http is not None:
            await self.http.close()
        await self.store.close()
        await self.engine.stop()


async def make_harness(
    tokenizer: Tokenizer,
    db_url: str,
    *,
    engine_kwargs: dict[str, Any] | None = None,
    engine_urls: list[str] | None = None,
    parser: OutputParser | None = None,
    engine_health_interval_s: float = 5.0,
    **config: Any,
) -> Harness:
    engine_kwargs = {"context_length": CONTEXT_LENGTH, **(engine_kwargs or {})}
    engine = ScriptedEngine(tokenizer, **engine_kwargs)
    url = await engine.start()
    store = await open_store(db_url, create=True)
    config.setdefault("context_length", CONTEXT_LENGTH)
    config.setdefault("ping_interval_s", 0.2)
    config.setdefault("first_byte_after_s", 0.1)
    harness = Harness(
        tokenizer=tokenizer,
        engine=engine,
        store=store,
        config=ServerConfig(**config),
        parser=parser or make_parser("qwen25", "qwen3", "builtin"),
        engine_urls=engine_urls or [url],
        engine_health_interval_s=engine_health_interval_s,
    )
    await harness.start_server()
    harness.http = aiohttp.ClientSession()
    return harness


@pytest.fixture
async def harness(tokenizer: Tokenizer, sqlite_url: str) -> AsyncIterator[Harness]:
    h = await make_harness(tokenizer, sqlite_url)
    try:
        yield h
    finally:
        await h.close()


@pytest.fixture
async def any_harness(tokenizer: Tokenizer, store_url: str) -> AsyncIterator[Harness]:
    """The harness once per store backend (SQLite, Postgres)."""
    h = await make_harness(tokenizer, store_url)
    try:
        yield h
    finally:
        await h.close()


@pytest.fixture
async def guarded(tokenizer: Any, sqlite_url: str) -> AsyncIterator[Harness]:
    """A recorder whose admin API takes the token "s3cret"."""
    h = await make_harness(tokenizer, sqlite_url, admin_token="s3cret")
    try:
        yield h
    finally:
        await h.close()
