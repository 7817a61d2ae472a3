"""The agent-facing endpoints: messages, chat/completions, responses, count_tokens, models, health.

The three chat endpoints differ only in their dialect (recorder/dialects):
the session lookup, the rejection rules and the turn are one code path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
from aiohttp import web

from recorder.dialects import ANTHROPIC, OPENAI_CHAT, OPENAI_RESPONSES, Dialect
from recorder.dialects.answer import new_message_id
from recorder.dialects.chat import ChatRequest, InvalidRequest
from recorder.dialects.errors import ApiError
from recorder.dialects.translate import parse_request
from recorder.log.store.base import ConcurrencyConflict, StorageUnavailable
from recorder.model.admission import check_fits
from recorder.server.auth import session_id_of
from recorder.server.bodies import read_body
from recorder.server.context import CTX, ServerContext
from recorder.server.counting import next_input_tokens
from recorder.server.errors import contended_error, known_failure, storage_error
from recorder.server.history import log_history
from recorder.server.responders import JsonResponder, Responder, SseResponder, error_response
from recorder.server.sessions import SessionContended, SessionState
from recorder.server.turn import reject, run_turn

log = logging.getLogger("recorder.server")

_STARTED = int(time.time())


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/messages", messages),
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/responses", responses),
        web.post("/v1/messages/count_tokens", count_tokens),
        web.get("/v1/models", list_models),
        web.get("/v1/models/{model_id}", get_model),
        web.get("/health", health),
        web.get("/", root),  # aiohttp answers HEAD / from the GET route
    ]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=msgspec.json.encode(data), content_type="application/json"
    )


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages (`?beta=true` too: only the path is matched)."""
    return await _chat(request, ANTHROPIC)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions (OpenAI Chat Completions)."""
    return await _in_dialect(request, OPENAI_CHAT)


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses (OpenAI Responses)."""
    return await _in_dialect(request, OPENAI_RESPONSES)


async def _in_dialect(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    """Errors raised before a responder exists, in the dialect's shape (not the middleware's):
    the server's own, and a storage outage met while the session is found or reloaded."""
    try:
        return await _chat(request, dialect)
    except Exception as exc:
        known = known_failure(request.app[CTX].store, exc)
        if known is None:
            raise  # a bug: the middleware answers 500
        return error_response(known, dialect)


async def _chat(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    ctx = request.app[CTX]
    if ctx.stopping:
        raise ApiError("overloaded_error", "the recorder is shutting down; retry shortly")
    session_id = session_id_of(request)
    body = await read_body(request)
    state = await ctx.registry.get(session_id)
    if state is None:
        raise ApiError("authentication_error", _unknown_session(session_id))
    # Closed or not is decided under the lock, at the log's head (another
    # replica may have closed or reopened the session since it was cached).
    chat: ChatRequest | None = None
    invalid: InvalidRequest | None = None
    history = log_history(
        ctx.store, lambda: ctx.store.read_session(session_id), state.response_conversations
    )
    try:
        chat, dialect = await dialect.parse(body, cache=state.parse_cache, history=history)
    except InvalidRequest as exc:
        invalid = exc
    message_id = new_message_id()
    model = (chat.model if chat is not None else "") or ctx.config.model_name
    responder = _responder(
        ctx,
        request,
        streaming=chat is not None and chat.stream,
        message_id=message_id,
        model=model,
        dialect=dialect,
    )
    task = asyncio.current_task()
    assert task is not None
    ctx.inflight.add(task)
    try:
        return await _serve(
            ctx, session_id, chat, invalid, body, request.path, responder, message_id
        )
    finally:
        ctx.inflight.discard(task)
        await responder.close()


async def _serve(
    ctx: ServerContext,
    session_id: str,
    chat: ChatRequest | None,
    invalid: InvalidRequest | None,
    body: bytes,
    path: str,
    responder: Responder,
    message_id: str,
) -> web.StreamResponse:
    async def serve(state: SessionState) -> web.StreamResponse:
        return await _serve_locked(ctx, state, chat, invalid, body, path, responder, message_id)

    try:
        answered = await ctx.registry.locked(session_id, serve)
    except SessionContended as exc:
        log.warning("session %s: %s", session_id, exc)
        return await responder.fail(contended_error())
    except StorageUnavailable as exc:
        # Loading the session under its lock failed: answered by the responder,
        # so a stream already open ends with an error event in its dialect.
        log.warning("session %s: %s", session_id, exc, exc_info=exc.__cause__)
        return await responder.fail(storage_error(exc))
    if answered is None:
        return await responder.fail(ApiError("authentication_error", _unknown_session(session_id)))
    return answered


async def _serve_locked(
    ctx: ServerContext,
    state: SessionState,
    chat: ChatRequest | None,
    invalid: InvalidRequest | None,
    body: bytes,
    path: str,
    responder: Responder,
    message_id: str,
) -> web.StreamResponse:
    """One request under the session's locks, decided at the log's head (run again if
    another process claimed that head first: `ConcurrencyConflict` passes through)."""
    session_id = state.session_id
    if state.status == "closed":
        return await responder.fail(
            ApiError("invalid_request_error", _closed_session(session_id), status=409)
        )
    cap = state.overrides.max_turns
    if cap is not None and state.next_turn >= cap and invalid is None:
        return await reject(
            state,
            message_id,
            responder,
            "invalid_request_error",
            f"turn budget spent: this session allows {cap} turns (config.max_turns)",
        )
    if invalid is not None or chat is None:
        try:
            return await reject(state, message_id, responder, "invalid_request_error", str(invalid))
        except ConcurrencyConflict:
            raise  # nothing recorded: decided again at the new head
        except StorageUnavailable as exc:
            state.suspect = True
            return await responder.fail(storage_error(exc))
        except Exception:
            log.exception("session %s: could not record a rejected request", session_id)
            state.suspect = True
            return await responder.fail(
                ApiError("api_error", "the recorder could not record this request")
            )
    return await run_turn(ctx, state, chat, body, path, responder, message_id)


def _responder(
    ctx: ServerContext,
    request: web.Request,
    *,
    streaming: bool,
    message_id: str,
    model: str,
    dialect: Dialect,
) -> Responder:
    if not streaming:
        return JsonResponder(dialect=dialect)
    responder = SseResponder(
        request,
        message_id=message_id,
        model=model,
        dialect=dialect,
        ping_interval=ctx.config.ping_interval_s,
        first_byte_after=ctx.config.first_byte_after_s,
        write_timeout=ctx.config.sse_write_timeout_s,
    )
    responder.keep_alive()
    return responder


def _unknown_session(session_id: str) -> str:
    shown = session_id if len(session_id) <= 64 else session_id[:64] + "..."
    return (
        f"unknown session {shown!r}: the API key / bearer token must be the id of a session "
        "opened with POST /sessions on this recorder"
    )


def _closed_session(session_id: str) -> str:
    return f"session {session_id!r} is closed; open a new session (or reopen this one)"


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the next turn's engine input length (counting.py)."""
    ctx = request.app[CTX]
    session_id = session_id_of(request)
    body = await read_body(request)
    state = await ctx.registry.get(session_id)
    if state is None:
        raise ApiError("authentication_error", _unknown_session(session_id))
    try:
        chat = parse_request(body, count_tokens=True)
        check_fits(chat, ctx.tokenizer, ctx.config.context_length)
        n = await next_input_tokens(state.chains, chat, ctx.tokenizer, len(body))
    except (InvalidRequest, ValueError) as exc:
        raise ApiError("invalid_request_error", str(exc)) from None
    return _json({"input_tokens": n})


def _model_entry(ctx: ServerContext, model_id: str | None = None) -> dict[str, Any]:
    name = model_id or ctx.config.model_name or "recorder"
    return {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_STARTED)),
        "max_input_tokens": ctx.config.context_length,
        # OpenAI's model object, so either SDK's `models.list()` reads the same entry.
        "object": "model",
        "created": _STARTED,
        "owned_by": "trajectory-recorder",
    }


