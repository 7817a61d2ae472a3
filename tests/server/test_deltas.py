"""Request bodies: each stored after what it shares with the previous one."""

from __future__ import annotations

import itertools
import json

from recorder.log.store import open_store
from recorder.server.deltas import MIN_SHARED_BYTES, BodyPrefixes, put_body, shared_prefix_len
from tests.server.conftest import array_rows


def test_shared_prefix_len() -> None:
    assert shared_prefix_len(b"", b"abc") == 0
    assert shared_prefix_len(b"abcd", b"abXd") == 2
    assert shared_prefix_len(b"abc", b"abcdef") == 3
    assert shared_prefix_len(b"abc", b"abc") == 3


def _bodies(turns: int) -> list[bytes]:
    """What an agent sends: the whole conversation each turn, a changing tail after it."""
    messages: list[dict[str, str]] = []
    out = []
    for k in range(turns):
        messages.append({"role": "user", "content": f"step {k}: " + "context " * 200})
        body = {"messages": messages, "system": f"billing cch={k}", "tools": ["Bash"] * 50}
        out.append(json.dumps(body).encode())
        messages.append({"role": "assistant", "content": f"done {k} " * 40})
    return out


def _stored_bytes(sqlite_url: str) -> int:
    """Bytes of array data the store holds (each piece's own suffix, before compression)."""
    rows = array_rows(sqlite_url)
    return sum(n - (rows[p][1] if p is not None else 0) for p, n in rows.values())


async def test_each_body_costs_only_what_it_adds(sqlite_url: str) -> None:
    bodies = _bodies(16)
    store = await open_store(sqlite_url, create=True)
    try:
        prefixes = BodyPrefixes()
        refs = []
        for body in bodies:
            ref, prefixes = await put_body(store, prefixes, body)
            refs.append(ref)
        for ref, body in zip(refs, bodies, strict=True):
            assert (await store.get_array(ref)).tobytes() == body
    finally:
        await store.close()
    # Body k is stored after the prefix body k-1 shared with body k-2 (the
    # longest stored piece boundary it can extend): what the last two turns
    # added plus the changing tail, never the whole conversation again.
    shared = [0] + [shared_prefix_len(a, b) for a, b in itertools.pairwise(bodies)]
    expected = len(bodies[0]) + len(bodies[1])
    expected += sum(len(bodies[k]) - shared[k - 1] for k in range(2, len(bodies)))
    assert _stored_bytes(sqlite_url) == expected
    assert expected < sum(len(b) for b in bodies) / 3  # the case this exists for


async def test_unrelated_bodies_are_stored_whole(sqlite_url: str) -> None:
    first = b"a" * (4 * MIN_SHARED_BYTES)
    second = b"b" * (4 * MIN_SHARED_BYTES)
    store = await open_store(sqlite_url, create=True)
    try:
        _, prefixes = await put_body(store, BodyPrefixes(), first)
        ref, prefixes = await put_body(store, prefixes, second)
        assert ref.length == len(second) and prefixes.refs == [ref]
        assert (await store.get_array(ref)).tobytes() == second
    finally:
        await store.close()
