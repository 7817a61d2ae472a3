"""Everything a request handler needs, built once per server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from recorder.admin_token import new_admin_token
from recorder.server.sessions import SessionRegistry

if TYPE_CHECKING:
    from recorder.log.store.base import EventStore
    from recorder.model.engine import EngineClient
    from recorder.model.parsers import OutputParser
    from recorder.model.tokenizer import Tokenizer
    from replay.rules import Rules

# Decisions the live server records (chain choice, clamp, TITO verdict) carry
# this tag; bump it when the live decision logic changes meaning.
LIVE_RULES_VERSION = "live-1"


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    context_length: int
    model_name: str = ""
    # Always set: the admin API is never open (see admin_token.py).
    admin_token: str = field(default_factory=new_admin_token)
    max_body_bytes: int = 64 * 1024 * 1024
    ping_interval_s: float = 5.0
    first_byte_after_s: float = 1.0
    # An SSE client that takes no data for this long is dropped (see sse.py).
    sse_write_timeout_s: float = 60.0
    shutdown_grace_s: float = 30.0
    max_attempts: int = 8
    # A training run wants a hung engine noticed in minutes, not an hour: 15 min
    # covers a 32k-token answer at 36 tokens/s, slower than any healthy engine.
    turn_budget_s: float = 900.0
    # A connection idle this long (no request head completed since it opened or
    # since its last answer; a half-sent header counts as idle) is closed, so
    # stalled clients cannot pile up and exhaust file descriptors.
    idle_timeout_s: float = 30.0
    return_routed_experts: bool = False
    # Applied when a request leaves a sampling field unset.
    default_temperature: float = 1.0
    # False: a restart replays each session's whole log, ignoring its state
    # snapshots (the reference path; benchmarks compare both).
    restore_from_snapshots: bool = True
    # True when no other process appends to this log (`serve` holds the SQLite
    # file's claim): a state this server holds is then at the log's head, and a
    # turn skips the head check, one read query. A lost claim (ConcurrencyConflict)
    # still catches up before it plans again.
    sole_writer: bool = False
    # How often a replica (not the sole writer) reads the log for sessions other
    # processes closed, to drop them from its cache (closes.py); 0: never.
    close_watch_interval_s: float = 1.0
    # Memory of the cached sessions (previous bodies, translated messages, token
    # chains) past which the least recently used idle ones leave memory; a request
    # naming one again rebuilds it from the log, as after a restart.
    max_cached_mb: float = 4096.0

    @property
    def watches_closes(self) -> bool:
        """Whether this server reads the log for closes made elsewhere (closes.py): only
        a replica among others does; a sole writer sees every close itself."""
        return not self.sole_writer and self.close_watch_interval_s > 0


@dataclass(kw_only=True)
class ServerContext:
    """The shared objects; build it with `app.make_context`, which wires the registry
    to restore.py (kept out of this module, which restore.py itself reads)."""

    config: ServerConfig
    store: EventStore
    engine: EngineClient
    tokenizer: Tokenizer
    parser: OutputParser
    rules: Rules
    registry: SessionRegistry = field(init=False)
    # Handler tasks running a turn; shutdown waits for them, then cancels.
    inflight: set[asyncio.Task[Any]] = field(default_factory=set)
    stopping: bool = False
    # Held while a plan renders more than ~1 MB of text (see turn._plan).
    large_plans: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))


CTX: web.AppKey[ServerContext] = web.AppKey("recorder_ctx", ServerContext)
