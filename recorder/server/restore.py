"""Rebuilding a session's live state from its log (after a restart or a failure).

Only the latest attempt counts (the events after the last SessionOpened).

Two ways to the same state, the second a shortcut checked against the first:

- Replay (the reference): chains are rebuilt by running the pipeline's own
  pure calls over each answered turn: `plan_turn` on the recorded request
  body, then `commit_turn` with the recorded engine input and output tokens,
  so the rebuilt chains hold exactly the tokens the engine saw, whatever the
  template does today. Its cost grows with the session's history: every
  body is read and parsed, every turn planned (256 sessions of 100 turns
  all answered 13.8 s after a restart on SQLite, 13.0 s on Postgres, in
  tools/bench_replicas.py on a shared 2-core machine).
- Snapshot: every answered turn ends with a `StateSnapshot` event in the
  same append as its ResponseSent (`snapshot.py`). A restart reads the
  session from its newest snapshot on (`EventStore.read_session_from_last`:
  one query, a few rows), fetches each chain's tokens in one query
  (`get_arrays(..., cold=True)`), and replays only the turns after the
  snapshot (none, unless the last turn's snapshot could not be built). Cost
  per session: two queries and its chains' tokens, whatever its history
  (the same bench: 2.1 s on SQLite, 2.3 s on Postgres, where the same 256
  turns on a warm server take 1.4 s and 1.8 s).

A snapshot is used only if it checks out against the log: the format this
code writes, the seq it was written for equal to where it was read, every
chain's tokens present, intact and as long as its last turn says. Otherwise
the warning says why and the session is replayed from the whole log; a
kill -9 can never leave a half snapshot (it is in the turn's own append).
Tests prove both ways give the same chains and the same next engine input
(tests/server/test_snapshots.py).

`catch_up` applies the same replay to only the events a cached state has not
seen (another replica's turns on a shared Postgres), so a state at the head
costs one index read and a state one turn behind costs one turn's replay;
one more than `CATCH_UP_REPLAY_TURNS` turns behind, it starts from the
newest snapshot among those events instead.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from recorder.dialects.chat import find_dispatches
from recorder.dialects.translate import response_message_digest
from recorder.log import events as ev
from recorder.log.events import ArrayRef, RecordedEvent
from recorder.log.store.base import CorruptArray
from recorder.model.tokens import SessionChains, commit_turn, note_dispatch, plan_turn, token_array
from recorder.server.deltas import remember_refs
from recorder.server.journal import Journal
from recorder.server.overrides import InvalidOverride, SessionOverrides, overrides_from_config
from recorder.server.sessions import SessionState, forget_tokens
from recorder.server.snapshot import (
    SnapshotUnusable,
    chain_refs,
    decode_snapshot,
    restore_chains,
    restored_records,
    token_refs,
)

if TYPE_CHECKING:
    from recorder.dialects.base import History
    from recorder.server.context import ServerContext

log = logging.getLogger("recorder.server")

# Where a restart starts reading a session: its newest snapshot or attempt.
_RESTART_POINTS = ("state_snapshot", "session_opened")
# A catch-up replays at most this many turns before the newest snapshot
# among them; more, and it restores from that snapshot instead.
CATCH_UP_REPLAY_TURNS = 4

# Answered turns whose arrays (body, engine input, outputs) are read in one
# store call: one round trip per batch instead of per turn, memory bounded.
ARRAY_BATCH_TURNS = 32


@dataclass
class _Turn:
    request: ev.MessagesRequest | None = None
    decision: ev.ChainDecision | None = None
    rendered: ev.RenderedInput | None = None
    outputs: list[ArrayRef] = field(default_factory=list)
    response: ev.ResponseSent | None = None


async def load_session_state(ctx: ServerContext, session_id: str) -> SessionState | None:
    """The session's state as the log says, or None if it was never opened."""
    if ctx.config.restore_from_snapshots:
        events = await ctx.store.read_session_from_last(session_id, _RESTART_POINTS)
        if events and isinstance(events[0].event, ev.StateSnapshot):
            state = await _from_snapshot(ctx, session_id, events)
            if state is not None:
                return state
            events = await ctx.store.read_session(session_id)
        elif events and events[0].seq > 0:
            # A later attempt: turn numbers go on from the earlier ones.
            events = await ctx.store.read_session(session_id)
    else:
        events = await ctx.store.read_session(session_id)
    return await _from_log(ctx, session_id, events)