async def list_models(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    entry = _model_entry(ctx)
    return _json(
        {
            "object": "list",
            "data": [entry],
            "has_more": False,
            "first_id": entry["id"],
            "last_id": entry["id"],
        }
    )


async def get_model(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    return _json(_model_entry(ctx, request.match_info["model_id"]))


async def health(request: web.Request) -> web.Response:
    """200 while the recorder can serve; 503 when stopping or while its log cannot be written.

    `storage` is the reason the last write failed, until a write succeeds.
    """
    ctx = request.app[CTX]
    failure = ctx.store.write_failure
    status = "stopping" if ctx.stopping else "storage_failing" if failure else "ok"
    return _json(
        {
            "status": status,
            "storage": failure or "ok",
            "sessions_cached": len(ctx.registry),
            "sessions_open": ctx.registry.open_count(),
            "sessions_closed_elsewhere": ctx.registry.closed_elsewhere,
            "sessions_held_mb": round(ctx.registry.held_total / (1 << 20), 1),
            "sessions_shed": ctx.registry.shed,
            "sessions_max_mb": ctx.config.max_cached_mb,
            "close_watch_s": ctx.config.close_watch_interval_s if ctx.config.watches_closes else 0,
            "turns_in_flight": len(ctx.inflight),
            "catch_ups": ctx.registry.catch_ups,
            "catch_up_s": round(ctx.registry.catch_up_s, 6),
            "conflicts_retried": ctx.registry.conflicts_retried,
            "sessions_loaded": ctx.registry.loads,
            "session_load_s": round(ctx.registry.load_s, 6),
            "engines": list(ctx.engine.urls),
            "engines_down": sorted(ctx.engine.down),
            "context_length": ctx.config.context_length,
        },
        status=200 if status == "ok" else 503,
    )


async def root(request: web.Request) -> web.Response:
    if request.method == "HEAD":
        return web.Response(status=200)
    return _json(
        {
            "service": "trajectory-recorder",
            "api": "anthropic-messages",
            "dialects": ["anthropic", "openai-chat", "openai-responses"],
        }
    )
