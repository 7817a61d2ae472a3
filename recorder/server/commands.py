"""`recorder serve`: run the live middleware until SIGTERM / SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

import click

from recorder.admin_token import AdminTokenError, resolve_admin_token
from recorder.model.failover import DEFAULT_HEALTH_TIMEOUT_S
from recorder.redact import install_log_redaction, redact, register_secret
from recorder.server.context import ServerConfig

if TYPE_CHECKING:
    from replay.rules import Rules

log = logging.getLogger("recorder.server")


@click.command()
@click.option(
    "--db",
    "db_url",
    default="runs.db",
    show_default=True,
    help="Event log: SQLite path/URL or postgresql+asyncpg:// URL.",
)
@click.option(
    "--engine",
    "engines",
    multiple=True,
    required=True,
    help="SGLang server URL; repeat to spread sessions across engines.",
)
@click.option(
    "--tokenizer",
    "tokenizer_path",
    required=True,
    help="Hugging Face tokenizer directory or .gguf file of the served model.",
)
@click.option(
    "--chat-template",
    default=None,
    help="Jinja chat template file (or a bundled name, e.g. chatml-tools).",
)
@click.option(
    "--context-length",
    type=int,
    default=None,
    help="Model context length (default: asked from the engine).",
)
@click.option("--tool-parser", default=None, help="Tool-call parser name (e.g. qwen25, hermes).")
@click.option("--reasoning-parser", default=None, help="Reasoning parser name (e.g. qwen3).")
@click.option(
    "--parser-backend",
    type=click.Choice(["builtin", "http", "sglang"]),
    default=None,
    help="Who parses the output: SGLang in-process, the engine's HTTP parsers, or the "
    "built-in ones. Default: sglang when installed, else builtin (the log says which).",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8080, show_default=True)
@click.option(
    "--admin-token",
    envvar="TR_ADMIN_TOKEN",
    default=None,
    help="Bearer token for the /sessions admin API. Prefer the env var TR_ADMIN_TOKEN or "
    "--admin-token-file: a token on the command line shows in the process list.",
)
@click.option(
    "--admin-token-file",
    envvar="TR_ADMIN_TOKEN_FILE",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="File holding the admin token (mode 0600). With no token given it is created with "
    "a new one. Default: $XDG_STATE_HOME/trajectory-recorder/admin-token "
    "(~/.local/state/...). The admin API is always authenticated; the log says where the "
    "token is.",
)
@click.option(
    "--rules",
    "rules_spec",
    default=None,
    help="Replay rules for the close path: a TOML/JSON file or a preset name.",
)
@click.option("--model-name", default="", help="Model id reported by /v1/models.")
@click.option("--max-body-mb", type=float, default=64.0, show_default=True)
@click.option(
    "--ping-interval",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds between SSE pings while a turn waits.",
)
@click.option(
    "--shutdown-grace",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds in-flight turns get to finish on SIGTERM before they are aborted.",
)
@click.option(
    "--max-attempts",
    type=int,
    default=8,
    show_default=True,
    help="Engine attempts per turn (aborted attempts are resumed).",
)
@click.option(
    "--turn-budget",
    type=float,
    default=900.0,
    show_default=True,
    help="Seconds one turn may take with all its attempts; then the engine request is aborted "
    "and the client gets a 529 (a hung engine never holds a training rollout longer).",
)
@click.option(
    "--return-routed-experts/--no-return-routed-experts",
    default=None,
    help="Record MoE routing per token (routing replay). Default: on when --rules sets "
    "routed_experts.",
)
@click.option(
    "--piece-cache-mb",
    type=float,
    default=256.0,
    show_default=True,
    help="Memory for decoded array pieces the server reads back (0: no cache).",
)
@click.option(
    "--sqlite-cache-mb",
    type=float,
    default=4.0,
    show_default=True,
    help="SQLite page cache of the writer connection (each reader gets a quarter). The "
    "writer only appends: a larger cache keeps pages it wrote and grows with the log.",
)
@click.option(
    "--engine-health-interval",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds between GET /health checks of each engine (several --engine only); a "
    "session whose engine is down moves to a live one. 0: no checks.",
)
@click.option(
    "--engine-health-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_HEALTH_TIMEOUT_S,
    show_default=True,
    help="Seconds an engine's GET /health may take before the engine counts as down; a "
    "turn on a frozen engine waits about this long before it moves to a live one.",
)
@click.option(
    "--engine-body-cache-mb",
    type=click.FloatRange(min=0),
    default=64.0,
    show_default=True,
    help="Memory for each session's last /generate body (~6 bytes per context token), "
    "whose token ids' JSON its next body reuses instead of encoding them again (~0.6 ms "
    "of CPU per 100k tokens per turn). Per process: 64 MB holds ~100 sessions at 100k; "
    "past the cap, the sessions it holds keep theirs and the others encode their ids whole "
    "(a kept body unused for 2 minutes makes room); 0: none.",
)
@click.option(
    "--restore-from",
    type=click.Choice(["snapshot", "replay"]),
    default="snapshot",
    show_default=True,
    help="How a restarted server rebuilds a session: from its newest state snapshot "
    "(checked against the log) or by replaying its whole log (slower; for comparison).",
)
@click.option(
    "--close-watch-interval",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Seconds between reads of the log for sessions other replicas closed (Postgres "
    "replicas only), which this one then drops from its cache. 0: never (then a session "
    "closed elsewhere stays cached here as open until the memory bound drops it).",
)
@click.option(
    "--max-cached-mb",
    type=click.FloatRange(min=0, min_open=True),
    default=4096.0,
    show_default=True,
    help="Memory for the sessions this server holds (token chains, last bodies, translated "
    "messages); past it the least recently used idle ones leave memory and are rebuilt "
    "from the log when named again.",
)
@click.option(
    "--workers",
    type=int,
    default=1,
    show_default=True,
    help="Server processes sharing --port (SO_REUSEPORT), one CPU core each; more than 1 "
    "needs a Postgres --db (the workers are replicas on one log).",
)
@click.option(
    "--loop",
    "loop_kind",
    type=click.Choice(["auto", "asyncio", "uvloop"]),
    default="asyncio",
    show_default=True,
    help="Event loop: the standard asyncio one, uvloop (~5% less CPU per turn; needs the "
    "uvloop package, pip install trajectory-recorder[uvloop]; an 8 MB request body then "
    "peaks at slightly more memory), or auto: uvloop when it is installed.",
)
@click.option("--log-level", default="INFO", show_default=True)
def serve(
    db_url: str,
    engines: Sequence[str],
    tokenizer_path: str,
    chat_template: str | None,
    context_length: int | None,
    tool_parser: str | None,
    reasoning_parser: str | None,
    parser_backend: str | None,
    host: str,
    port: int,
    admin_token: str | None,
    admin_token_file: Path | None,
    rules_spec: str | None,
    model_name: str,
    max_body_mb: float,
    ping_interval: float,
    shutdown_grace: float,
    max_attempts: int,
    turn_budget: float,
    return_routed_experts: bool | None,
    piece_cache_mb: float,
    sqlite_cache_mb: float,
    engine_health_interval: float,
    engine_health_timeout: float,
    engine_body_cache_mb: float,
    restore_from: str,
    close_watch_interval: float,
    max_cached_mb: float,
    workers: int,
    loop_kind: str,
    log_level: str,
) -> None:
    """Record every agent turn between an Anthropic client and SGLang."""
    from recorder.server.workers import check_workers, run_workers

    who = " [%(process)d]" if workers > 1 else ""  # which worker served a turn
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s %(levelname)s %(name)s{who}: %(message)s"
    )
    refused = check_workers(workers, db_url, port)
    if refused is not None:
        raise click.ClickException(refused)
    install_log_redaction()
    try:
        loop_factory = event_loop_factory(loop_kind)
    except ImportError as exc:
        raise click.ClickException(
            f"--loop uvloop: uvloop is not installed ({exc}); pip install uvloop, or use "
            "--loop asyncio"
        ) from None
    try:
        admin_token, token_source = resolve_admin_token(admin_token, admin_token_file)
    except AdminTokenError as exc:
        raise click.ClickException(str(exc)) from None
    register_secret(admin_token)
    from recorder.model.parsers import check_parser_names, default_backend
    from recorder.model.tokenizer import TokenizerLoadError, load_tokenizer
    from replay.rules import RulesError, load_rules

    backend = parser_backend or default_backend()
    try:
        check_parser_names(tool_parser, reasoning_parser, backend)  # fail before any work
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        tokenizer = load_tokenizer(tokenizer_path, chat_template)
        rules = load_rules(rules_spec)
    except (TokenizerLoadError, RulesError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    settings = {
        "db_url": db_url,
        "engines": list(engines),
        "context_length": context_length,
        "tool_parser": tool_parser,
        "reasoning_parser": reasoning_parser,
        "parser_backend": backend,
        "parser_given": parser_backend is not None,
        "host": host,
        "port": port,
        "admin_token": admin_token,
        "token_source": token_source,
        "model_name": model_name,
        "max_body_bytes": int(max_body_mb * 1024 * 1024),
        "ping_interval": ping_interval,
        "shutdown_grace": shutdown_grace,
        "max_attempts": max_attempts,
        "turn_budget_s": turn_budget,
        "return_routed_experts": records_routing(return_routed_experts, rules),
        "piece_cache_bytes": int(piece_cache_mb * 2**20),
        "sqlite_cache_bytes": int(sqlite_cache_mb * 2**20),
        "engine_health_interval_s": engine_health_interval,
        "engine_health_timeout_s": engine_health_timeout,
        "engine_body_cache_bytes": int(engine_body_cache_mb * 2**20),
        "restore_from_snapshots": restore_from == "snapshot",
        "close_watch_interval_s": close_watch_interval,
        "max_cached_mb": max_cached_mb,
        "reuse_port": workers > 1,
    }

    def serve_one() -> int:
        try:
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                log.info("event loop: %s", type(runner.get_loop()).__module__.split(".")[0])
                runner.run(_serve(tokenizer, rules, **settings))  # type: ignore[arg-type]
        except _StartupError as exc:
            click.ClickException(redact(str(exc))).show()
            return 1
        return 0

    status = serve_one() if workers == 1 else run_workers(workers, serve_one)
    if status != 0:
        raise SystemExit(status)


def event_loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop `recorder serve` runs on (None: asyncio's default); raises ImportError
    for `uvloop` when it is not installed. `auto` takes uvloop when it imports."""
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise
        return None
    return uvloop.new_event_loop


