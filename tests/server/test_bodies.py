"""Request bodies of a live session: stored as deltas of the previous body, read back exactly."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from recorder.log import events as ev
from recorder.log.store import StoreOptions, open_store
from recorder.log.store import arrays as codec
from recorder.log.store.sql import MAX_BASIS_DEPTH
from tests.server.conftest import SYSTEM, TOOLS, Harness

TURNS = MAX_BASIS_DEPTH + 4  # past one bound on the basis chain


def agent_body(messages: list[dict[str, Any]]) -> bytes:
    """Bytes as an agent sends them: the cache breakpoint on the newest message."""
    last = {**messages[-1], "content": [{**messages[-1]["content"][0]}]}
    last["content"][0]["cache_control"] = {"type": "ephemeral"}
    body = {
        "model": "m",
        "max_tokens": 32,
        "messages": [*messages[:-1], last],
        "system": SYSTEM,
        "tools": TOOLS,
        "metadata": {"user_id": "u"},
    }
    return json.dumps(body, indent=1).encode()


async def test_session_bodies_read_back_as_sent(harness: Harness, sqlite_url: str) -> None:
    h = harness
    sid = await h.open_session()
    assert h.http is not None
    messages: list[dict[str, Any]] = []
    sent: list[bytes] = []
    for turn in range(TURNS):
        text = f"turn {turn}: " + " ".join(f"note{turn}-{i}" for i in range(20))
        messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
        body = agent_body(messages)
        h.engine.push(f"ack {turn}")
        async with h.http.post(
            h.url + "/v1/messages",
            data=body,
            headers={"Authorization": f"Bearer {sid}", "Content-Type": "application/json"},
        ) as resp:
            reply = await resp.json()
            assert resp.status == 200, reply
        sent.append(body)
        answer = reply["content"][0]["text"]
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})

    requests = await h.payloads(sid, ev.MessagesRequest)
    assert [r.turn for r in requests] == list(range(TURNS))  # type: ignore[attr-defined]
    refs = [r.body for r in requests]  # type: ignore[attr-defined]
    async with await open_store(sqlite_url, options=StoreOptions(piece_cache_bytes=0)) as cold:
        got = await cold.get_arrays(refs)
    assert [a.tobytes() for a in got] == sent

    db = sqlite3.connect(sqlite_url.split("///", 1)[1])
    try:
        ((on_basis, deepest),) = db.execute(
            "SELECT COUNT(*), MAX(basis_depth) FROM arrays WHERE codec = ? AND dtype = 'uint8'",
            (codec.CODEC_COPY_BASIS,),
        )
    finally:
        db.close()
    # Later bodies' tails (system prompt, tools) are copies of where the first
    # was stored: one basis hop for a cold read, however many turns.
    assert on_basis >= TURNS - 2
    assert deepest == 1 <= MAX_BASIS_DEPTH
