"""A conflict that still happens between two servers on one log is absorbed (issue 14).

Replicas serialise a session's turns with a database lock; when that lock is
lost (its connection dies) or a process takes none, two servers can plan
from one head. These tests make that happen deterministically: two servers
in one process share one SQLite log (which has no cross-process lock), and
one server's next append of a chosen kind waits until the other server has
written. The real store decides every conflict.

- A turn whose claim (first append) loses is planned again from the new
  head: the client gets its 200, the engine input includes the other
  server's turn, and the turn takes the next free turn number.
- A close or rollout event whose append loses is done again at the new head.
- A turn whose later append loses follows the other server's events; if the
  other server closed the session meanwhile, the turn stays unanswered and
  the client gets a retryable 529.

Live samples equal `replay export` samples in every case.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import msgspec
import pytest

from recorder.log import events as ev
from recorder.log.events import NewEvent
from recorder.log.ids import uuid7
from recorder.log.store.base import EventStore
from recorder.model.tokenizer import Tokenizer
from recorder.server import RecorderServer
from replay.samples import Sample
from tests.server.conftest import Harness, make_harness
from tests.server.test_e2e import echo
from tests.server.test_replicas import _exported
from tools.test_engine.scripted import Reply

Holds = Callable[[Sequence[NewEvent]], bool]


class HeldAppends:
    """A server's view of the shared store: its next append that `hold` matches waits
    until `go`, so the other server's writes land between its plan and that append."""

    def __init__(self, store: EventStore) -> None:
        self._store = store
        self._when: Holds | None = None
        self._rival: Holds | None = None
        self.waiting = asyncio.Event()
        self._go = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def hold(self, kind: type) -> None:
        self._when = lambda batch: any(isinstance(e.event, kind) for e in batch)

    def go(self) -> None:
        self._go.set()

    def rival(self, kind: type) -> None:
        """From now on another writer appends just before every append with a `kind` event."""
        self._rival = lambda batch: any(isinstance(e.event, kind) for e in batch)

    async def append(self, session_id: str, events: Sequence[NewEvent], **kwargs: Any) -> Any:
        if self._rival is not None and self._rival(events):
            rival = NewEvent(event=ev.SandboxEvent(kind="rival"), ts=0.0, event_id=uuid7())
            await self._store.append(session_id, [rival])
        if self._when is not None and self._when(events):
            self._when = None
            self.waiting.set()
            await self._go.wait()
        return await self._store.append(session_id, events, **kwargs)