def records_routing(flag: bool | None, rules: Rules) -> bool:
    """Ask the engine for MoE routing: as the flag says, else when the close rules replay it."""
    return rules.routed_experts is not None if flag is None else flag


class _StartupError(Exception):
    pass


async def _serve(tokenizer, rules, **s) -> None:  # type: ignore[no-untyped-def]
    from recorder.log.store import StoreError, StoreOptions, open_store
    from recorder.model.engine import EngineClient
    from recorder.model.parsers import make_parser, prefills_reasoning
    from recorder.server.app import RecorderServer, freeze_startup_heap, make_context
    from recorder.server.limits import (
        hand_back_big_allocations,
        install_accept_throttle,
        raise_open_files_limit,
    )

    hand_back_big_allocations()
    before, after = raise_open_files_limit()
    if after != before:
        log.info("open-files limit raised from %d to %d", before, after)
    install_accept_throttle(asyncio.get_running_loop())
    engine = EngineClient(
        s["engines"],
        health_interval_s=s["engine_health_interval_s"],
        health_timeout_s=s["engine_health_timeout_s"],
        body_cache_bytes=s["engine_body_cache_bytes"],
    )
    await engine.start()
    try:
        context_length = s["context_length"] or await _engine_context_length(engine)
        model_name = s["model_name"] or await _engine_model_name(engine)
        force = prefills_reasoning(tokenizer.render([{"role": "user", "content": "x"}], None, True))
        parser = make_parser(
            s["tool_parser"],
            s["reasoning_parser"],
            s["parser_backend"],
            engine_url=engine.urls[0],
            force_reasoning=force if s["reasoning_parser"] else None,
        )
        log.info(
            "output parser: %s%s",
            parser.label,
            "" if s["parser_given"] else " (default backend: sglang when installed, else builtin)",
        )
        options = StoreOptions(
            piece_cache_bytes=s["piece_cache_bytes"],
            writer_page_cache_bytes=s["sqlite_cache_bytes"],
            reader_page_cache_bytes=s["sqlite_cache_bytes"] // 4,
        )
        claim = _claim_database(s["db_url"])
        store = await open_store(s["db_url"], create=True, options=options)
    except (StoreError, ValueError, OSError, ImportError) as exc:
        await engine.close()
        raise _StartupError(str(exc)) from exc
    except BaseException:
        await engine.close()
        raise
    config = ServerConfig(
        context_length=context_length,
        model_name=model_name,
        admin_token=s["admin_token"],
        max_body_bytes=s["max_body_bytes"],
        ping_interval_s=s["ping_interval"],
        shutdown_grace_s=s["shutdown_grace"],
        max_attempts=s["max_attempts"],
        turn_budget_s=s["turn_budget_s"],
        return_routed_experts=s["return_routed_experts"],
        restore_from_snapshots=s["restore_from_snapshots"],
        sole_writer=claim is not None,
        close_watch_interval_s=s["close_watch_interval_s"],
        max_cached_mb=s["max_cached_mb"],
    )
    ctx = make_context(
        config=config, store=store, engine=engine, tokenizer=tokenizer, parser=parser, rules=rules
    )
    server = RecorderServer(ctx, s["host"], s["port"], reuse_port=s["reuse_port"])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        freeze_startup_heap()
        log.info("admin API token: %s", s["token_source"])
        log.info(
            "engines %s, context length %d, db %s",
            ", ".join(engine.urls),
            context_length,
            store.url,
        )
        await stop.wait()
        log.info("stopping: no new turns; in-flight turns get %.0fs", config.shutdown_grace_s)
    finally:
        await server.stop()
        await store.close()
        if claim is not None:
            claim.close()
        log.info("stopped; the log is flushed")


def _claim_database(db_url: str) -> IO[bytes] | None:
    """SQLite: this server's claim on the file (one server per file); Postgres: None."""
    import sqlalchemy as sa

    from recorder.log.store import normalize_url

    url = normalize_url(db_url)
    if sa.make_url(url).get_backend_name() != "sqlite":
        return None  # replicas share Postgres under per-session locks
    from recorder.log.store.sqlite import claim_sole_server

    return claim_sole_server(url)


async def _engine_context_length(engine: object) -> int:
    from recorder.model.engine import EngineClient

    assert isinstance(engine, EngineClient)
    lengths = [await engine.context_length(url) for url in engine.urls]
    known = [n for n in lengths if n]
    if not known:
        raise _StartupError(
            "could not read the context length from the engine (/v1/models, /model_info); "
            "pass --context-length N"
        )
    return min(known)


async def _engine_model_name(engine: object) -> str:
    from recorder.model.engine import EngineClient
    from recorder.model.engine_wire import EngineError

    assert isinstance(engine, EngineClient)
    with contextlib.suppress(EngineError):
        info = await engine.model_info(engine.urls[0])
        path = info.get("model_path")
        if isinstance(path, str) and path:
            return path
    return ""
