"""A server that is its log's only writer skips the per-turn head check (issue 15).

`recorder serve` on SQLite holds the file's claim, so no other process
appends: the state it holds is the log's head, and reading the log before
each turn (one query) only finds nothing. `ServerConfig.sole_writer` says
so. Should another writer append anyway, the log still refuses the stale
turn's claim, and the turn is planned again from the new head: the client
gets its answer and the chain goes on from the other writer's turn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import pytest

from recorder.log import events as ev
from recorder.log.store import open_store
from recorder.model.tokenizer import Tokenizer
from tests.server.conftest import Harness, make_harness
from tests.server.test_e2e import ask, echo
from tests.server.test_snapshots import plain_turns


class CountedReads:
    """Counts `read_session` calls on a store (everything else passes through)."""

    def __init__(self, h: Harness) -> None:
        self.calls = 0
        self._read = h.store.read_session

        async def read_session(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return await self._read(*args, **kwargs)

        h.store.read_session = read_session  # type: ignore[method-assign]


@pytest.mark.parametrize("sole_writer", [True, False])
async def test_a_sole_writer_reads_nothing_before_a_held_sessions_turn(
    tokenizer: Tokenizer, sqlite_url: str, sole_writer: bool
) -> None:
    h = await make_harness(tokenizer, sqlite_url, sole_writer=sole_writer)
    try:
        reads = CountedReads(h)  # opening a new session reads no events
        await plain_turns(h, 4)
        # Without the claim every turn checks the head (the replicas' case).
        assert reads.calls == (0 if sole_writer else 4)
    finally:
        await h.close()


async def test_a_sole_writer_still_absorbs_an_append_it_did_not_expect(
    tokenizer: Tokenizer, sqlite_url: str, tmp_path: Path
) -> None:
    """Another server appends a turn behind the sole writer's back: the sole writer's
    next turn loses its claim, catches up and is served on top of that turn."""
    h = await make_harness(tokenizer, sqlite_url, sole_writer=True)
    other_store = await open_store(sqlite_url)
    other = await h.server_on(other_store)
    other_client = anthropic.AsyncAnthropic(
        base_url=other.url, auth_token="", max_retries=0, timeout=60
    )
    try:
        sid, messages = await plain_turns(h, 1)
        other_client = other_client.with_options(auth_token=sid)
        answer = await ask(other_client, messages, stream=False)
        messages += [echo(answer), {"role": "user", "content": "And on."}]
        await ask(h.client(sid), messages, stream=False)  # the stale state's claim loses
        decisions = await h.payloads(sid, ev.ChainDecision)
        assert [(d.turn, d.action) for d in decisions] == [(0, "new"), (1, "extend"), (2, "extend")]
        health = (await h.admin("GET", "/health"))[1]
        assert health["conflicts_retried"] == 1
        status, closed = await h.admin("POST", f"/sessions/{sid}/close", {})
        assert status == 200, closed
        assert [seg["turns"] for seg in closed["segments"]] == [[0, 1, 2]]
        assert len(closed["samples"]) == 1
    finally:
        await other_client.close()
        await other.stop(grace_s=1)
        await other_store.close()
        await h.close()
