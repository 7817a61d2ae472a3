"""Who is calling: the session id an agent sends, or the trainer's admin token."""

from __future__ import annotations

import hmac

from aiohttp import web

from recorder.server.errors import ApiError


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


def require_admin(request: web.Request, admin_token: str | None) -> None:
    """Admin endpoints need the admin token when one is configured."""
    if admin_token is None:
        return
    token = bearer_or_api_key(request)
    # surrogateescape: a header byte that is not UTF-8 is a wrong token, not an error.
    given = None if token is None else token.encode("utf-8", "surrogateescape")
    if given is None or not hmac.compare_digest(given, admin_token.encode()):
        raise ApiError(
            "authentication_error",
            "admin endpoints need `Authorization: Bearer <admin token>` "
            "(the --admin-token / TR_ADMIN_TOKEN of this server)",
        )
