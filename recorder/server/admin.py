"""The trainer's session API: open, inspect, close (with reward) and collect samples.

A rollout opens a session, hands its id to the agent as the API key, and
closes it when the episode is over; the close answer carries the training
samples, built by the same reducer `replay reclassify` runs offline.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any

import msgspec
from aiohttp import web

from recorder.dialects.errors import ApiError
from recorder.dialects.json_limits import json_problem
from recorder.log.events import RewardAssigned, SandboxEvent, SessionClosed, SessionOpened
from recorder.log.store.base import ConcurrencyConflict
from recorder.server.auth import require_admin
from recorder.server.bodies import read_body
from recorder.server.context import CTX, ServerContext
from recorder.server.journal import Journal, finish_even_if_cancelled
from recorder.server.overrides import InvalidOverride, SessionOverrides, overrides_from_config
from recorder.server.sessions import SESSION_ID_RE, SessionState, forget_tokens

log = logging.getLogger("recorder.server")

CLOSE_STATUSES = ("completed", "failed", "aborted", "truncated")
_OPEN_KEYS = ("session_id", "metadata", "config", "reopen")


def routes() -> list[web.RouteDef]:
    return [
        web.post("/sessions", open_session),
        web.get("/sessions/{session_id}", inspect_session),
        web.post("/sessions/{session_id}/events", append_events),
        web.post("/sessions/{session_id}/close", close_session),
        web.get("/sessions/{session_id}/samples", session_samples),
    ]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=msgspec.json.encode(data), content_type="application/json"
    )


async def _json_object(request: web.Request) -> dict[str, Any]:
    body = await read_body(request)
    if not body.strip():
        return {}
    _check_limits(body)
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise ApiError("invalid_request_error", f"body: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError("invalid_request_error", "body: expected a JSON object")
    return data


def _check_limits(body: bytes) -> None:
    problem = json_problem(body)
    if problem is not None:
        raise ApiError("invalid_request_error", f"body: {problem}")


def _field(data: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = data.get(name, default)
    if value is default:
        return value
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        expected = (
            kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        )
        raise ApiError("invalid_request_error", f"{name}: expected {expected}")
    return value


# --------------------------------------------------------------------------
# Open
# --------------------------------------------------------------------------


async def open_session(request: web.Request) -> web.Response:
    """POST /sessions: `{session_id?, metadata?, config?, reopen?, <any trainer field>...}`.

    Fields other than those four are trainer metadata too (instance_id,
    sample_index, group_index, ...). A taken id answers 409 unless `reopen`
    is true, which starts a clean new attempt of that session (the reducer
    only looks at the latest one).
    """
    ctx = request.app[CTX]
    require_admin(request, ctx.config.admin_token)
    data = await _json_object(request)
    session_id = _field(data, "session_id", str, None)
    metadata = dict(_field(data, "metadata", dict, {}))
    metadata.update({k: v for k, v in data.items() if k not in _OPEN_KEYS})
    config = _field(data, "config", dict, {})
    try:
        overrides = overrides_from_config(config)
    except InvalidOverride as exc:
        raise ApiError("invalid_request_error", str(exc)) from None
    reopen = _field(data, "reopen", bool, False)
    if session_id is None:
        session_id = "sess_" + uuid.uuid4().hex
    elif session_id == ctx.config.admin_token:  # the agent's key must never open the admin API
        raise ApiError("invalid_request_error", "session_id: choose an id that is not a secret")
    elif not SESSION_ID_RE.match(session_id):
        raise ApiError(
            "invalid_request_error",
            "session_id: 1-200 characters of letters, digits and ._:@+=- "
            "(it travels as an HTTP bearer token), starting with a letter or digit",
        )
    state = await _open(ctx, session_id, metadata, config, overrides, reopen=reopen)
    log.info(
        "session %s opened (attempt %d, engine %s)", session_id, state.attempt, state.engine_url
    )
    return _json(_describe(state), status=201)


async def _open(
    ctx: ServerContext,
    session_id: str,
    metadata: dict[str, Any],
    config: dict[str, Any],
    overrides: SessionOverrides,
    *,
    reopen: bool,
) -> SessionState:
    async def reopen_(existing: SessionState) -> SessionState:
        if not reopen:
            raise ApiError(
                "invalid_request_error",
                f"session {session_id!r} already exists; choose another id, or pass "
                '"reopen": true to start a new attempt of it',
                status=409,
            )
        state = _fresh_state(
            ctx, session_id, existing.journal, metadata, overrides, attempt=existing.attempt + 1
        )
        state.next_turn = existing.next_turn
        state.lock = existing.lock

        async def write() -> None:
            await state.journal.write(_opened_event(ctx, state, config))
            ctx.registry.put(state)

        await finish_even_if_cancelled(write())
        return state

    reopened = await ctx.registry.locked(session_id, reopen_)
    if reopened is not None:
        return reopened
    try:
        return await _open_new(ctx, session_id, metadata, config, overrides)
    except ConcurrencyConflict:
        if not reopen:
            raise ApiError(
                "invalid_request_error",
                f"session {session_id!r} was opened concurrently by another request",
                status=409,
            ) from None
    # Another request (or replica) opened it first: a new attempt, as if this one came second.
    reopened = await ctx.registry.locked(session_id, reopen_)
    if reopened is None:
        raise AssertionError(f"session {session_id!r} lost its opening event")
    return reopened


async def _open_new(
    ctx: ServerContext,
    session_id: str,
    metadata: dict[str, Any],
    config: dict[str, Any],
    overrides: SessionOverrides,
) -> SessionState:
    journal = Journal(ctx.store, session_id, next_seq=0)
    state = _fresh_state(ctx, session_id, journal, metadata, overrides, attempt=0)

    async def open_() -> None:
        await journal.write(_opened_event(ctx, state, config))
        if ctx.registry.cached(session_id) is None:
            ctx.registry.put(state)

    await finish_even_if_cancelled(open_())  # ConcurrencyConflict: opened meanwhile
    return state


def _fresh_state(
    ctx: ServerContext,
    session_id: str,
    journal: Journal,
    metadata: dict[str, Any],
    overrides: SessionOverrides,
    *,
    attempt: int,
) -> SessionState:
    from recorder.model.tokens import SessionChains

    return SessionState(
        session_id=session_id,
        journal=journal,
        metadata=metadata,
        engine_url=ctx.engine.pick(session_id),
        attempt=attempt,
        opened_ts=time.time(),
        chains=SessionChains(),
        overrides=overrides,
    )


def _opened_event(ctx: ServerContext, state: SessionState, config: dict[str, Any]) -> SessionOpened:
    return SessionOpened(
        session_id=state.session_id,
        metadata=state.metadata,
        config={**config, "live_rules_version": _live_rules_version()},
        tokenizer=ctx.tokenizer.identity,
        context_length=ctx.config.context_length,
        engine_url=state.engine_url,
        attempt=state.attempt,
    )


def _live_rules_version() -> str:
    from recorder.server.context import LIVE_RULES_VERSION

    return LIVE_RULES_VERSION


# --------------------------------------------------------------------------
# Inspect
# --------------------------------------------------------------------------


async def _known(ctx: ServerContext, session_id: str) -> SessionState:
    state = await ctx.registry.get(session_id)
    if state is None:
        raise ApiError("not_found_error", f"no session {session_id!r} in this log")
    return state


def _describe(state: SessionState) -> dict[str, Any]:
    return {
        "session_id": state.session_id,
        "status": state.status,
        "close_status": state.close_status or None,
        "attempt": state.attempt,
        "metadata": state.metadata,
        "engine_url": state.engine_url,
        "turns": state.next_turn,
        "turns_completed": state.turns_completed,
        "events": state.next_seq,
        "chains": len(state.chain_refs),
        "busy": state.lock.locked(),
        "opened_at": state.opened_ts,
    }


async def inspect_session(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    require_admin(request, ctx.config.admin_token)
    state = await _known(ctx, request.match_info["session_id"])
    return _json(_describe(state))


# --------------------------------------------------------------------------
# The rollout's own events
# --------------------------------------------------------------------------


class RolloutEventIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_.]{0,63}$")]
    detail: dict[str, Any] = {}


class RolloutEventsIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    events: Annotated[list[RolloutEventIn], msgspec.Meta(min_length=1, max_length=1000)]


async def append_events(request: web.Request) -> web.Response:
    """POST /sessions/{id}/events: `{"events": [{"kind", "detail"}...]}` -> SandboxEvents.

    The rollout driver's facts (sandbox created, command run, agent started and
    finished, diff taken, eval result, killed, failed) join the session's log,
    so `replay show` tells the whole rollout. Appended under the session lock
    (201); an open session only. They never wait for a turn in flight: then
    they are kept (202, `"deferred"`) and written when that turn ends, or
    first thing by the next events or close request, whichever comes first.
    """
    ctx = request.app[CTX]
    require_admin(request, ctx.config.admin_token)
    session_id = request.match_info["session_id"]
    raw = await read_body(request)
    _check_limits(raw)
    try:
        body = msgspec.json.decode(raw, type=RolloutEventsIn)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        message = str(exc).replace("- at `$.", "- at `").replace("- at `$`", "- at `body`")
        raise ApiError("invalid_request_error", f"body: {message}") from None
    events: list[Any] = [SandboxEvent(kind=e.kind, detail=e.detail) for e in body.events]
    state = await _known(ctx, session_id)
    if state.status == "closed":
        raise _closed_for_events(session_id)
    if state.lock.locked():
        waiting = ctx.registry.defer_events(session_id, events)
        return _json({"appended": 0, "deferred": waiting, "events": state.next_seq}, status=202)

    async def append(state: SessionState) -> int:
        if state.status == "closed":
            raise _closed_for_events(session_id)
        batch = [*ctx.registry.take_deferred(session_id), *events]
        try:
            await finish_even_if_cancelled(state.journal.write(*batch))
        except BaseException:
            ctx.registry.defer_events(session_id, batch[: len(batch) - len(events)])
            raise
        return state.next_seq

    next_seq = await ctx.registry.locked(session_id, append)
    if next_seq is None:
        raise ApiError("not_found_error", f"no session {session_id!r} in this log")
    return _json({"appended": len(events), "events": next_seq}, status=201)


def _closed_for_events(session_id: str) -> ApiError:
    return ApiError(
        "invalid_request_error",
        f"session {session_id!r} is closed; events go to an open session",
        status=409,
    )


# --------------------------------------------------------------------------
# Close
# --------------------------------------------------------------------------


async def close_session(request: web.Request) -> web.Response:
    """POST /sessions/{id}/close: `{reward?, reward_detail?, status?, reason?}` -> samples.

    With status `aborted`, an in-flight turn of the session is stopped at once
    (its engine request aborted, the turn recorded failed) and the close goes
    ahead. Any other status waits for that turn to finish (the session lock;
    at most the turn's own budget, `turn_budget_s`), so its answer is part of
    the samples. Records the rollout events still waiting, the reward and the
    close durably, then reduces the session's log.
    """
    ctx = request.app[CTX]
    require_admin(request, ctx.config.admin_token)
    session_id = request.match_info["session_id"]
    data = await _json_object(request)
    reward = _field(data, "reward", (int, float), None)
    detail = _field(data, "reward_detail", dict, {})
    status = _field(data, "status", str, "completed")
    reason = _field(data, "reason", str, "")
    if status not in CLOSE_STATUSES:
        raise ApiError("invalid_request_error", f"status: one of {', '.join(CLOSE_STATUSES)}")
    events: list[Any] = []
    if reward is not None:
        events.append(RewardAssigned(reward=float(reward), detail=detail))
    events.append(SessionClosed(status=status, reason=reason))  # type: ignore[arg-type]
    if status == "aborted" and ctx.registry.stop_turn(
        session_id, f"the session was closed aborted while this turn ran: {reason[:200]}"
    ):
        log.info("session %s: closing aborted stops its in-flight turn", session_id)

    async def close(state: SessionState) -> bool:
        if state.status == "closed":
            raise ApiError(
                "invalid_request_error",
                f"session {session_id!r} is already closed; its samples are at "
                f"GET /sessions/{session_id}/samples",
                status=409,
            )
        deferred = ctx.registry.take_deferred(session_id)

        async def write() -> None:
            try:
                await state.journal.write(*deferred, *events)
            except BaseException:
                ctx.registry.defer_events(session_id, deferred)
                raise
            state.status = "closed"
            state.close_status = status
            forget_tokens(state)
            ctx.engine.bodies.forget(session_id)  # its last /generate body, kept for a next turn
            ctx.registry.put(state)  # bounded: the oldest closed sessions leave memory

        await finish_even_if_cancelled(write())
        return True

    if await ctx.registry.locked(session_id, close) is None:
        raise ApiError("not_found_error", f"no session {session_id!r} in this log")
    return await _samples_response(ctx, session_id)


async def session_samples(request: web.Request) -> web.Response:
    """GET /sessions/{id}/samples: the session's samples under this server's rules."""
    ctx = request.app[CTX]
    require_admin(request, ctx.config.admin_token)
    session_id = request.match_info["session_id"]
    await _known(ctx, session_id)
    return await _samples_response(ctx, session_id)


async def _samples_response(ctx: ServerContext, session_id: str) -> web.Response:
    from replay import close_session_samples

    started = time.perf_counter()
    result = await close_session_samples(ctx.store, session_id, ctx.rules)
    log.info(
        "session %s reduced: %d samples, status %s, %.0f ms",
        session_id,
        len(result.samples),
        result.status,
        (time.perf_counter() - started) * 1000,
    )
    return _json(result)
