"""Admin requests that must not queue behind a turn: an aborting close stops the turn (its
engine request aborted) and answers at once; rollout events never wait for a turn.

The engine here hangs for real (a scripted fault that sleeps an hour before its first
token, abortable as SGLang's running requests are), so a close that waited for the
turn would never answer within the test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from recorder.log import events as ev
from tests.server.conftest import Harness, make_harness
from tests.server.test_e2e import ask
from tools.test_engine.core import Fault

HANG_S = 3600.0


@pytest.fixture
async def h(tokenizer: Any, store_url: str) -> AsyncIterator[Harness]:
    h = await make_harness(tokenizer, store_url)
    try:
        yield h
    finally:
        await h.close()


async def hung_turn(h: Harness, sid: str) -> asyncio.Task[Any]:
    """A turn whose engine request hangs; returns once the engine holds it."""
    h.engine.core.inject(Fault(delay_s=HANG_S))
    turn = asyncio.create_task(
        ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=False)
    )
    while not h.engine.core.running:
        assert not turn.done(), turn
        await asyncio.sleep(0.01)
    return turn


async def attempt_rids(h: Harness, sid: str) -> list[str]:
    return [e.rid for e in await h.payloads(sid, ev.GenerateAttempt)]


async def test_an_aborting_close_aborts_the_hung_turn_and_answers_at_once(h: Harness) -> None:
    sid = await h.open_session()
    turn = await hung_turn(h, sid)
    started = time.monotonic()
    status, data = await h.admin(
        "POST", f"/sessions/{sid}/close", {"status": "aborted", "reason": "cancelled: stop"}
    )
    took = time.monotonic() - started
    assert status == 200, data
    assert took < 2.0, f"close took {took:.1f} s behind a hung turn"
    assert data["status"] == "aborted" and data["placeholder"] is True
    # The engine was told to drop the turn's request: its rid, by the recorder.
    (rid,) = await attempt_rids(h, sid)
    assert rid in h.engine.core.aborts
    # The agent's request ends with a refusal it can read, not a hang.
    with pytest.raises(anthropic.APIStatusError) as info:
        await turn
    assert info.value.status_code == 409 and "closed aborted" in info.value.message
    types = await h.types(sid)
    assert "response_sent" not in types
    assert types.index("turn_failed") < types.index("session_closed")
    (failed,) = await h.payloads(sid, ev.TurnFailed)
    assert "closed aborted" in failed.reason


async def test_rollout_events_do_not_wait_for_a_hung_turn(h: Harness) -> None:
    sid = await h.open_session()
    turn = await hung_turn(h, sid)
    body = {"events": [{"kind": "agent_finished", "detail": {"stop": "wall_budget"}}]}
    status, data = await asyncio.wait_for(h.admin("POST", f"/sessions/{sid}/events", body), 10)
    assert status == 202 and data["deferred"] == 1, data
    assert "sandbox_event" not in await h.types(sid)  # not yet: the turn holds the session
    status, data = await h.admin("POST", f"/sessions/{sid}/close", {"status": "aborted"})
    assert status == 200, data
    with pytest.raises(anthropic.APIStatusError):
        await turn
    types = await h.types(sid)
    # Written with the close, before it: nothing the driver said is lost.
    assert types.count("sandbox_event") == 1
    assert types.index("sandbox_event") < types.index("session_closed")


async def test_events_deferred_behind_a_turn_are_written_when_it_ends(h: Harness) -> None:
    sid = await h.open_session()
    h.engine.core.inject(Fault(delay_s=0.5))
    turn = asyncio.create_task(
        ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=False)
    )
    while not h.engine.core.running:
        await asyncio.sleep(0.01)
    body = {"events": [{"kind": "command_run", "detail": {"cmd": "make"}}]}
    status, data = await h.admin("POST", f"/sessions/{sid}/events", body)
    assert status == 202 and data["deferred"] == 1
    answer = await turn
    assert answer.stop_reason == "end_turn"
    status, state = await h.admin("GET", f"/sessions/{sid}")
    assert state["busy"] is False
    types = await h.types(sid)
    assert types.count("sandbox_event") == 1
    assert types.index("response_sent") < types.index("sandbox_event")
    # A completed close still waits for a turn and keeps its answer (not aborted).
    status, data = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    assert status == 200 and data["samples"][0]["reward"] == 1.0
