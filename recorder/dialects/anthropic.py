"""Anthropic Messages: the translation lives in recorder/dialects/translate.py and server/answer.py."""

from __future__ import annotations

from typing import Any

from recorder.dialects.answer import Answer, content_events, message_json, message_start_event
from recorder.dialects.base import Dialect, History
from recorder.dialects.chat import ChatRequest
from recorder.dialects.errors import ApiError, error_payload
from recorder.dialects.parse_cache import ParseCache
from recorder.dialects.sse import SseFrame
from recorder.dialects.translate import parse_request


class Anthropic:
    name = "anthropic"
    ping = None

    async def parse(
        self, body: bytes, *, cache: ParseCache | None = None, history: History | None = None
    ) -> tuple[ChatRequest, Dialect]:
        return parse_request(body, cache=cache), self

    def message(self, answer: Answer) -> dict[str, Any]:
        return message_json(answer)

    def opening(self, message_id: str, model: str, usage: dict[str, int]) -> SseFrame:
        return message_start_event(message_id, model, usage)

    def frames(self, answer: Answer) -> list[SseFrame]:
        return list(content_events(answer))

    def error(self, err: ApiError) -> dict[str, Any]:
        return error_payload(err.error_type, err.message)

    def error_frame(self, err: ApiError) -> SseFrame:
        return "error", error_payload(err.error_type, err.message)


ANTHROPIC = Anthropic()
