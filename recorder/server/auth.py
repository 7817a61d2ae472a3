"""Who is calling: the session id an agent sends, or the trainer's admin token."""

from __future__ import annotations

import hmac

from aiohttp import web

from recorder.dialects.errors import ApiError


def bearer_or_api_key(request: web.Request) -> str | None:
    """`Authorization: Bearer <token>` (ANTHROPIC_AUTH_TOKEN) or `x-api-key` (ANTHROPIC_API_KEY)."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    key = request.headers.get("x-api-key", "").strip()
    return key or None


def session_id_of(request: web.Request) -> str:
    token = bearer_or_api_key(request)
    if token is None:
        raise ApiError(
            "authentication_error",
            "no session id: send it as `Authorization: Bearer <session id>` or `x-api-key` "
            "(open a session with POST /sessions first)",
        )
    return token


def require_admin(request: web.Request, admin_token: str) -> None:
    """Admin endpoints need the admin token (there is always one) and JSON bodies.

    The JSON rule shuts the browser door: a page may POST `text/plain` to loopback
    without a CORS preflight, but never `application/json`.
    """
    token = bearer_or_api_key(request)
    given = (token or "").encode("utf-8", "surrogateescape")
    if token is None or not hmac.compare_digest(given, admin_token.encode()):
        raise ApiError(
            "authentication_error",
            "admin endpoints need `Authorization: Bearer <admin token>` (the server's "
            "TR_ADMIN_TOKEN, --admin-token-file, or the file its startup log names); "
            "a session id is never an admin token",
        )
    has_body = request.can_read_body or "Content-Type" in request.headers
    if has_body and not is_json_type(request.content_type):
        raise ApiError(
            "invalid_request_error",
            f"admin request bodies must be `Content-Type: application/json` "
            f"(got {request.content_type!r})",
            status=415,
        )


def is_json_type(content_type: str) -> bool:
    """application/json or any application/*+json."""
    kind = content_type.lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )
