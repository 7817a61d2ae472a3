"""Every path that touches the store answers 529 while Postgres is away (issue 24, item 3).

A turn that fails for want of the database leaves its session suspect: the
next request on it rebuilds the session from the log (`sessions.get` ->
`restore.load_session_state`), a read the old code let escape as a 500
`ConnectionRefusedError`. The admin endpoints read the log directly (samples)
or open sessions. Each path is tried while the database refuses connections
(`test_storage_faults._set_database_reachable`): the answer must be 529
`overloaded_error` in the caller's dialect shape, retryable, with no driver
text, and `/health` must name the outage.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from recorder.dialects import ANTHROPIC, OPENAI_CHAT, OPENAI_RESPONSES, Dialect
from recorder.dialects.errors import ApiError
from recorder.model.tokenizer import Tokenizer
from tests.server.conftest import Harness, make_harness
from tests.server.test_storage_faults import _set_database_reachable, health, turn

Answer = tuple[int, dict[str, str], Any]


async def _post(h: Harness, path: str, body: Any, token: str) -> Answer:
    assert h.http is not None
    headers = {"Authorization": f"Bearer {token}"}
    async with h.http.post(h.url + path, json=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def _get(h: Harness, path: str, token: str) -> Answer:
    assert h.http is not None
    headers = {"Authorization": f"Bearer {token}"}
    async with h.http.get(h.url + path, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.json()


def _admin(h: Harness) -> str:
    return h.config.admin_token


async def _messages(h: Harness, sid: str) -> Answer:
    return await turn(h, sid, "during the outage")


async def _chat_completions(h: Harness, sid: str) -> Answer:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    return await _post(h, "/v1/chat/completions", body, sid)


async def _responses(h: Harness, sid: str) -> Answer:
    return await _post(h, "/v1/responses", {"model": "m", "input": "hi"}, sid)


async def _open(h: Harness, sid: str) -> Answer:
    return await _post(h, "/sessions", {}, _admin(h))


async def _reopen(h: Harness, sid: str) -> Answer:
    return await _post(h, "/sessions", {"session_id": sid, "reopen": True}, _admin(h))


async def _inspect(h: Harness, sid: str) -> Answer:
    return await _get(h, f"/sessions/{sid}", _admin(h))


async def _events(h: Harness, sid: str) -> Answer:
    body = {"events": [{"kind": "sandbox.created", "detail": {}}]}
    return await _post(h, f"/sessions/{sid}/events", body, _admin(h))


async def _close(h: Harness, sid: str) -> Answer:
    return await _post(h, f"/sessions/{sid}/close", {"reward": 1.0}, _admin(h))


async def _samples(h: Harness, sid: str) -> Answer:
    return await _get(h, f"/sessions/{sid}/samples", _admin(h))


Path = Callable[[Harness, str], Awaitable[Answer]]
PATHS: dict[str, tuple[Path, Dialect]] = {
    "messages": (_messages, ANTHROPIC),
    "chat_completions": (_chat_completions, OPENAI_CHAT),
    "responses": (_responses, OPENAI_RESPONSES),
    "admin_open": (_open, ANTHROPIC),
    "admin_reopen": (_reopen, ANTHROPIC),
    "admin_inspect": (_inspect, ANTHROPIC),
    "admin_events": (_events, ANTHROPIC),
    "admin_close": (_close, ANTHROPIC),
    "admin_samples": (_samples, ANTHROPIC),
}


def _assert_overloaded(status: int, headers: dict[str, str], data: Any, dialect: Dialect) -> None:
    assert status == 529, data
    message = data["error"]["message"]
    # The caller's dialect shape, exactly as its other 529s.
    assert data == dialect.error(ApiError("overloaded_error", message)), data
    assert "the database is unreachable" in message, data
    for internal in ("asyncpg", "sqlalchemy", "127.0.0.1", "postgres", "connectionrefused"):
        assert internal not in message.lower(), data
    assert headers.get("x-should-retry") != "false"


# Each path on a session the server must rebuild from the log; and on one it holds,
# where the path reads the log itself or met the outage outside the dialect's shape.
CASES = [(path, False) for path in PATHS] + [
    (path, True) for path in ("chat_completions", "responses", "admin_samples")
]


@pytest.mark.parametrize(
    ("path", "held"), CASES, ids=[f"{p}-{'held' if h else 'reloaded'}" for p, h in CASES]
)
async def test_outage_answers_529(
    tokenizer: Tokenizer, postgres_url: str, path: str, held: bool
) -> None:
    """After a turn failed on the outage, the path answers 529 on a session the server
    holds (`held`) and on one it must rebuild from the log (`reloaded`: a restarted
    server holds nothing, as after a failure made the cached state suspect)."""
    request, dialect = PATHS[path]
    h = await make_harness(tokenizer, postgres_url)
    try:
        sid = await h.open_session()
        status, _, data = await turn(h, sid, "before")
        assert status == 200, data

        if not held:
            await h.restart(reopen_store=False)

        await _set_database_reachable(postgres_url, False)
        status, _, data = await turn(h, sid, "fails")
        assert status == 529, data
        for _ in range(2):  # a client retrying a 529 gets a 529 again, never a 500
            status, headers, data = await request(h, sid)
            _assert_overloaded(status, headers, data, dialect)
        status, data = await health(h)
        assert status == 503 and data["storage"] == "the database is unreachable", data

        await _set_database_reachable(postgres_url, True)
        for _ in range(3):  # as a client retries a 529: the pool reconnects
            status, _, data = await request(h, sid)
            if status < 500:
                break
        assert status < 300, data
    finally:
        await _set_database_reachable(postgres_url, True)
        await h.close()