@dataclass
class Pair:
    """The harness server (`other`) and a second one (`held`) on the same log."""

    h: Harness
    held: RecorderServer
    store: HeldAppends
    sqlite_url: str

    @property
    def other(self) -> str:
        return self.h.url

    def client(self, base: str, session_id: str) -> anthropic.AsyncAnthropic:
        client = anthropic.AsyncAnthropic(
            base_url=base, auth_token=session_id, max_retries=0, timeout=60
        )
        self.h.clients.append(client)
        return client

    async def ask(self, base: str, session_id: str, messages: list[dict[str, Any]]) -> Any:
        return await self.client(base, session_id).messages.create(
            model="m", max_tokens=60, messages=messages
        )

    async def admin(self, base: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        assert self.h.http is not None
        async with self.h.http.request(
            method, base + path, json=body, headers=self.h.admin_headers()
        ) as resp:
            return resp.status, await resp.json()

    async def health(self, base: str) -> dict[str, Any]:
        return (await self.admin(base, "GET", "/health"))[1]

    async def close_and_compare(self, base: str, session_id: str, tmp_path: Path) -> Any:
        """Close on `base`; its samples must equal what `replay export` makes of the log."""
        status, closed = await self.admin(base, "POST", f"/sessions/{session_id}/close", {})
        assert status == 200, closed
        exported = _exported(self.sqlite_url, tmp_path / "samples.jsonl")
        live = [msgspec.convert(s, Sample) for s in closed["samples"]]
        assert live == exported.get(session_id, []), session_id
        return closed


@pytest.fixture
async def pair(tokenizer: Tokenizer, sqlite_url: str) -> AsyncIterator[Pair]:
    h = await make_harness(tokenizer, sqlite_url)
    store = HeldAppends(h.store)
    held = await h.server_on(store)  # type: ignore[arg-type]
    try:
        yield Pair(h, held, store, sqlite_url)
    finally:
        store.go()
        await held.stop(grace_s=1)
        await h.close()


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def _turns_used(closed: dict[str, Any]) -> list[int]:
    return sorted(t for s in closed["segments"] for t in s["turns"])


async def _events(p: Pair, session_id: str, kind: type) -> list[Any]:
    return await p.h.payloads(session_id, kind)


async def test_a_lost_claim_is_planned_again_from_the_head(pair: Pair, tmp_path: Path) -> None:
    p = pair
    sid = await p.h.open_session()
    first = [_user("first question")]
    answer0 = await p.ask(p.other, sid, first)
    # The held server's stale engine call is slow (half a minute): only the
    # abort that follows its lost claim can end it in time. The other turn's
    # answer comes as tokens no render of its text gives back (one per
    # character), so only a plan from the new head can include them.
    stale = Reply(text="stale " * 80, token_delay_s=0.5, match="third question")
    tok = p.h.tokenizer
    spelled = [t for c in "Second answer." for t in tok.encode(c)] + [tok.eos_token_ids[0]]
    p.h.engine.push(stale, Reply(ids=spelled))
    second = [*first, echo(answer0), _user("second question")]
    third = [*second, _assistant("Second answer."), _user("third question")]
    p.store.hold(ev.MessagesRequest)
    held_turn = asyncio.ensure_future(p.ask(p.held.url, sid, third))
    await asyncio.wait_for(p.store.waiting.wait(), 30)
    other = await p.ask(p.other, sid, second)  # lands between the held plan and its claim
    assert other.content[0].text == "Second answer."
    p.store.go()
    answer = await asyncio.wait_for(held_turn, 30)

    requests = await _events(p, sid, ev.MessagesRequest)
    assert [r.turn for r in requests] == [0, 1, 2]  # the next free number
    assert requests[2].request_id == answer.id
    attempts = await _events(p, sid, ev.GenerateAttempt)
    (stale_rid,) = p.h.engine.aborts  # stopped as soon as its claim lost, never recorded
    assert stale_rid not in [a.rid for a in attempts]
    rendered = await _events(p, sid, ev.RenderedInput)
    results = await _events(p, sid, ev.GenerateResult)
    decisions = await _events(p, sid, ev.ChainDecision)
    other_turn = [*await p.h.array(rendered[1].input_ids), *await p.h.array(results[1].output_ids)]
    retried = await p.h.array(rendered[2].input_ids)
    # Planned from the new head: it extends the other server's whole turn.
    assert decisions[2].action == "extend" and rendered[2].prefix_len == len(other_turn)
    assert retried[: len(other_turn)] == other_turn
    assert p.h.engine.requests[-1].input_ids == retried
    (stale_input,) = [r.input_ids for r in p.h.engine.requests if r.rid == stale_rid]
    assert stale_input[: len(other_turn)] != other_turn  # what planning again changed
    assert (await p.health(p.held.url))["conflicts_retried"] == 1
    closed = await p.close_and_compare(p.other, sid, tmp_path)
    assert _turns_used(closed) == [0, 1, 2]


@pytest.mark.parametrize("held", ["close", "events"])
async def test_a_lost_close_or_rollout_event_is_done_again(
    pair: Pair, held: str, tmp_path: Path
) -> None:
    p = pair
    sid = await p.h.open_session()
    first = [_user("first question")]
    answer0 = await p.ask(p.other, sid, first)
    if held == "close":
        p.store.hold(ev.SessionClosed)
        work = p.admin(p.held.url, "POST", f"/sessions/{sid}/close", {"reward": 1.0})
    else:
        p.store.hold(ev.SandboxEvent)
        body = {"events": [{"kind": "agent.finished", "detail": {"n": 1}}]}
        work = p.admin(p.held.url, "POST", f"/sessions/{sid}/events", body)
    task = asyncio.ensure_future(work)
    await asyncio.wait_for(p.store.waiting.wait(), 30)
    other = await p.ask(p.other, sid, [*first, echo(answer0), _user("second question")])
    p.store.go()
    status, data = await asyncio.wait_for(task, 30)

    types = await p.h.types(sid)
    responses = await _events(p, sid, ev.ResponseSent)
    assert [r.request_id for r in responses] == [answer0.id, other.id]
    assert (await p.health(p.held.url))["conflicts_retried"] == 1
    if held == "close":
        assert status == 200, data
        assert types[-2:] == ["reward_assigned", "session_closed"]  # after the other turn
        assert _turns_used(data) == [0, 1]
        exported = _exported(p.sqlite_url, tmp_path / "samples.jsonl")
        assert [msgspec.convert(s, Sample) for s in data["samples"]] == exported[sid]
    else:
        assert status == 201, data
        assert types[-1] == "sandbox_event" and data["events"] == len(types)
        await p.close_and_compare(p.other, sid, tmp_path)


async def test_the_rest_of_a_turn_follows_the_other_servers_turn(
    pair: Pair, tmp_path: Path
) -> None:
    p = pair
    sid = await p.h.open_session()
    first = [_user("first question")]
    answer0 = await p.ask(p.other, sid, first)
    p.h.engine.push("Held answer.", "Side answer.")
    p.store.hold(ev.ResponseSent)  # the held turn's claim is in; its answer waits
    second = [*first, echo(answer0), _user("second question")]
    held_turn = asyncio.ensure_future(p.ask(p.held.url, sid, second))
    await asyncio.wait_for(p.store.waiting.wait(), 30)
    side = await p.ask(p.other, sid, [_user("an unrelated question")])
    p.store.go()
    answer = await asyncio.wait_for(held_turn, 30)

    assert answer.content[0].text == "Held answer." and side.content[0].text == "Side answer."
    records = await p.h.events(sid)
    turns = [(r.event.turn, r.type) for r in records if hasattr(r.event, "turn")]
    claim = turns.index((1, "messages_request"))
    other = turns.index((2, "messages_request"))
    sent = turns.index((1, "response_sent"))
    assert claim < other < turns.index((2, "response_sent")) < sent  # interleaved, each whole
    assert p.held.ctx.registry.cached(sid).suspect  # rebuilt from the log before its next use
    # The other server learns of the late answer: the next turn extends it exactly.
    third = [*second, echo(answer), _user("third question")]
    await p.ask(p.other, sid, third)
    rendered = {e.turn: e for e in await _events(p, sid, ev.RenderedInput)}
    results = {e.turn: e for e in await _events(p, sid, ev.GenerateResult)}
    held_whole = [*await p.h.array(rendered[1].input_ids), *await p.h.array(results[1].output_ids)]
    assert (await p.h.array(rendered[3].input_ids))[: len(held_whole)] == held_whole
    assert rendered[3].prefix_len == len(held_whole)
    closed = await p.close_and_compare(p.held.url, sid, tmp_path)
    assert _turns_used(closed) == [0, 1, 2, 3]


async def test_a_turn_whose_session_was_closed_meanwhile_answers_529(
    pair: Pair, tmp_path: Path
) -> None:
    p = pair
    sid = await p.h.open_session()
    first = [_user("first question")]
    answer0 = await p.ask(p.other, sid, first)
    p.store.hold(ev.ResponseSent)
    held_turn = asyncio.ensure_future(
        p.ask(p.held.url, sid, [*first, echo(answer0), _user("second question")])
    )
    await asyncio.wait_for(p.store.waiting.wait(), 30)
    status, closed = await p.admin(p.other, "POST", f"/sessions/{sid}/close", {})
    assert status == 200, closed
    p.store.go()
    with pytest.raises(anthropic.APIStatusError) as failed:
        await asyncio.wait_for(held_turn, 30)

    assert failed.value.status_code == 529
    assert failed.value.response.headers.get("x-should-retry") != "false"
    assert "closed by another process" in failed.value.message
    responses = await _events(p, sid, ev.ResponseSent)
    assert [r.request_id for r in responses] == [answer0.id]  # the held turn: unanswered
    assert (await p.h.types(sid))[-1] == "session_closed"  # nothing after the close
    exported = _exported(p.sqlite_url, tmp_path / "samples.jsonl")
    assert [msgspec.convert(s, Sample) for s in closed["samples"]] == exported[sid]


async def test_a_claim_that_keeps_losing_answers_a_retryable_529(pair: Pair) -> None:
    p = pair
    sid = await p.h.open_session()
    p.store.rival(ev.MessagesRequest)  # someone always writes first
    assert p.h.http is not None
    async with p.h.http.post(
        p.held.url + "/v1/chat/completions",
        json={"model": "m", "messages": [_user("hello")], "max_tokens": 20},
        headers={"Authorization": f"Bearer {sid}"},
    ) as resp:
        body = await resp.json()
        assert resp.status == 529, body
        assert resp.headers.get("x-should-retry") != "false"
    assert body["error"]["type"] != "api_error" and "retry" in body["error"]["message"]
    retried = (await p.health(p.held.url))["conflicts_retried"]
    types = await p.h.types(sid)
    assert "messages_request" not in types  # nothing of the request was kept
    assert retried > 0 and types.count("sandbox_event") == retried + 1  # bounded: then 529


async def test_a_close_that_keeps_losing_answers_a_retryable_529(pair: Pair) -> None:
    p = pair
    sid = await p.h.open_session()
    p.store.rival(ev.SessionClosed)
    status, body = await p.admin(p.held.url, "POST", f"/sessions/{sid}/close", {})
    assert status == 529 and body["error"]["type"] == "overloaded_error", body
    assert "session_closed" not in await p.h.types(sid)
    status, body = await p.admin(p.other, "POST", f"/sessions/{sid}/close", {})
    assert status == 200, body  # the session can still be closed


@pytest.mark.parametrize("reopen", [True, False])
async def test_two_opens_of_one_new_id_race(pair: Pair, reopen: bool, tmp_path: Path) -> None:
    """Both servers open the same new id; the held one's opening loses. With `reopen`
    it becomes the next attempt, as if it had come second; without, a 409 that says so."""
    p = pair
    sid = f"sess_{uuid7().hex}"
    p.store.hold(ev.SessionOpened)
    body = {"session_id": sid, "reopen": reopen, "metadata": {"from": "held"}}
    task = asyncio.ensure_future(p.admin(p.held.url, "POST", "/sessions", body))
    await asyncio.wait_for(p.store.waiting.wait(), 30)
    status, first = await p.admin(p.other, "POST", "/sessions", {**body, "metadata": {}})
    assert status == 201, first
    p.store.go()
    status, second = await asyncio.wait_for(task, 30)
    opened = await _events(p, sid, ev.SessionOpened)
    if not reopen:
        assert status == 409 and "opened concurrently" in second["error"]["message"]
        assert [o.attempt for o in opened] == [0]
        return
    assert status == 201, second
    assert [o.attempt for o in opened] == [0, 1]
    assert opened[1].metadata == {"from": "held"}
    # The held server serves the new attempt; its samples are the log's.
    answer = await p.ask(p.held.url, sid, [_user("first question")])
    assert answer.content
    await p.close_and_compare(p.other, sid, tmp_path)
