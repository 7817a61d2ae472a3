"""Events stored at an old schema version read back upcast to the current one."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

import msgspec

from recorder.log.events import RewardAssigned
from recorder.log.store import EventStore

RawExecute = Callable[..., Awaitable[list[tuple[object, ...]]]]


async def test_reward_v1_row_reads_as_v2(
    store: EventStore, store_url: str, raw_execute: RawExecute
) -> None:
    assert RewardAssigned.VERSION == 2
    v1 = msgspec.msgpack.encode({"type": "reward_assigned", "value": 0.25})
    event_id = uuid.uuid4()
    key = event_id.bytes if store_url.startswith("sqlite") else event_id
    await raw_execute(
        store_url,
        "INSERT INTO events (session_id, seq, event_id, type, version, ts, payload) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7)",
        "old",
        0,
        key,
        "reward_assigned",
        1,
        12.5,
        v1,
    )
    (got,) = await store.read_session("old")
    assert got.event == RewardAssigned(reward=0.25, detail={})
    assert got.version == 1 and got.event_id == event_id and got.ts == 12.5
    (page,) = await store.read_all()
    assert page == got


def test_messages_request_and_chain_decision_v1_read_as_today() -> None:
    """v1 MessagesRequest had no chat message / tool counts (unknown: None), v1 and v2 no
    answer keys (None); v1 ChainDecision reads unchanged (v2 only added the reason "side")."""
    from recorder.log.events import ArrayRef, ChainDecision, MessagesRequest, decode_event

    assert MessagesRequest.VERSION == 3 and ChainDecision.VERSION == 2
    body = ArrayRef(digest=b"\x01" * 16, length=3, dtype="uint8")
    v1 = msgspec.msgpack.encode(
        {"type": "messages_request", "request_id": "r", "turn": 0, "body": body, "n_messages": 3}
    )
    got = decode_event("messages_request", 1, v1)
    assert isinstance(got, MessagesRequest)
    assert got.n_messages == 3 and got.n_chat_messages is None and got.n_tools is None
    assert got.answer_keys is None
    v2 = msgspec.msgpack.encode(
        {"type": "messages_request", "request_id": "r", "turn": 1, "body": body, "n_tools": 2}
    )
    got = decode_event("messages_request", 2, v2)
    assert isinstance(got, MessagesRequest) and got.n_tools == 2 and got.answer_keys is None
    decision = {
        "type": "chain_decision",
        "rules_version": "live-1",
        "request_id": "r",
        "turn": 0,
        "chain_id": 2,
        "action": "new",
        "reason": "subagent",
        "dispatch_tool_use_id": "toolu_1",
    }
    old = decode_event("chain_decision", 1, msgspec.msgpack.encode(decision))
    assert old == ChainDecision(
        rules_version="live-1",
        request_id="r",
        turn=0,
        chain_id=2,
        action="new",
        reason="subagent",
        dispatch_tool_use_id="toolu_1",
    )
