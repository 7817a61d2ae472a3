"""Restoring a session from its newest state snapshot equals replaying its whole log (issue 15).

Each scenario runs through the server (official SDK, scripted engine), then a
restarted server builds the session both ways: from its snapshot (the
default) and by the full replay (`restore_from_snapshots=False`, the
reference). Chains must be equal token by token, with the same counters,
and the next request must get the same ChainDecision and engine input, on
both stores. Snapshots that do not check out (undecodable, another format,
for another seq, naming a missing array) fall back to the replay, logged.
"""

from __future__ import annotations

import copy
import json
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import msgspec
import pytest

from recorder.dialects.translate import parse_request
from recorder.log import events as ev
from recorder.log.events import ArrayRef, NewEvent
from recorder.log.store import arrays as codec
from recorder.model.tokens import plan_turn
from recorder.server import restore, snapshot, turn
from recorder.server.deltas import MAX_CHAIN_REFS
from recorder.server.restore import load_session_state
from recorder.server.sessions import SessionState
from tests.server.conftest import Harness, array_rows, tool_call_text
from tests.server.test_chain_identity import COMPACT, SUB_SYSTEM
from tests.server.test_e2e import SYSTEM, TOOLS, ask, echo, tool_result

# A scenario drives one session and returns (its id, the next request's messages, its kwargs).
Scenario = Callable[[Harness], Awaitable[tuple[str, list[dict[str, Any]], dict[str, Any]]]]