async def _from_log(
    ctx: ServerContext, session_id: str, events: list[RecordedEvent]
) -> SessionState | None:
    """The state replayed from the session's events (the reference way)."""
    opened_at = _last_opened(events)
    if opened_at is None:
        return None
    opened = events[opened_at].event
    assert isinstance(opened, ev.SessionOpened)
    tail = events[opened_at:]
    state = SessionState(
        session_id=session_id,
        journal=Journal(ctx.store, session_id, next_seq=events[-1].seq + 1),
        metadata=dict(opened.metadata),
        engine_url=opened.engine_url or ctx.engine.pick(session_id),
        attempt=opened.attempt,
        opened_ts=events[opened_at].ts,
        next_turn=_next_turn(events),
        overrides=_overrides(opened.config),
    )
    closed = next((r.event for r in tail if isinstance(r.event, ev.SessionClosed)), None)
    if closed is not None:
        state.status = "closed"
        state.close_status = closed.status
        return state
    state.chains = SessionChains()
    await _rebuild_chains(ctx, state, tail)
    return state


async def _from_snapshot(
    ctx: ServerContext, session_id: str, events: list[RecordedEvent]
) -> SessionState | None:
    """The state from the snapshot `events[0]` plus the events after it; None (logged)
    if the snapshot does not check out."""
    snapshot = events[0]
    try:
        live = decode_snapshot(snapshot)
        state = SessionState(
            session_id=session_id,
            journal=Journal(ctx.store, session_id, next_seq=events[-1].seq + 1),
            metadata=dict(live.metadata),
            engine_url=live.engine_url or ctx.engine.pick(session_id),
            attempt=live.attempt,
            opened_ts=live.opened_ts,
            next_turn=live.next_turn,
            turns_completed=live.turns_completed,
            overrides=live.overrides,
        )
        if not _closed_in(events):
            tokens = await ctx.store.get_arrays(token_refs(live), cold=True)
            state.chains = restore_chains(live, tokens)
            state.chain_refs = chain_refs(live)
            state.snapshot_records = restored_records(live, state.chains)
    except (SnapshotUnusable, CorruptArray) as exc:
        log.warning(
            "session %s: its state snapshot at seq %d is not usable (%s); replaying the whole log",
            session_id,
            snapshot.seq,
            exc,
        )
        return None
    return await _advance(ctx, state, events[1:])


async def catch_up(ctx: ServerContext, state: SessionState) -> SessionState:
    """`state` advanced to the log's head (called under the session's locks).

    The cached state always ends at a turn boundary (a turn that failed half
    way marks it suspect and it is reloaded), so the events after it are
    whole turns of other processes, or one they left half done, which counts
    as unanswered exactly as after a restart. A new attempt (SessionOpened),
    a gap, or the rest of a turn the state already counted (appended late by
    a process whose lock was lost, see journal.py) reloads the session; far
    behind, the newest snapshot among the new events is the shortcut.
    """
    events = await ctx.store.read_session(state.session_id, from_seq=state.next_seq)
    if not events:
        return state
    reopened = any(isinstance(r.event, ev.SessionOpened) for r in events)
    late = any(getattr(r.event, "turn", state.next_turn) < state.next_turn for r in events)
    if reopened or late or events[0].seq != state.next_seq or state.status == "closed":
        loaded = await load_session_state(ctx, state.session_id)
        assert loaded is not None, "a session's events never disappear"
        return loaded
    newest = _newest_snapshot(events)
    if (
        ctx.config.restore_from_snapshots
        and newest is not None
        and len(_answered_turns(events[:newest])) > CATCH_UP_REPLAY_TURNS
    ):
        loaded = await _from_snapshot(ctx, state.session_id, events[newest:])
        if loaded is not None:
            return loaded
    return await _advance(ctx, state, events)


async def _advance(
    ctx: ServerContext, state: SessionState, events: list[RecordedEvent]
) -> SessionState:
    """`state` moved past `events`, the session's next events (no new attempt among them)."""
    if not events:
        return state
    state.journal.next_seq = events[-1].seq + 1
    state.next_turn = max(state.next_turn, _next_turn(events))
    closed = next((r.event for r in events if isinstance(r.event, ev.SessionClosed)), None)
    if closed is not None:
        state.status = "closed"
        state.close_status = closed.status
        forget_tokens(state)
        return state
    await _rebuild_chains(ctx, state, events)
    return state


def _closed_in(events: list[RecordedEvent]) -> bool:
    return any(isinstance(r.event, ev.SessionClosed) for r in events)


def _newest_snapshot(events: list[RecordedEvent]) -> int | None:
    for i in range(len(events) - 1, -1, -1):
        if isinstance(events[i].event, ev.StateSnapshot):
            return i
    return None


