"""The trainer's session API: open, duplicate, reopen, inspect, close with samples."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from recorder.log import events as ev
from replay import check_invariants, close_session_samples
from tests.server.conftest import Harness, make_harness, tool_call_text
from tests.server.test_e2e import ask, echo, tool_result


async def test_open_with_trainer_metadata(guarded: Harness) -> None:
    h = guarded
    status, data = await h.admin(
        "POST",
        "/sessions",
        {
            "session_id": "cagent-repo1-0-3",
            "instance_id": "repo1",
            "sample_index": 0,
            "group_index": 3,
            "metadata": {"rollout_id": "r-9"},
        },
    )
    assert status == 201, data
    assert data["session_id"] == "cagent-repo1-0-3"
    assert data["status"] == "open" and data["attempt"] == 0
    (opened,) = await h.payloads("cagent-repo1-0-3", ev.SessionOpened)
    assert opened.metadata == {
        "instance_id": "repo1",
        "sample_index": 0,
        "group_index": 3,
        "rollout_id": "r-9",
    }
    assert opened.tokenizer == h.tokenizer.identity
    assert opened.context_length == h.config.context_length
    assert opened.engine_url == h.engine.url


async def test_generated_ids_are_unique(guarded: Harness) -> None:
    ids = {await guarded.open_session() for _ in range(5)}
    assert len(ids) == 5


async def test_duplicate_id_is_409_and_reopen_starts_a_new_attempt(guarded: Harness) -> None:
    h = guarded
    await h.open_session(session_id="dup-1")
    status, data = await h.admin("POST", "/sessions", {"session_id": "dup-1"})
    assert status == 409
    assert data["error"]["type"] == "invalid_request_error"
    assert "already exists" in data["error"]["message"]
    await ask(h.client("dup-1"), [{"role": "user", "content": "first attempt"}], stream=False)
    status, data = await h.admin("POST", "/sessions", {"session_id": "dup-1", "reopen": True})
    assert status == 201 and data["attempt"] == 1
    h.engine.push("second attempt answer")
    answer = await ask(h.client("dup-1"), [{"role": "user", "content": "again"}], stream=False)
    assert answer.content[0].text == "second attempt answer"
    decisions = await h.payloads("dup-1", ev.ChainDecision)
    assert [d.reason for d in decisions] == ["first", "first"]  # the new attempt starts clean
    requests = await h.payloads("dup-1", ev.MessagesRequest)
    assert [r.turn for r in requests] == [0, 1]  # turn numbers stay unique in the stream


async def test_bad_open_requests(guarded: Harness) -> None:
    h = guarded
    status, data = await h.admin("POST", "/sessions", {"session_id": "has space"})
    assert status == 400 and "session_id" in data["error"]["message"]
    status, data = await h.admin("POST", "/sessions", {"metadata": [1, 2]})
    assert status == 400 and "metadata" in data["error"]["message"]
    status, data = await h.admin("POST", "/sessions", {"reopen": "yes"})
    assert status == 400 and "reopen" in data["error"]["message"]


async def test_admin_token_required(guarded: Harness) -> None:
    h = guarded
    assert h.http is not None
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        async with h.http.post(h.url + "/sessions", json={}, headers=headers) as resp:
            assert resp.status == 401
            data = await resp.json()
            assert data["error"]["type"] == "authentication_error"
    sid = await h.open_session()
    async with h.http.post(h.url + f"/sessions/{sid}/close", json={}) as resp:
        assert resp.status == 401
    async with h.http.get(h.url + f"/sessions/{sid}", headers={"x-api-key": sid}) as resp:
        assert resp.status == 401  # a session id is not an admin token


async def test_inspect(guarded: Harness) -> None:
    h = guarded
    sid = await h.open_session(instance_id="i-1")
    await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=True)
    status, data = await h.admin("GET", f"/sessions/{sid}")
    assert status == 200
    assert data["status"] == "open"
    assert data["metadata"] == {"instance_id": "i-1"}
    assert data["turns"] == 1 and data["turns_completed"] == 1
    assert data["events"] == len(await h.events(sid))
    assert data["chains"] == 1 and data["busy"] is False
    status, data = await h.admin("GET", "/sessions/nope")
    assert status == 404 and data["error"]["type"] == "not_found_error"


async def test_close_returns_samples(guarded: Harness) -> None:
    h = guarded
    sid = await h.open_session(instance_id="repo", sample_index=1, group_index=0)
    client = h.client(sid)
    h.engine.push(tool_call_text("Bash", {"command": "pytest"}), "All tests pass.")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Run the tests"}]
    first = await ask(client, messages, stream=True)
    messages += [echo(first), tool_result(first.content[-1].id, "3 passed")]
    await ask(client, messages, stream=True)

    status, data = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    assert status == 200, data
    assert data["session_id"] == sid
    assert data["status"] == "completed"
    assert data["reward"] == 1.0
    assert data["placeholder"] is False
    (sample,) = data["samples"]
    assert sample["reward"] == 1.0
    assert sample["status"] == "completed"
    assert len(sample["tokens"]) == sample["prompt_len"] + sample["response_len"]
    assert sum(sample["loss_mask"]) > 0
    # The same samples the offline path builds.
    offline = await close_session_samples(h.store, sid, h.ctx.rules)
    assert [s.tokens for s in offline.samples] == [sample["tokens"]]
    for s in offline.samples:
        check_invariants(s, context_length=h.config.context_length)
    types = await h.types(sid)
    assert types[-2:] == ["reward_assigned", "session_closed"]
    # A closed session holds no tokens or request bodies in memory.
    closed = h.ctx.registry.cached(sid)
    assert closed is not None and closed.chains is None and not closed.chain_refs
    assert closed.body_prefixes.window == b"" and not closed.body_prefixes.refs

    # Closed: agent requests and a second close are conflicts; samples stay readable.
    with pytest.raises(anthropic.APIStatusError) as info:
        await ask(client, messages, stream=False)
    assert info.value.status_code == 409
    status, data = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 0.0})
    assert status == 409 and "already closed" in data["error"]["message"]
    status, again = await h.admin("GET", f"/sessions/{sid}/samples")
    assert status == 200 and again["samples"][0]["tokens"] == sample["tokens"]
    status, state = await h.admin("GET", f"/sessions/{sid}")
    assert state["status"] == "closed" and state["close_status"] == "completed"


async def test_a_retried_request_trains_only_the_answer_the_agent_kept(guarded: Harness) -> None:
    h = guarded
    sid = await h.open_session()
    client = h.client(sid)
    h.engine.push("An answer that got lost.", "The answer that arrived.", "Done.")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hello"}]
    await ask(client, messages, stream=False)  # the client never saw this one...
    kept = await ask(client, messages, stream=False)  # ...and sent the request again
    await ask(client, [*messages, echo(kept), {"role": "user", "content": "Go on"}], stream=False)
    status, data = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    assert status == 200, data
    (sample,) = data["samples"]
    assert sample["metadata"]["segment_kind"] == "final"
    assert sample["metadata"]["turns"] == [1, 2]
    text = h.tokenizer.decode(sample["tokens"])
    assert "The answer that arrived." in text and "got lost" not in text
    assert any("abandoned branch" in d for d in data["diagnostics"])


async def test_routing_replay_end_to_end(tokenizer: Any, sqlite_url: str) -> None:
    """MoE routing recorded per attempt comes back in the close samples, token for token."""
    import base64

    import numpy as np

    from replay.rules import Rules

    h = await make_harness(tokenizer, sqlite_url, return_routed_experts=True)
    try:
        h.ctx.rules = Rules(routed_experts=(2, 2))  # the scripted engine's (layers, top_k)
        sid = await h.open_session()
        client = h.client(sid)
        h.engine.push(tool_call_text("Bash", {"command": "ls"}), "Done.")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "List"}]
        first = await ask(client, messages, stream=False)
        messages += [echo(first), tool_result(first.content[-1].id, "a.txt")]
        await ask(client, messages, stream=True)
        status, data = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    finally:
        await h.close()
    assert status == 200, data
    (sample,) = data["samples"]
    shape, raw = sample["routed_experts"]
    routing = np.frombuffer(base64.b64decode(raw), dtype="<i4").reshape(shape)
    tokens = np.asarray(sample["tokens"])
    assert routing.shape == (tokens.size, 2, 2)
    # The engine's deterministic routing: (token + 7 * layer + k) % 64 at every position.
    expected = (tokens[:, None, None] + np.arange(2)[None, :, None] * 7 + np.arange(2)) % 64
    assert (routing == expected).all()


async def test_closed_sessions_leave_memory_and_still_answer(guarded: Harness) -> None:
    h = guarded
    h.ctx.registry.max_closed = 1
    sids = [await h.open_session() for _ in range(3)]
    for sid in sids:
        await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=False)
        status, _ = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
        assert status == 200
    assert [h.ctx.registry.cached(sid) is not None for sid in sids] == [False, False, True]
    # Dropped from memory, not forgotten: reloaded from the log when named again.
    with pytest.raises(anthropic.APIStatusError) as info:
        await ask(h.client(sids[0]), [{"role": "user", "content": "hi"}], stream=False)
    assert info.value.status_code == 409
    status, state = await h.admin("GET", f"/sessions/{sids[1]}")
    assert status == 200 and state["status"] == "closed"
    status, data = await h.admin("POST", "/sessions", {"session_id": sids[0], "reopen": True})
    assert status == 201 and data["attempt"] == 1


async def test_close_failed_session_gives_placeholders(guarded: Harness) -> None:
    h = guarded
    sid = await h.open_session()
    await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=False)
    status, data = await h.admin(
        "POST", f"/sessions/{sid}/close", {"status": "failed", "reason": "sandbox died"}
    )
    assert status == 200
    assert data["placeholder"] is True
    assert all(s["status"] in ("aborted", "failed") and s["reward"] == 0 for s in data["samples"])
    assert all(sum(s["loss_mask"]) == 0 for s in data["samples"])


async def test_close_validation_and_unknown(guarded: Harness) -> None:
    h = guarded
    status, data = await h.admin("POST", "/sessions/ghost/close", {})
    assert status == 404
    sid = await h.open_session()
    status, data = await h.admin("POST", f"/sessions/{sid}/close", {"status": "great"})
    assert status == 400 and "status" in data["error"]["message"]
    status, data = await h.admin("POST", f"/sessions/{sid}/close", {"reward": "high"})
    assert status == 400 and "reward" in data["error"]["message"]
    status, state = await h.admin("GET", f"/sessions/{sid}")
    assert state["status"] == "open"  # a refused close changes nothing


async def test_close_waits_for_the_in_flight_turn(tokenizer: Any, sqlite_url: str) -> None:
    import asyncio

    h = await make_harness(tokenizer, sqlite_url, engine_kwargs={"token_delay_s": 0.02})
    try:
        sid = await h.open_session()
        turn = asyncio.create_task(
            ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=True)
        )
        while not h.engine.core.running:
            await asyncio.sleep(0.01)
        status, data = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 0.5})
        answer = await turn
        assert answer.stop_reason == "end_turn"
        assert status == 200 and len(data["samples"]) == 1
        types = await h.types(sid)
        assert types.index("response_sent") < types.index("session_closed")
    finally:
        await h.close()
