"""The server's errors: every failure a handler lets escape becomes an answer.

The shapes (`ApiError`, the error body) are wire format: `recorder.dialects.errors`.
Here: the errors of the server's own failures (storage, a lost session lock),
the response with its `x-should-retry` header, and the middleware that turns
anything escaping a handler into an answer instead of an HTML page.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from recorder.dialects import ANTHROPIC, OPENAI_CHAT, OPENAI_RESPONSES, Dialect
from recorder.dialects.errors import ApiError, error_payload, error_type_for_status
from recorder.log.store.base import EventStore, StorageUnavailable
from recorder.server.context import CTX
from recorder.server.journal import SessionMovedOn
from recorder.server.sessions import SessionContended

log = logging.getLogger("recorder.server")


def storage_error(exc: StorageUnavailable) -> ApiError:
    """529 with the plain reason: the client retries, as for an overloaded API."""
    return ApiError("overloaded_error", f"{exc}; nothing of this request was kept, retry shortly")


def outage_of(store: EventStore | None, exc: BaseException) -> StorageUnavailable | None:
    """`exc` as the storage outage it means, or None (a bug, a conflict, a cancel).

    The one seam every path shares: a write already raises `StorageUnavailable`
    (the store's own seam), while a read, a lock or a session's reload lets the
    driver's error escape; both become the same 529 and `/health` names them.
    """
    if isinstance(exc, StorageUnavailable):
        return exc
    if isinstance(exc, Exception) and store is not None:
        return store.as_unavailable(exc)
    return None


def known_failure(store: EventStore | None, exc: BaseException) -> ApiError | None:
    """The answer to a failure the server expects (its own error, an outage, a lost
    session lock); None for anything else, a bug answered 500 by the middleware."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, SessionContended):
        log.warning("%s", exc)
        return contended_error()
    outage = outage_of(store, exc)
    if outage is not None:
        log.warning("%s", outage, exc_info=exc if outage is not exc else outage.__cause__)
        return storage_error(outage)
    return None


def contended_error() -> ApiError:
    """529: another replica kept writing the session (a lost lock); nothing was kept."""
    return ApiError(
        "overloaded_error",
        "another recorder process kept writing this session at the same time (its session "
        "lock was lost); nothing of this request was kept, retry shortly",
    )


def moved_on_error(exc: SessionMovedOn) -> ApiError:
    """529: the turn's answer could not be recorded; the log holds it as unanswered."""
    return ApiError(
        "overloaded_error", f"{exc}; this turn was recorded as unanswered, retry shortly"
    )


def error_response(err: ApiError, payload: dict[str, Any] | None = None) -> web.Response:
    """Every error the server answers: `payload` in the dialect's shape (default Anthropic's),
    its status, and `x-should-retry: false` when a retry cannot fix it."""
    response = web.Response(
        status=err.status,
        body=msgspec.json.encode(payload or error_payload(err.error_type, err.message)),
        content_type="application/json",
    )
    if not retry_can_fix(err.status):
        # Claude Code (the Anthropic SDK) otherwise retries a 401 or 409 for
        # minutes; with this it stops at once and shows the message.
        response.headers["x-should-retry"] = "false"
    return response


def dialect_of_path(path: str) -> Dialect:
    """The dialect a client on `path` reads errors in: an OpenAI SDK cannot read Anthropic's
    `{"type": "error"}` (it shows no message, no type), so its routes answer in OpenAI's shape."""
    if path.startswith("/v1/chat/completions"):
        return OPENAI_CHAT
    if path.startswith("/v1/responses"):
        return OPENAI_RESPONSES
    return ANTHROPIC


def error_for_path(path: str, err: ApiError) -> web.Response:
    """`error_response` in the shape of the dialect `path` speaks."""
    return error_response(err, dialect_of_path(path).error(err))


def retry_can_fix(status: int) -> bool:
    """A timeout, a rate limit or a server-side failure may pass; a client's mistake will not."""
    return status >= 500 or status in (408, 429)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def api_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every error escaping a handler into the error shape of the path's dialect.

    aiohttp's own HTTP errors (unknown route, wrong method, body too large)
    keep their status; anything unexpected becomes a logged 500 `api_error`
    so a bug never surfaces as an HTML page or a dropped connection.
    """
    try:
        return await handler(request)
    except Exception as exc:
        err = _api_error(request, exc)
        if err is None:
            raise
        return error_for_path(request.path, err)


def _api_error(request: web.Request, exc: Exception) -> ApiError | None:
    """The answer to `exc`; None for a non-error HTTP exception (a redirect), raised as is."""
    ctx = request.app.get(CTX)
    known = known_failure(ctx.store if ctx is not None else None, exc)
    if known is not None:  # our own error, an outage (a write, a read, a reload), a lost lock
        return known
    if isinstance(exc, RequestPayloadError):
        # A body aiohttp could not read: the usual case is a Content-Encoding
        # the bytes do not match. The connection is closed after this answer.
        encoding = request.headers.get("Content-Encoding", "")
        detail = f"it is not valid {encoding}" if encoding else str(exc.__cause__ or exc)
        return ApiError("invalid_request_error", f"the request body could not be read: {detail}")
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            return None
        message = _http_exception_message(request, exc)
        return ApiError(error_type_for_status(exc.status), message, status=exc.status)  # type: ignore[arg-type]
    log.exception("unhandled error on %s %s", request.method, request.path)
    return ApiError("api_error", f"internal error ({type(exc).__name__}); see the server log")


def _http_exception_message(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == 404:
        return f"no route for {request.method} {request.path}"
    if exc.status == 405:
        return f"method {request.method} not allowed on {request.path}"
    if exc.status == 413:
        return too_large_message(exc.text or "over the limit")
    return exc.text or exc.reason


def too_large_message(detail: str) -> str:
    return (
        f"request body too large ({detail}); "
        "raise `recorder serve --max-body-mb` if this is legitimate"
    )
