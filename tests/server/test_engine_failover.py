"""Several engines: a session whose engine dies moves to a live one (issue 15)."""

from __future__ import annotations

from typing import Any

from recorder import events as ev
from tests.server.conftest import Harness
from tests.server.test_e2e import ask, echo
from tools.test_engine.scripted import ScriptedEngine


async def _session_on(h: Harness, url: str) -> str:
    """Open sessions until one is pinned to `url` (pinning hashes the session id)."""
    for _ in range(64):
        sid = await h.open_session()
        status, data = await h.admin("GET", f"/sessions/{sid}")
        assert status == 200, data
        if data["engine_url"] == url:
            return sid
    raise AssertionError(f"no session pinned to {url}")


async def _health(h: Harness) -> Any:
    assert h.http is not None
    async with h.http.get(h.url + "/health") as resp:
        return await resp.json()


async def test_a_dead_engines_session_moves_to_a_live_one(harness: Harness, tokenizer: Any) -> None:
    h = harness
    dying = ScriptedEngine(tokenizer, context_length=8192)
    dying_url = await dying.start()
    live_url = h.engine.url
    h.engine_urls = [live_url, dying_url]
    await h.restart(reopen_store=False)
    sid = await _session_on(h, dying_url)
    client = h.client(sid)
    dying.push("First answer.")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    first = await ask(client, messages, stream=False)
    assert first.content[0].text == "First answer."
    assert (await _health(h))["engines_down"] == []

    await dying.stop()
    await h.ctx.engine.check_engines()  # what the periodic check does
    assert (await _health(h))["engines_down"] == [dying_url]
    h.engine.push("Second answer, elsewhere.")
    messages += [echo(first), {"role": "user", "content": "go on"}]
    second = await ask(client, messages, stream=True)
    assert second.content[0].text == "Second answer, elsewhere."

    attempts = await h.payloads(sid, ev.GenerateAttempt)
    assert [a.engine_url for a in attempts] == [dying_url, live_url]
    status, closed = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    assert status == 200, closed
    assert [s["metadata"]["turns"] for s in closed["samples"]] == [[0, 1]]


async def test_a_refused_connection_moves_the_next_turn_without_a_check(
    harness: Harness, tokenizer: Any
) -> None:
    """Between checks, the turn that finds the engine gone fails (529); the retry moves."""
    import anthropic
    import pytest

    h = harness
    dying = ScriptedEngine(tokenizer, context_length=8192)
    dying_url = await dying.start()
    h.engine_urls = [h.engine.url, dying_url]
    await h.restart(reopen_store=False)
    sid = await _session_on(h, dying_url)
    h.ctx.engine.health_interval_s = 0  # no further checks: only the refused connection tells
    await dying.stop()
    client = h.client(sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.APIStatusError) as failed:
        await ask(client, messages, stream=False)
    assert failed.value.status_code == 529
    h.engine.push("Answered by the live engine.")
    answer = await ask(client, messages, stream=False)
    assert answer.content[0].text == "Answered by the live engine."
    assert dying_url in (await _health(h))["engines_down"]