async def coding(h: Harness) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """Tool calls and their results, several turns on one chain."""
    sid = await h.open_session(metadata={"task": "coding"}, config={"max_turns": 50})
    client = h.client(sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the bug in a.py."}]
    for k in range(4):
        h.engine.push(tool_call_text("Bash", {"command": f"cat a.py # {k}"}))
        answer = await ask(client, messages, stream=k % 2 == 0)
        messages += [echo(answer), tool_result(answer.content[-1].id, f"line {k}\n" * 20)]
    return sid, messages, {}


async def subagent(h: Harness) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """A background subagent: dispatch, its own chain, then the main line goes on."""
    sid = await h.open_session()
    client = h.client(sid)
    prompt = "SUBTASK: count the lines of hello.py"
    h.engine.push(
        tool_call_text("Agent", {"description": "Count lines", "prompt": prompt}),
        "The agent runs in the background; I will wait.",
        "SUBRESULT: 5 lines.",
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Count the lines."}]
    first = await ask(client, messages, stream=False)
    dispatch = first.content[-1].id
    messages += [echo(first), tool_result(dispatch, f"Async agent launched ({dispatch})")]
    waiting = await ask(client, messages, stream=False)
    await ask(client, [{"role": "user", "content": prompt}], stream=False, system=SUB_SYSTEM)
    messages += [echo(waiting), {"role": "user", "content": "<task-notification>done"}]
    return sid, messages, {}


async def compaction(h: Harness) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """A summary request right after a tool result, then the conversation from the summary."""
    sid = await h.open_session()
    client = h.client(sid)
    h.engine.push(tool_call_text("Bash", {"command": "echo marker"}), "Done.", "Summary: ...")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say the marker."}]
    first = await ask(client, messages, stream=False)
    messages += [echo(first), tool_result(first.content[-1].id, "marker")]
    await ask(client, messages, stream=False)
    summary_request = copy.deepcopy(messages)
    summary_request[-1]["content"].append({"type": "text", "text": COMPACT})
    await ask(client, summary_request, stream=False)
    return sid, [{"role": "user", "content": "This session continues from a summary: ..."}], {}


async def diverged(h: Harness) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """An earlier message edited (a fork beside the first chain), then the old chain resumed."""
    sid = await h.open_session()
    client = h.client(sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Write a haiku."}]
    for k in range(3):
        answer = await ask(client, messages, stream=False)
        messages += [echo(answer), {"role": "user", "content": f"Another, {k}."}]
    forked = copy.deepcopy(messages[:3])
    forked[2]["content"] = "Write a limerick instead."
    await ask(client, forked, stream=False)
    return sid, messages, {}


SCENARIOS: list[Scenario] = [coding, subagent, compaction, diverged]


async def plain_turns(h: Harness, turns: int) -> tuple[str, list[dict[str, Any]]]:
    """A new session of `turns` plain turns; (its id, the next request's messages)."""
    sid = await h.open_session()
    client = h.client(sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Start."}]
    for k in range(turns):
        answer = await ask(client, messages, stream=False)
        messages += [echo(answer), {"role": "user", "content": f"Step {k}."}]
    return sid, messages


async def both_ways(h: Harness, sid: str) -> tuple[SessionState, SessionState]:
    """(from the snapshot, from the whole log), each as a freshly restarted server builds it."""
    await h.restart()
    from_snapshot = await load_session_state(h.ctx, sid)
    await h.restart()
    h.ctx.config = replace(h.config, restore_from_snapshots=False)
    try:
        replayed = await load_session_state(h.ctx, sid)
    finally:
        h.ctx.config = h.config
    assert from_snapshot is not None and replayed is not None
    return from_snapshot, replayed


def assert_same_state(a: SessionState, b: SessionState) -> None:
    assert a.chains is not None and b.chains is not None
    assert a.chains.main_chain_id == b.chains.main_chain_id
    assert a.chains.next_chain_id == b.chains.next_chain_id
    assert a.chains.pending_dispatches == b.chains.pending_dispatches
    assert a.chains.clock == b.chains.clock
    assert sorted(a.chains.chains) == sorted(b.chains.chains)
    for chain_id, chain in a.chains.chains.items():
        assert chain == b.chains.chains[chain_id]  # tokens, boundaries, digests, ... all fields
    assert a.chains == b.chains
    fields = ("next_seq", "next_turn", "turns_completed", "attempt", "metadata", "overrides")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    assert (a.status, a.engine_url) == (b.status, b.engine_url)
    # The live server's clock at open, vs the SessionOpened event's stamp a moment later.
    assert a.opened_ts == pytest.approx(b.opened_ts, abs=1.0)


def next_body(messages: list[dict[str, Any]], kw: dict[str, Any]) -> bytes:
    body = {"model": "test-model", "max_tokens": 256, "system": SYSTEM, "tools": TOOLS}
    return json.dumps({**body, **kw, "messages": messages}).encode()


async def assert_same_next_turn(
    h: Harness, sid: str, states: tuple[SessionState, SessionState], messages: list[Any], kw: Any
) -> None:
    """Both states plan the next request alike, and the server (from its snapshot) serves it so."""
    chat = parse_request(next_body(messages, kw))
    plans = [plan_turn(copy.deepcopy(s.chains), chat, h.tokenizer) for s in states]
    a, b = (msgspec.structs.asdict(p) for p in plans)
    assert a == b
    await h.restart()
    await ask(h.client(sid), messages, stream=False, **kw)
    decision = (await h.payloads(sid, ev.ChainDecision))[-1]
    rendered = (await h.payloads(sid, ev.RenderedInput))[-1]
    assert (decision.chain_id, decision.action, decision.reason) == (
        plans[0].chain_id,
        plans[0].action,
        plans[0].reason,
    )
    assert list(await h.array(rendered.input_ids)) == list(plans[0].input_ids)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
async def test_snapshot_restore_equals_full_replay(
    any_harness: Harness, scenario: Scenario
) -> None:
    h = any_harness
    sid, messages, kw = await scenario(h)
    assert (await h.types(sid))[-1] == "state_snapshot"
    states = await both_ways(h, sid)
    assert_same_state(*states)
    await assert_same_next_turn(h, sid, states, messages, kw)


async def _valid_snapshot(h: Harness, sid: str) -> tuple[ev.RecordedEvent, snapshot.LiveState]:
    record = [r for r in await h.events(sid) if isinstance(r.event, ev.StateSnapshot)][-1]
    return record, snapshot.decode_snapshot(record)


async def _append(h: Harness, sid: str, *events: ev.AnyEvent) -> None:
    head = (await h.events(sid))[-1].seq + 1
    await h.store.append(sid, [NewEvent(event=e) for e in events], expected_seq=head)


def _bad_snapshots(
    record: ev.RecordedEvent, live: snapshot.LiveState, next_seq: int
) -> dict[str, ev.StateSnapshot]:
    encode = msgspec.msgpack.encode
    missing = ArrayRef(b"\x00" * 16, live.chains[0].tokens.length)
    lost_tokens = replace_chain_tokens(live, missing, next_seq)
    return {
        "undecodable": ev.StateSnapshot(format=snapshot.SNAPSHOT_FORMAT, state=b"\xc1garbage"),
        "other format": ev.StateSnapshot(format=snapshot.SNAPSHOT_FORMAT + 1, state=b""),
        "other seq": ev.StateSnapshot(format=snapshot.SNAPSHOT_FORMAT, state=encode(live)),
        "missing tokens": ev.StateSnapshot(
            format=snapshot.SNAPSHOT_FORMAT, state=encode(lost_tokens)
        ),
    }


def replace_chain_tokens(live: snapshot.LiveState, ref: ArrayRef, seq: int) -> snapshot.LiveState:
    first = msgspec.structs.replace(live.chains[0], tokens=ref)
    return msgspec.structs.replace(live, seq=seq, chains=[first, *live.chains[1:]])


@pytest.mark.parametrize("damage", ["undecodable", "other format", "other seq", "missing tokens"])
async def test_a_snapshot_that_does_not_check_out_falls_back_to_the_replay(
    any_harness: Harness, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    h = any_harness
    sid, messages, kw = await coding(h)
    record, live = await _valid_snapshot(h, sid)
    next_seq = (await h.events(sid))[-1].seq + 1
    await _append(h, sid, _bad_snapshots(record, live, next_seq)[damage])
    with caplog.at_level(logging.WARNING, logger="recorder.server"):
        states = await both_ways(h, sid)
    assert f"its state snapshot at seq {next_seq} is not usable" in caplog.text
    assert_same_state(*states)
    await assert_same_next_turn(h, sid, states, messages, kw)


async def test_turns_after_the_newest_snapshot_are_replayed_alone(
    any_harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Turns without a snapshot (their snapshot could not be built) follow the newest one:
    a restart restores that snapshot and replays only those turns."""
    h = any_harness
    sid = await h.open_session()
    client = h.client(sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Count to ten."}]
    for k in range(5):
        if k == 3:
            monkeypatch.setattr(turn, "add_snapshot", _broken)
        answer = await ask(client, messages, stream=False)
        messages += [echo(answer), {"role": "user", "content": f"Go on from {k}."}]
    types = await h.types(sid)
    assert types.count("state_snapshot") == 3 and types[-1] == "response_sent"
    replayed_turns: list[int] = []
    real = restore._replay_turn

    async def counting(ctx: Any, state: Any, t: Any, *args: Any) -> None:
        replayed_turns.append(t.request.turn)
        await real(ctx, state, t, *args)

    monkeypatch.setattr(restore, "_replay_turn", counting)
    await h.restart()
    from_snapshot = await load_session_state(h.ctx, sid)
    assert replayed_turns == [3, 4]
    replayed_turns.clear()
    _, replayed = await both_ways(h, sid)
    assert replayed_turns == [3, 4, 0, 1, 2, 3, 4]  # from the snapshot, then the whole log
    assert from_snapshot is not None
    assert_same_state(from_snapshot, replayed)
    monkeypatch.undo()
    await assert_same_next_turn(h, sid, (from_snapshot, replayed), messages, {})


def _broken(state: Any) -> None:
    raise RuntimeError("snapshot builder broken (test)")


async def test_a_turn_cut_off_after_the_snapshot_counts_as_unanswered(
    any_harness: Harness,
) -> None:
    """kill -9 in the middle of the next turn: its first events follow the snapshot."""
    h = any_harness
    sid, messages, kw = await coding(h)
    events = await h.events(sid)
    last = max(r.event.turn for r in events if isinstance(r.event, ev.MessagesRequest))
    cut = [
        msgspec.structs.replace(r.event, turn=last + 1, request_id="msg_cut")
        for r in events
        if isinstance(r.event, ev.MessagesRequest | ev.ChainDecision | ev.RenderedInput)
        and r.event.turn == last
    ]
    await _append(h, sid, *cut)
    states = await both_ways(h, sid)
    assert_same_state(*states)
    assert states[0].next_turn == last + 2
    await assert_same_next_turn(h, sid, states, messages, kw)


async def test_a_closed_session_restores_closed_without_tokens(any_harness: Harness) -> None:
    h = any_harness
    sid, _, _ = await coding(h)
    await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    states = await both_ways(h, sid)
    for state in states:
        assert state.status == "closed" and state.chains is None
    assert states[0].next_seq == states[1].next_seq


async def test_the_reducer_ignores_snapshots(any_harness: Harness) -> None:
    """Samples are the same bytes with or without the snapshot events in the log."""
    from replay.load import load_session
    from replay.reducer import reduce_session
    from replay.rules import Rules

    h = any_harness
    sid, _, _ = await subagent(h)
    await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    log = await load_session(h.store, sid)
    assert any(isinstance(r.event, ev.StateSnapshot) for r in log.events)
    without = [r for r in log.events if not isinstance(r.event, ev.StateSnapshot)]
    full, stripped = (reduce_session(e, log.arrays, Rules()) for e in (log.events, without))
    assert full.samples and msgspec.json.encode(full.samples) == msgspec.json.encode(
        stripped.samples
    )
    assert full.diagnostics == stripped.diagnostics


@pytest.mark.parametrize(("behind", "via_snapshot"), [(2, False), (6, True)])
async def test_catch_up_far_behind_starts_from_the_newest_snapshot(
    any_harness: Harness, monkeypatch: pytest.MonkeyPatch, behind: int, via_snapshot: bool
) -> None:
    """A replica's cached state `behind` turns back: replayed turn by turn when close,
    restored from the newest snapshot among the new events when far; the same state."""
    h = any_harness
    sid = await h.open_session()
    client = h.client(sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Start."}]
    answer = await ask(client, messages, stream=False)
    stale = await load_session_state(h.ctx, sid)  # what another replica holds
    assert stale is not None
    for k in range(behind):
        messages += [echo(answer), {"role": "user", "content": f"Step {k}."}]
        answer = await ask(client, messages, stream=False)
    used: list[int] = []
    real = restore._from_snapshot

    async def spy(ctx: Any, session_id: str, events: Any) -> Any:
        used.append(events[0].seq)
        return await real(ctx, session_id, events)

    monkeypatch.setattr(restore, "_from_snapshot", spy)
    caught_up = await restore.catch_up(h.ctx, stale)
    assert bool(used) == via_snapshot
    monkeypatch.undo()
    _, replayed = await both_ways(h, sid)
    assert_same_state(caught_up, replayed)


async def test_a_long_chain_reads_through_few_pieces(harness: Harness, sqlite_url: str) -> None:
    """Two pieces per turn (input, output) would make a restart read 2 x turns pieces per
    chain; every SPINE_TURNS turns the tokens go back to one piece per SPINE_TURNS turns."""
    h = harness
    turns = 4 * snapshot.SPINE_TURNS + 3
    sid, _ = await plain_turns(h, turns)
    _, live = await _valid_snapshot(h, sid)
    rows = array_rows(sqlite_url)
    depth, digest = 0, live.chains[0].tokens.digest
    while digest is not None:
        depth, digest = depth + 1, rows[digest][0]
    assert depth <= turns // snapshot.SPINE_TURNS + 2 * snapshot.SPINE_TURNS + 1 < 2 * turns
    states = await both_ways(h, sid)
    assert_same_state(*states)


async def test_snapshots_stay_small_as_the_session_grows(harness: Harness) -> None:
    """A turn's snapshot names its chain's digests and boundaries by ref, stored as deltas:
    its event does not grow with the session's turns (whole lists would grow with their
    square over a session)."""
    h = harness
    turns = max(snapshot.RECORD_SPINE, MAX_CHAIN_REFS) + 8
    sid, _ = await plain_turns(h, turns)
    sizes = [len(e.state) for e in await h.payloads(sid, ev.StateSnapshot)]
    assert len(sizes) == turns
    # Flat once the chain's stored prefixes (a bounded list of refs) are all there.
    assert max(sizes[-6:]) - min(sizes[-6:]) < 16, sizes
    states = await both_ways(h, sid)
    assert_same_state(*states)


async def test_a_restored_session_goes_on_storing_records_as_deltas(
    harness: Harness, sqlite_url: str
) -> None:
    """The first snapshot after a restart adds only its turn's digests and boundaries, as
    before it: each record is a delta on the restored one, one piece deeper. Written whole
    it would cost a session's whole history once per restart."""
    h = harness
    sid, messages = await plain_turns(h, 3)
    _, before = await _valid_snapshot(h, sid)
    await h.restart()
    await ask(h.client(sid), messages, stream=False)
    _, after = await _valid_snapshot(h, sid)
    rows = array_rows(sqlite_url)
    old, new = before.chains[0], after.chains[0]
    for field, depth in (("message_digests", "digests_depth"), ("boundaries", "boundaries_depth")):
        assert rows[getattr(new, field).digest][0] == getattr(old, field).digest, field
        assert getattr(new, depth) == getattr(old, depth) + 1 == 4, field
    states = await both_ways(h, sid)
    assert_same_state(*states)


async def test_a_snapshot_without_record_depths_is_restored_and_stores_records_whole(
    harness: Harness, sqlite_url: str
) -> None:
    """A snapshot written before record depths were kept decodes (they default to the
    spine) and the next turn stores its records whole: the pieces a restart reads stay
    bounded whatever the depth really was."""
    h = harness
    sid, messages = await plain_turns(h, 1)
    _, live = await _valid_snapshot(h, sid)
    head = (await h.events(sid))[-1].seq + 1
    old_chains = [msgspec.structs.astuple(c)[:-2] for c in live.chains]  # the older layout
    old = {**msgspec.structs.asdict(live), "seq": head, "chains": old_chains}
    restored = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=snapshot.LiveState)
    assert restored.chains[0].digests_depth == snapshot.RECORD_SPINE
    state = msgspec.msgpack.encode(old)
    await _append(h, sid, ev.StateSnapshot(format=snapshot.SNAPSHOT_FORMAT, state=state))
    await h.restart()
    await ask(h.client(sid), messages, stream=False)
    _, after = await _valid_snapshot(h, sid)
    rows = array_rows(sqlite_url)
    assert rows[after.chains[0].message_digests.digest][0] is None  # whole: a root piece
    assert after.chains[0].digests_depth == 1


def test_every_form_of_message_digest_packs_and_unpacks() -> None:
    """Plain, with reasoning, with calls alone, both: stored as raw bytes, read back equal."""
    from recorder.dialects.chat import message_digest

    calls = [{"id": "toolu_1", "type": "function", "function": {"name": "Bash", "arguments": {}}}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "reasoning_content": "think"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": calls,
            "reasoning_content": "t",
        },
    ]
    digests = [message_digest(m) for m in messages]
    assert [d.count("|") for d in digests] == [0, 0, 1, 1]
    packed = snapshot._digest_array(digests)
    assert snapshot._digests_of(packed) == digests
    assert packed.size == sum(1 + 1 + 16 * (1 + d.count("+") + d.count("|")) for d in digests)


async def test_spine_pieces_stay_out_of_the_piece_cache(harness: Harness) -> None:
    """A spine piece repeats tokens whose per-turn pieces the piece cache holds: it is
    stored but not cached, so the cache holds each of a chain's tokens once (cached
    spines held ~1.6x the tokens of an open 100k session), and a restart reads it."""
    h = harness
    turns = 2 * snapshot.SPINE_TURNS + 1
    sid, _ = await plain_turns(h, turns)
    state = h.ctx.registry.cached(sid)
    assert state is not None and state.chains.main is not None
    main = state.chains.main
    outputs = sum(b.end_len - b.input_len for b in main.boundaries)
    cache = h.store.piece_cache  # type: ignore[attr-defined]
    cached = [p for p in cache._items.values() if p.dtype == "int32"]
    # The chain's tokens once, the engine's output ids (their own arrays) and each
    # snapshot's boundary record (4 int32 per turn).
    assert sum(len(p.suffix) for p in cached) <= len(main.tokens) + outputs + 4 * turns
    states = await both_ways(h, sid)
    assert_same_state(*states)


async def test_spines_name_the_per_turn_pieces_instead_of_repeating_their_tokens(
    harness: Harness, sqlite_url: str
) -> None:
    """Every SPINE_TURNS turns a chain's spine piece names the pieces its turns stored
    (`arrays.CODEC_CONCAT`), and a turn's output after its input names its output ids:
    each token is stored once, and a restart reads the same."""
    h = harness
    turns = 2 * snapshot.SPINE_TURNS + 1
    sid, _ = await plain_turns(h, turns)
    db = sqlite3.connect(sqlite_url.split("///", 1)[1])
    try:
        spines = db.execute(
            "SELECT length(data) FROM arrays WHERE dtype = 'int32' AND codec = ?",
            (codec.CODEC_CONCAT,),
        ).fetchall()
    finally:
        db.close()
    assert all(n % codec.DIGEST_SIZE == 0 for (n,) in spines)
    # Two spines of several pieces; each turn's output after its input names the
    # output ids its GenerateResult stored (one part).
    assert sum(n >= 2 * codec.DIGEST_SIZE for (n,) in spines) == 2
    assert sum(n == codec.DIGEST_SIZE for (n,) in spines) == turns
    states = await both_ways(h, sid)
    assert_same_state(*states)
