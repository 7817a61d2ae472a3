"""Errors in the Anthropic Messages API shape: the error types, their statuses, the body.

Every failure a client sees is `{"type": "error", "error": {"type", "message"}}`
with the status Anthropic uses for that type, so SDK retry logic (408/409/429/
5xx are retried) behaves the same against the recorder as against the real API.
Each dialect renders an `ApiError` in its own wire shape (`Dialect.error`);
the server answers with it (`recorder.server.errors`).
"""

from __future__ import annotations

from typing import Any, Literal

from recorder.redact import redact

ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
]

DEFAULT_STATUS: dict[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "overloaded_error": 529,
}

_STATUS_TO_TYPE: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


class ApiError(Exception):
    """An error to answer with; `status` defaults to the type's usual status.

    Anthropic has no type of its own for 409: conflicts (closed session,
    duplicate session id) are `invalid_request_error` with status 409.
    """

    def __init__(self, error_type: ErrorType, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.error_type: str = error_type
        self.message = message
        self.status = status if status is not None else DEFAULT_STATUS[error_type]


def error_payload(error_type: str, message: str) -> dict[str, Any]:
    """The error body; its message is redacted (no password or token reaches a client)."""
    message = redact(message)
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_type_for_status(status: int) -> str:
    if status in _STATUS_TO_TYPE:
        return _STATUS_TO_TYPE[status]
    return "invalid_request_error" if status < 500 else "api_error"
