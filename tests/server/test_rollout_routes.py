"""The admin API the rollout driver uses: its own events, forced sampling, a turn cap."""

from __future__ import annotations

from typing import Any

import pytest

from recorder.log import events as ev
from tests.server.conftest import Harness
from tests.server.test_e2e import ask


async def test_rollout_events_join_the_log(guarded: Harness) -> None:
    h = guarded
    sid = await h.open_session()
    body = {
        "events": [
            {"kind": "sandbox_created", "detail": {"backend": "local", "id": "x"}},
            {"kind": "command_run", "detail": {"cmd": "git apply", "exit_code": 0}},
        ]
    }
    status, data = await h.admin("POST", f"/sessions/{sid}/events", body)
    assert status == 201 and data["appended"] == 2, data
    got = await h.payloads(sid, ev.SandboxEvent)
    assert [(e.kind, e.detail) for e in got] == [(e["kind"], e["detail"]) for e in body["events"]]
    assert data["events"] == len(await h.events(sid))


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "events"),
        ({"events": []}, "events"),
        ({"events": [{"detail": {}}]}, "kind"),
        ({"events": [{"kind": "Has Space"}]}, "events[0].kind"),
        ({"events": [{"kind": "ok", "detail": [1]}]}, "events[0].detail"),
        ({"events": [{"kind": "ok", "extra": 1}]}, "extra"),
        ([1], "body"),
    ],
)
async def test_bad_rollout_events_are_400_naming_the_field(
    guarded: Harness, body: Any, field: str
) -> None:
    sid = await guarded.open_session()
    status, data = await guarded.admin("POST", f"/sessions/{sid}/events", body)
    assert status == 400, data
    assert field in data["error"]["message"], data
    assert await guarded.payloads(sid, ev.SandboxEvent) == []


async def test_rollout_events_need_an_open_session_and_the_token(guarded: Harness) -> None:
    h = guarded
    one = {"events": [{"kind": "killed"}]}
    status, _ = await h.admin("POST", "/sessions/nope/events", one)
    assert status == 404
    sid = await h.open_session()
    assert h.http is not None
    async with h.http.post(h.url + f"/sessions/{sid}/events", json=one) as resp:
        assert resp.status == 401
    await h.admin("POST", f"/sessions/{sid}/close", {"status": "aborted"})
    status, data = await h.admin("POST", f"/sessions/{sid}/events", one)
    assert status == 409 and "closed" in data["error"]["message"]


async def test_forced_sampling_wins_over_the_request(guarded: Harness) -> None:
    h = guarded
    forced = {"temperature": 0.25, "top_p": 0.5, "top_k": 7, "max_new_tokens": 40}
    sid = await h.open_session(config={"sampling": forced})
    await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=True)
    (attempt,) = await h.payloads(sid, ev.GenerateAttempt)
    params = attempt.sampling_params
    assert {k: params[k] for k in forced} == forced
    (req,) = h.engine.requests
    assert (req.temperature, req.top_p, req.top_k, req.max_new_tokens) == (0.25, 0.5, 7, 40)


async def test_forced_penalties_and_stop_tokens_reach_the_engine(guarded: Harness) -> None:
    """What verl and slime hand over beyond temperature (penalties, extra stop ids) is forced
    too; neutral penalties are not sent at all (SGLang's defaults)."""
    h = guarded
    plain = await h.open_session()
    await ask(h.client(plain), [{"role": "user", "content": "hi"}], stream=False)
    (attempt,) = await h.payloads(plain, ev.GenerateAttempt)
    assert "repetition_penalty" not in attempt.sampling_params
    forced = {"repetition_penalty": 1.1, "min_p": 0.05, "presence_penalty": 0.5}
    sid = await h.open_session(config={"sampling": {**forced, "stop_token_ids": [7]}})
    await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=False)
    (attempt,) = await h.payloads(sid, ev.GenerateAttempt)
    params = attempt.sampling_params
    assert {k: params[k] for k in forced} == forced
    assert 7 in params["stop_token_ids"]
    assert set(h.ctx.tokenizer.eos_token_ids) <= set(params["stop_token_ids"])


async def test_turn_cap_refuses_the_next_turn_and_survives_a_restart(guarded: Harness) -> None:
    h = guarded
    sid = await h.open_session(config={"max_turns": 1})
    client = h.client(sid)
    await ask(client, [{"role": "user", "content": "one"}], stream=False)
    with pytest.raises(Exception, match="turn budget spent"):
        await ask(client, [{"role": "user", "content": "two"}], stream=False)
    await h.restart()
    with pytest.raises(Exception, match="turn budget spent"):
        await ask(h.client(sid), [{"role": "user", "content": "three"}], stream=True)
    rejected = await h.payloads(sid, ev.RequestRejected)
    assert [r.status for r in rejected] == [400, 400]
    assert len(await h.payloads(sid, ev.GenerateResult)) == 1


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"sampling": {"temperature": -1}}, "config.sampling.temperature"),
        ({"sampling": {"top_p": 0}}, "config.sampling.top_p"),
        ({"sampling": {"seed": 1}}, "seed"),
        ({"sampling": {"repetition_penalty": 0}}, "config.sampling.repetition_penalty"),
        ({"sampling": {"stop_token_ids": [-1]}}, "config.sampling.stop_token_ids"),
        ({"max_turns": 0}, "config.max_turns"),
    ],
)
async def test_bad_overrides_are_400(guarded: Harness, config: Any, field: str) -> None:
    status, data = await guarded.admin("POST", "/sessions", {"config": config})
    assert status == 400 and field in data["error"]["message"], data
