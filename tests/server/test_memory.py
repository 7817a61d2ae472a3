"""What the server keeps per turn is what its caches account for, not whole request bodies.

A long session on a live server, then every cache it holds is walked object
by object: the bytes really kept alive (each object's `sys.getsizeof`, numpy
arrays and memoryviews followed to the buffer that owns their data) must be
what the cache charges itself, and nothing it holds may be a view of a
bigger buffer. A cached 2 kB piece sliced out of a 100 kB request body keeps
the whole body alive while the cache counts 2 kB: its bound then never
triggers, and the server grows by a body per turn.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import AsyncIterator, Iterable
from typing import Any

import numpy as np
import pytest

from recorder.log.store.sql import MAX_BASIS_DEPTH
from recorder.model.tokenizer import Tokenizer
from recorder.server.deltas import MAX_CHAIN_REFS
from recorder.server.sessions import held_bytes
from tests.server.conftest import SYSTEM, Harness, make_harness
from tools.benchkit.census import Walk as CensusWalk
from tools.benchkit.census import buffer_owner, session_census

TURNS = MAX_BASIS_DEPTH + 8  # past one rebase of the body's basis chain, past MAX_CHAIN_REFS
CONTEXT = 65536


def _tools(n: int) -> list[dict[str, Any]]:
    """A large constant tool list, as Claude Code sends (~60 kB here)."""
    return [
        {
            "name": f"Tool{i}",
            "description": f"Tool {i}: " + "Returns the requested information. " * 80,
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
        }
        for i in range(n)
    ]


def _body(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> bytes:
    body = {
        "model": "m",
        "max_tokens": 32,
        "system": SYSTEM,
        "tools": tools,
        "messages": messages,
        "metadata": {"user_id": "user_abc_account__session_1"},
    }
    return json.dumps(body).encode()


class Walk:
    """Every object reachable from some roots, each counted once (`sys.getsizeof`).

    gc does not see a numpy array's or a memoryview's buffer owner: those are
    followed explicitly. Classes and modules are shared code, not data.
    """

    def __init__(self, roots: Iterable[object]) -> None:
        self.bytes = 0
        self.views: list[tuple[int, int]] = []  # (bytes seen, bytes kept alive)
        seen: set[int] = set()
        stack = list(roots)
        while stack:
            obj = stack.pop()
            if id(obj) in seen or isinstance(obj, type) or type(obj).__name__ == "module":
                continue
            seen.add(id(obj))
            self.bytes += sys.getsizeof(obj)
            if isinstance(obj, np.ndarray | memoryview):
                owner = buffer_owner(obj)
                if owner is not obj:
                    kept = owner.nbytes if isinstance(owner, np.ndarray) else len(owner)  # type: ignore[arg-type]
                    if kept > obj.nbytes:
                        self.views.append((obj.nbytes, kept))
                    stack.append(owner)
                continue
            stack.extend(gc.get_referents(obj))


@pytest.fixture
async def big(tokenizer: Tokenizer, sqlite_url: str) -> AsyncIterator[Harness]:
    h = await make_harness(
        tokenizer, sqlite_url, engine_kwargs={"context_length": CONTEXT}, context_length=CONTEXT
    )
    try:
        yield h
    finally:
        await h.close()


async def _serve_turns(h: Harness, session_id: str, turns: int) -> bytes:
    """`turns` turns of a growing conversation (~2 kB of tool output each); the last body."""
    assert h.http is not None
    tools = _tools(30)
    messages: list[dict[str, Any]] = []
    body = b""
    for turn in range(turns):
        output = " ".join(f"line {turn}.{i}: value = {i * turn}" for i in range(80))
        messages.append({"role": "user", "content": [{"type": "text", "text": output}]})
        body = _body(messages, tools)
        h.engine.push(f"noted {turn}")
        async with h.http.post(
            h.url + "/v1/messages",
            data=body,
            headers={"Authorization": f"Bearer {session_id}", "Content-Type": "application/json"},
        ) as resp:
            reply = await resp.json()
            assert resp.status == 200, reply
        messages.append({"role": "assistant", "content": reply["content"]})
    return body


async def test_caches_keep_what_they_account_for(big: Harness) -> None:
    h = big
    session_id = await h.open_session()
    last_body = await _serve_turns(h, session_id, TURNS)
    assert len(last_body) > 100_000

    # The store's piece cache: what it holds is its charge, to within the
    # estimate of per-entry overhead (digests shared between pieces count once).
    cache = h.store.piece_cache  # type: ignore[attr-defined]
    # Records and bodies' tail sources; a live chain's token pieces are never cached.
    assert len(cache) > TURNS
    held = Walk(cache._items.values())
    assert held.views == []
    slots = len(cache) * (sys.getsizeof({}) // 2)  # the dict's entries, not walked
    assert 0.8 * cache.nbytes <= held.bytes + slots <= cache.nbytes

    # The session's own state: of the previous body only its last bytes, not a bigger buffer.
    state = h.ctx.registry.cached(session_id)
    assert state is not None
    window = state.body_prefixes.window
    assert last_body.endswith(window) and len(window) < len(last_body) / 2
    # Per chain only the longest stored inputs are remembered, not one per turn.
    assert [len(refs) for refs in state.chain_refs.values()] == [MAX_CHAIN_REFS]
    session = Walk([state.body_prefixes, state.chains, state.chain_refs])
    assert session.views == []
    tokens = state.chains.main.tokens
    # The window, the chain's int32 tokens and small bookkeeping: nothing per turn that
    # grows by a body (24 turns of a 100 kB body would be 2.4 MB), nor the body itself.
    assert session.bytes < len(window) + tokens.itemsize * len(tokens) + 100_000

    # The parse cache: its entries (key bytes + translation) are what it charges, at most.
    parsed = Walk(state.parse_cache._entries.items())
    assert parsed.views == []
    assert parsed.bytes <= state.parse_cache.nbytes

    # What the registry charges the session (its memory bound evicts by it) is what the
    # census finds its state keeps alive, not a multiple of it.
    census = sum(session_census(state, CensusWalk([h.ctx.store, h.ctx.registry])).values())
    assert 0.8 * census <= held_bytes(state) <= 1.1 * census
