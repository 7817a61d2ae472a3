"""Postgres lost in the middle of a turn answers 529 in the caller's shape, never 500.

tests/server/test_outage_paths.py takes the database away before a request;
here it goes away while the request runs, at each store call a turn makes in
order (a cached session: the head check `read_session`, the request's arrays
`put_array`, the request's events `append`, the answer's `append`; a session
rebuilt from the log: `read_session_from_last`, then its snapshot's
`get_arrays`). The real store is wrapped so that the chosen call first takes
the database away (as `test_storage_faults` does: connections refused, the
store's own terminated) and then runs against it. Each point is tried for
Anthropic JSON and SSE and OpenAI chat JSON and stream: the answer is a 529
`overloaded_error` in the dialect's error shape, or, once a stream has
started, that error as the dialect's error frame; never a 500 `api_error`.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from recorder.dialects import ANTHROPIC, OPENAI_CHAT, Dialect
from recorder.dialects.errors import ApiError
from recorder.log.store.base import EventStore
from recorder.model.tokenizer import Tokenizer
from tests.server.conftest import Harness, make_harness
from tests.server.test_storage_faults import _set_database_reachable, health, turn

# Where the database goes: (store method, which call of it, session rebuilt from the log).
POINTS: dict[str, tuple[str, int, bool]] = {
    "head_check": ("read_session", 1, False),
    "request_arrays": ("put_array", 1, False),
    "request_events": ("append", 1, False),
    "answer_events": ("append", 2, False),
    "reload_read": ("read_session_from_last", 1, True),
    "reload_arrays": ("get_arrays", 1, True),
}
MODES: dict[str, tuple[str, bool, Dialect]] = {
    "anthropic_json": ("/v1/messages", False, ANTHROPIC),
    "anthropic_sse": ("/v1/messages", True, ANTHROPIC),
    "openai_chat_json": ("/v1/chat/completions", False, OPENAI_CHAT),
    "openai_chat_stream": ("/v1/chat/completions", True, OPENAI_CHAT),
}


class Trip:
    """Takes the database away on the `nth` call of `method` of `store`, then makes the call."""

    def __init__(self, store: EventStore, url: str, method: str, nth: int) -> None:
        self.url = url
        self.left = nth
        self.fired = False
        original: Callable[..., Awaitable[Any]] = getattr(store, method)

        async def tripping(*args: Any, **kwargs: Any) -> Any:
            self.left -= 1
            if self.left == 0:
                self.fired = True
                await _set_database_reachable(self.url, False)
            return await original(*args, **kwargs)

        setattr(store, method, tripping)


async def _request(h: Harness, sid: str, path: str, stream: bool) -> tuple[int, str]:
    assert h.http is not None
    body = {
        "model": "m",
        "max_tokens": 16,
        "stream": stream,
        "messages": [{"role": "user", "content": "while the database goes"}],
    }
    headers = {"Authorization": f"Bearer {sid}"}
    async with h.http.post(h.url + path, json=body, headers=headers) as resp:
        return resp.status, await resp.text()


def _frames(text: str) -> list[tuple[str | None, Any]]:
    """The SSE frames of a stream: (event name or None, decoded data)."""
    frames = []
    for block in text.strip().split("\n\n"):
        event, data = None, None
        for line in block.splitlines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
        if data is not None and data != "[DONE]":
            frames.append((event, json.loads(data)))
    return frames


def _assert_overloaded(status: int, text: str, dialect: Dialect) -> None:
    if status == 200:  # the stream had started: the error is its last frame
        frames = _frames(text)
        assert frames, text
        name, data = frames[-1]
        message = (data.get("error") or {}).get("message", "")
        assert (name, data) == dialect.error_frame(ApiError("overloaded_error", message)), text
    else:
        assert status == 529, text
        data = json.loads(text)
        message = data["error"]["message"]
        assert data == dialect.error(ApiError("overloaded_error", message)), text
    assert "the database is unreachable" in message, text
    for internal in ("asyncpg", "sqlalchemy", "127.0.0.1", "connectionrefused"):
        assert internal not in message.lower(), text


@pytest.mark.postgres
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("point", list(POINTS))
async def test_database_lost_mid_turn_answers_529(
    tokenizer: Tokenizer, postgres_url: str, point: str, mode: str
) -> None:
    method, nth, reload = POINTS[point]
    path, stream, dialect = MODES[mode]
    h = await make_harness(tokenizer, postgres_url, close_watch_interval_s=0)
    try:
        sid = await h.open_session()
        status, _, data = await turn(h, sid, "before")
        assert status == 200, data
        if reload:
            await h.restart(reopen_store=False)
        trip = Trip(h.store, postgres_url, method, nth)
        status, text = await _request(h, sid, path, stream)
        assert trip.fired, f"the turn never called {method} #{nth}"
        print(f"\n{point} {mode}: {status} {text[-200:]}")
        _assert_overloaded(status, text, dialect)
        status, _ = await health(h)
        assert status == 503

        await _set_database_reachable(postgres_url, True)
        for _ in range(3):  # as a client retries a 529: the pool reconnects
            status, _, data = await turn(h, sid, "after")
            if status == 200:
                break
        assert status == 200, data
    finally:
        await _set_database_reachable(postgres_url, True)
        await h.close()
