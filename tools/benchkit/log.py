"""A synthetic session's events written through the real store, as the live server writes them.

Per turn a MessagesRequest, ChainDecision, RenderedInput (stored with
`extends=` the chain's previous full sequence, so only new tokens are
stored), GenerateResult (output ids + float32 logprobs) and ResponseSent;
random token ids over a 49,152 vocabulary (seeded). What `replay` and a
session's close read back: bench_replay and bench_close measure that.
"""

from __future__ import annotations

import numpy as np

from recorder.log.events import (
    ArrayRef,
    ChainDecision,
    GenerateResult,
    MessagesRequest,
    NewEvent,
    RenderedInput,
    ResponseSent,
    RewardAssigned,
    SessionClosed,
    SessionOpened,
)
from recorder.log.store import EventStore

VOCAB = 49_152


async def write_session(
    store: EventStore,
    sid: str,
    turns: int,
    new_tokens: int,
    out_tokens: int,
    seed: int,
    interleaved: bool = True,
) -> int:
    """Write one session; `interleaved`: one append per turn, as the live server does."""
    rng = np.random.default_rng(seed)
    body = await store.put_array(np.frombuffer(b'{"bench": true}', dtype=np.uint8))
    events: list[NewEvent] = [
        NewEvent(event=SessionOpened(session_id=sid, metadata={"bench": True}, context_length=None))
    ]
    full: ArrayRef | None = None
    written = 0
    for t in range(turns):
        if interleaved:
            await store.append(sid, events)
            written += len(events)
            events = []
        new = rng.integers(0, VOCAB, new_tokens, dtype=np.int32)
        inp = await store.put_array(new, extends=full)
        out = rng.integers(0, VOCAB, out_tokens, dtype=np.int32)
        lps = -rng.random(out_tokens, dtype=np.float32)
        out_ref = await store.put_array(out)
        lp_ref = await store.put_array(lps)
        full = await store.put_array(out, extends=inp)
        rid = f"{sid}-{t}"
        events += [
            NewEvent(
                event=MessagesRequest(
                    request_id=rid, turn=t, body=body, system_digest="main", n_messages=2 * t + 1
                )
            ),
            NewEvent(
                event=ChainDecision(
                    rules_version="bench",
                    request_id=rid,
                    turn=t,
                    chain_id=0,
                    action="new" if t == 0 else "extend",
                    reason="first" if t == 0 else "extends",
                )
            ),
            NewEvent(
                event=RenderedInput(
                    request_id=rid,
                    turn=t,
                    chain_id=0,
                    input_ids=inp,
                    prefix_len=inp.length - new_tokens,
                )
            ),
            NewEvent(
                event=GenerateResult(
                    request_id=rid,
                    turn=t,
                    attempt=0,
                    rid=f"{t:032x}",
                    output_ids=out_ref,
                    logprobs=lp_ref,
                    finish_reason="stop",
                    weight_version="1",
                )
            ),
            NewEvent(
                event=ResponseSent(
                    request_id=rid,
                    turn=t,
                    content=[{"type": "text", "text": "ok"}],
                    stop_reason="end_turn",
                )
            ),
        ]
    events += [NewEvent(event=RewardAssigned(reward=1.0)), NewEvent(event=SessionClosed())]
    for i in range(0, len(events), 500):
        await store.append(sid, events[i : i + 500])
    return written + len(events)