def _overrides(config: dict[str, Any]) -> SessionOverrides:
    try:
        return overrides_from_config(config)
    except InvalidOverride:  # validated at open; a hand-written log may hold anything
        log.warning("ignoring an invalid session config in the log: %s", config)
        return SessionOverrides()


def _last_opened(events: list[RecordedEvent]) -> int | None:
    for i in range(len(events) - 1, -1, -1):
        if isinstance(events[i].event, ev.SessionOpened):
            return i
    return None


def _next_turn(events: list[RecordedEvent]) -> int:
    turns = [getattr(r.event, "turn", -1) for r in events]
    return max(turns, default=-1) + 1


def _answered_turns(events: list[RecordedEvent]) -> list[_Turn]:
    turns: dict[int, _Turn] = defaultdict(_Turn)
    for r in events:
        e = r.event
        if isinstance(e, ev.MessagesRequest):
            turns[e.turn].request = e
        elif isinstance(e, ev.ChainDecision):
            turns[e.turn].decision = e
        elif isinstance(e, ev.RenderedInput):
            turns[e.turn].rendered = e
        elif isinstance(e, ev.GenerateResult):
            turns[e.turn].outputs.append(e.output_ids)
        elif isinstance(e, ev.ResponseSent) and e.status == 200:
            turns[e.turn].response = e
    return [
        t
        for _, t in sorted(turns.items())
        if t.request is not None and t.rendered is not None and t.response is not None
    ]


async def _rebuild_chains(
    ctx: ServerContext, state: SessionState, events: list[RecordedEvent]
) -> None:
    from recorder.server.history import log_history

    # `events` may be only what a catch-up missed: a Responses request's
    # previous_response_id is resolved from the session's whole log, read on demand.
    history = log_history(
        ctx.store, lambda: ctx.store.read_session(state.session_id), state.response_conversations
    )
    turns = _answered_turns(events)
    for start in range(0, len(turns), ARRAY_BATCH_TURNS):
        batch = turns[start : start + ARRAY_BATCH_TURNS]
        arrays = await ctx.store.get_arrays([ref for turn in batch for ref in _refs(turn)])
        for turn in batch:
            body, input_ids, *outputs = arrays[: 2 + len(turn.outputs)]
            del arrays[: 2 + len(turn.outputs)]
            await _replay_turn(ctx, state, turn, body, input_ids, outputs, history)
    state.chains.next_chain_id = max(state.chains.next_chain_id, _max_chain_id(events) + 1)


def _refs(turn: _Turn) -> list[ArrayRef]:
    assert turn.request is not None and turn.rendered is not None
    return [turn.request.body, turn.rendered.input_ids, *turn.outputs]


async def _replay_turn(
    ctx: ServerContext,
    state: SessionState,
    turn: _Turn,
    body: np.ndarray,
    input_ids: np.ndarray,
    outputs: list[np.ndarray],
    history: History,
) -> None:
    """One answered turn through `plan_turn` and `commit_turn`, as the live server ran it."""
    from recorder.dialects import dialect_named

    assert turn.request is not None and turn.rendered is not None and turn.response is not None
    dialect = dialect_named(turn.request.dialect)
    chat, _ = await dialect.parse(body.tobytes(), cache=state.parse_cache, history=history)
    if turn.decision is not None:
        # Chain ids as recorded: a new chain takes the id the live server gave it.
        state.chains.next_chain_id = max(state.chains.next_chain_id, turn.decision.chain_id)
        if turn.decision.action == "new":
            state.chains.next_chain_id = turn.decision.chain_id
    plan = plan_turn(state.chains, chat, ctx.tokenizer)
    recorded = token_array(input_ids)
    if plan.input_ids != recorded:
        log.warning(
            "session %s turn %d: today's render differs from the recorded engine input; "
            "the rebuilt chain keeps the recorded tokens",
            state.session_id,
            turn.request.turn,
        )
        plan.action, plan.reason = "new", "diverged"
        plan.parent_chain_id, plan.prefix_len, plan.input_ids = None, 0, recorded
    output_ids = np.concatenate(outputs).astype(np.int64).tolist() if outputs else []
    content = turn.response.content
    chain = commit_turn(state.chains, plan, output_ids, response_message_digest(content))
    dispatches = find_dispatches(content)
    if dispatches:
        note_dispatch(state.chains, [d[0] for d in dispatches], [d[1] for d in dispatches])
    remember_refs(
        state.chain_refs, state.chains.chains, plan, chain.chain_id, turn.rendered.input_ids
    )
    state.turns_completed += 1


def _max_chain_id(events: list[RecordedEvent]) -> int:
    ids = [r.event.chain_id for r in events if isinstance(r.event, ev.ChainDecision)]
    return max(ids, default=-1)
