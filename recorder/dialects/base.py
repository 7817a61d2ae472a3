"""The contract every dialect meets, and what the OpenAI ones share."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from recorder.dialects.answer import Answer
from recorder.dialects.anthropic_wire import Message
from recorder.dialects.chat import ChatRequest
from recorder.dialects.errors import ApiError
from recorder.dialects.parse_cache import ParseCache
from recorder.dialects.sse import SseFrame
from recorder.redact import redact

History = Callable[[str], Awaitable[list[Message]]]
"""Resolves a `previous_response_id` to that response's whole conversation (from the log)."""


class Dialect(Protocol):
    """One wire format over the one turn model: bytes -> ChatRequest, Answer -> bytes/frames."""

    name: str  # recorded as MessagesRequest.dialect
    ping: bytes | None  # the keep-alive frame; None: Anthropic's `event: ping`

    async def parse(
        self, body: bytes, *, cache: ParseCache | None = None, history: History | None = None
    ) -> tuple[ChatRequest, Dialect]:
        """The request, and the dialect value configured to answer it (stream options)."""
        ...

    def message(self, answer: Answer) -> dict[str, Any]: ...

    def opening(self, message_id: str, model: str, usage: dict[str, int]) -> SseFrame: ...

    def frames(self, answer: Answer) -> list[SseFrame]: ...

    def error(self, err: ApiError) -> dict[str, Any]: ...

    def error_frame(self, err: ApiError) -> SseFrame: ...


# --------------------------------------------------------------------------
# Shared by the two OpenAI dialects
# --------------------------------------------------------------------------

_OPENAI_TYPE = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "invalid_request_error",
    "permission_error": "invalid_request_error",
    "not_found_error": "invalid_request_error",
    "request_too_large": "invalid_request_error",
    "rate_limit_error": "rate_limit_exceeded",
    "api_error": "server_error",
    "overloaded_error": "server_error",
}
_OPENAI_CODE = {
    "authentication_error": "invalid_api_key",
    "not_found_error": "not_found",
    "request_too_large": "request_too_large",
    "rate_limit_error": "rate_limit_exceeded",
    "overloaded_error": "overloaded",
}
_PARAM_RE = re.compile(r"^(?P<param>[A-Za-z_][\w.\[\]]*): (?P<message>.*)$", re.S)


def openai_error(err: ApiError) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`; `param` is the field the message names."""
    match = _PARAM_RE.match(err.message) if err.error_type == "invalid_request_error" else None
    param = match["param"] if match and match["param"] != "body" else None
    return {
        "error": {
            "message": redact(err.message),  # as error_payload: no password or token leaks
            "type": _OPENAI_TYPE.get(err.error_type, "invalid_request_error"),
            "param": param,
            "code": _OPENAI_CODE.get(err.error_type),
        }
    }


OPENAI_PING = b": ping\n\n"


def usage_numbers(usage: dict[str, int]) -> tuple[int, int, int]:
    """(prompt tokens, of which cached, output tokens) from the turn model's usage."""
    cached = usage.get("cache_read_input_tokens", 0)
    return usage.get("input_tokens", 0) + cached, cached, usage.get("output_tokens", 0)
