"""Request bodies: each stored after what it shares with the previous one, its tail a copy."""

from __future__ import annotations

import itertools
import json
import random
import sqlite3
from typing import Any

import pytest

from recorder.log.events import ArrayRef
from recorder.log.store import StoreOptions, open_store
from recorder.log.store.arrays import CODEC_COPY_BASIS
from recorder.server import deltas
from recorder.server.deltas import (
    MIN_SHARED_BYTES,
    BodyPrefixes,
    put_body,
    shared_prefix_len,
    shared_suffix_len,
)
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


def test_shared_suffix_len() -> None:
    assert shared_suffix_len(b"", b"abc", 10) == 0
    assert shared_suffix_len(b"xbcd", b"abcd", 10) == 3
    assert shared_suffix_len(b"abcd", b"abcd", 10) == 4
    assert shared_suffix_len(b"abcd", b"abcd", 2) == 2


def _agent_bodies(turns: int, tools: str, *, compact_at: int = -1) -> list[bytes]:
    """Claude Code's shape: messages, then a system prompt and tools constant in a session."""
    messages: list[dict[str, str]] = []
    out = []
    for k in range(turns):
        if k == compact_at:  # the history replaced by a summary
            messages = [{"role": "user", "content": "summary " * 100}]
        messages.append({"role": "user", "content": f"result {k}: " + "line " * 150})
        out.append(
            json.dumps({"messages": messages, "system": "be brief", "tools": tools}).encode()
        )
        messages.append({"role": "assistant", "content": f"call {k} " * 30})
    return out


def _copies(sqlite_url: str) -> list[tuple[int, int]]:
    """(compressed data bytes, basis depth) of every copy piece."""
    db = sqlite3.connect(sqlite_url.split("///", 1)[1])
    try:
        return db.execute(
            "SELECT LENGTH(data), basis_depth FROM arrays WHERE codec = ?",
            (CODEC_COPY_BASIS,),
        ).fetchall()
    finally:
        db.close()


async def _store_all(sqlite_url: str, bodies: list[bytes]) -> list[BodyPrefixes]:
    """put_body every body in turn; check each reads back, hot and from a cold store."""
    states = []
    refs = []
    async with await open_store(sqlite_url, create=True) as store:
        prefixes = BodyPrefixes()
        for body in bodies:
            ref, prefixes = await put_body(store, prefixes, body)
            refs.append(ref)
            states.append(prefixes)
        assert [(await store.get_array(r)).tobytes() for r in refs] == bodies
    async with await open_store(sqlite_url, options=StoreOptions(piece_cache_bytes=0)) as cold:
        assert [a.tobytes() for a in await cold.get_arrays(refs)] == bodies
    return states


async def test_a_tail_is_a_copy_of_where_it_was_first_stored(sqlite_url: str) -> None:
    """The tools after the messages cost a 16-byte copy per turn, one hop from the first body."""
    tools = json.dumps([{"name": f"T{i}", "description": "does things " * 40} for i in range(8)])
    bodies = _agent_bodies(12, tools)
    states = await _store_all(sqlite_url, bodies)
    copies = _copies(sqlite_url)
    assert len(copies) == len(bodies) - 1
    assert set(copies) == {(16, 1)}
    first = states[0].ref
    assert all(s.tail is not None and s.tail[0] == first for s in states)
    assert _stored_bytes(sqlite_url) < len(bodies[0]) + sum(len(b) - len(tools) for b in bodies[1:])


async def test_a_compacted_history_still_copies_its_tail(sqlite_url: str) -> None:
    """A new history (nothing shared at the start) keeps the tools' copy."""
    tools = json.dumps([{"name": f"T{i}", "description": "does things " * 40} for i in range(8)])
    bodies = _agent_bodies(6, tools, compact_at=3)
    states = await _store_all(sqlite_url, bodies)
    assert len(_copies(sqlite_url)) == len(bodies) - 1
    assert states[3].tail is not None and states[3].tail[0] == states[0].ref


async def test_changed_tools_become_the_source_of_later_tails(sqlite_url: str) -> None:
    old = json.dumps([{"name": f"T{i}", "description": "old words " * 40} for i in range(8)])
    new = json.dumps([{"name": f"U{i}", "description": "new words " * 40} for i in range(8)])
    bodies = _agent_bodies(3, old) + _agent_bodies(5, new)[2:]
    states = await _store_all(sqlite_url, bodies)
    assert states[2].tail is not None and states[2].tail[0] == states[0].ref
    assert states[3].tail is not None and states[3].tail[0] == states[3].ref  # stored plainly
    assert states[-1].tail is not None and states[-1].tail[0] == states[3].ref


async def test_a_repeated_body_is_its_previous_ref_and_keeps_the_tail_source(
    sqlite_url: str,
) -> None:
    tools = json.dumps([{"name": f"T{i}", "description": "does things " * 40} for i in range(8)])
    bodies = _agent_bodies(4, tools)
    states = await _store_all(sqlite_url, [*bodies[:3], bodies[2], bodies[3]])
    assert states[3] == states[2]
    assert states[4].tail is not None and states[4].tail[0] == states[0].ref
    assert {depth for _, depth in _copies(sqlite_url)} == {1}


@pytest.mark.parametrize("step", [deltas.PREFIX_STEP, 32])
async def test_any_sequence_of_bodies_reads_back_and_every_copy_holds(
    sqlite_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, step: int
) -> None:
    """Bodies that grow, shrink, swap their tail or their head, repeat, share
    nothing, or change a field before all that, in random orders: each reads back exactly, hot and cold, and no
    copy ever names bytes its source does not hold (no plain fallback). With a
    small `PREFIX_STEP` and `WINDOW` the bodies span many steps: prefixes found
    by digest, differences before the window."""
    monkeypatch.setattr(deltas, "PREFIX_STEP", step)
    monkeypatch.setattr(deltas, "WINDOW", 2 * step if step < deltas.PREFIX_STEP else deltas.WINDOW)
    rng = random.Random(25)
    words = [f"w{i}" for i in range(50)]

    def text(n: int) -> bytes:
        return " ".join(rng.choice(words) for _ in range(n)).encode()

    tails = [text(300), text(300), b"", text(40)]
    bodies: list[bytes] = []
    head, middle, tail = text(200), text(100), tails[0]
    first = b""  # fields before the conversation (see the module doc)
    for _ in range(60):
        move = rng.randrange(9)
        if move == 0:
            middle += text(rng.randrange(1, 80))  # the conversation grows
        elif move == 1:
            tail = rng.choice(tails)  # other tools, or none
        elif move == 2:
            head = text(rng.randrange(0, 300))  # a new history (compaction)
        elif move == 3:
            middle = middle[: rng.randrange(len(middle) + 1)]  # a retried, shorter turn
        elif move == 4:
            tail = tail[rng.randrange(len(tail) + 1) :]  # a tail losing its start
        elif move == 5:
            head, middle, tail = text(rng.randrange(1, 50)), b"", b""  # unrelated and small
        elif move == 7:
            first = b'{"max_tokens": %d, ' % rng.randrange(10 ** rng.randrange(1, 7))
        elif move == 8:
            first = b""
        bodies.append(first + head + middle + tail)  # move 6: the same body again
    with caplog.at_level("WARNING", logger="recorder.server"):
        await _store_all(sqlite_url, bodies)
    assert "differs from its recorded source" not in caplog.text
    assert _copies(sqlite_url)  # the case this exists for happened


async def test_a_body_costs_one_commit(sqlite_url: str) -> None:
    """Prefix, middle and tail pieces go to the log in one transaction (one fsync)."""
    store = await open_store(sqlite_url, create=True)
    try:
        prefixes = BodyPrefixes()
        for body in _bodies(6):
            before = store.fast_groups + store.generic_groups
            ref, prefixes = await put_body(store, prefixes, body)
            assert store.fast_groups + store.generic_groups == before + 1
            assert (await store.get_array(ref)).tobytes() == body
        assert prefixes.tail is not None and prefixes.tail[0] != ref  # tails were copies
    finally:
        await store.close()


def test_shared_lengths_match_a_byte_by_byte_count() -> None:
    """Word-wise comparison finds the same lengths as counting bytes, at every alignment."""
    rng = random.Random(7)

    def prefix(a: bytes, b: bytes) -> int:
        n = min(len(a), len(b))
        return next((i for i in range(n) if a[i] != b[i]), n)

    for _ in range(3000):
        a = bytes(rng.choice(b"ab") for _ in range(rng.randint(0, 40)))
        b = a[: rng.randint(0, len(a))] + bytes(rng.choice(b"ab") for _ in range(rng.randint(0, 9)))
        b += a[rng.randint(0, len(a)) :]
        limit = rng.randint(-1, 45)
        assert shared_prefix_len(a, b) == prefix(a, b)
        assert shared_suffix_len(a, b, limit) == max(0, min(prefix(a[::-1], b[::-1]), limit))


def test_a_shared_prefix_is_exact_from_the_window_on_and_never_too_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Of the previous body only digests of its prefixes and its bytes from about
    `WINDOW` before its newest messages' end are kept: a difference there is found
    to the byte, an earlier one to `PREFIX_STEP` bytes, and a prefix found is shared."""
    monkeypatch.setattr(deltas, "PREFIX_STEP", 16)
    monkeypatch.setattr(deltas, "WINDOW", 32)
    rng = random.Random(11)
    ref = ArrayRef(b"\0" * 32, 0, "uint8")
    for _ in range(3000):
        a = bytes(rng.choice(b"ab") for _ in range(rng.randint(0, 300)))
        end = rng.randint(0, len(a))
        tail = (ref, 0, rng.randint(0, len(a) - end))
        previous = deltas._next_prefixes(a, deltas.prefix_digests(a), [], ref, tail, end)
        assert previous.start + len(previous.window) == len(a) == previous.length
        assert len(previous.window) >= tail[2] and previous.start <= max(0, end - 32)
        cut = rng.randint(0, len(a))
        b = a[:cut] + bytes(rng.choice(b"ab") for _ in range(rng.randint(0, 40)))
        truth = shared_prefix_len(a, b)
        shared, digests = deltas.shared_with_previous(previous, b)
        assert digests == deltas.prefix_digests(b)
        if truth >= previous.start:
            assert shared == truth
        else:
            assert truth - 16 < shared <= truth


def _sdk_bodies(turns: int, tools: str, head: list[str]) -> list[bytes]:
    """The Anthropic SDK's key order (sorted: `max_tokens` before `messages`), with
    `head[k]` the JSON of turn k's fields before the messages (a number, an id...)."""
    messages: list[dict[str, str]] = []
    out = []
    for k in range(turns):
        messages.append({"role": "user", "content": f"result {k}: " + "line " * 150})
        rest = json.dumps({"messages": messages, "system": "be brief", "tools": tools})
        out.append(("{" + head[k] + ", " + rest[1:]).encode())
        messages.append({"role": "assistant", "content": f"call {k} " * 30})
    return out


def _stored_data(sqlite_url: str) -> int:
    """Bytes the arrays table holds (compressed data, copies' 16 bytes)."""
    db = sqlite3.connect(sqlite_url.split("///", 1)[1])
    try:
        return int(db.execute("SELECT SUM(LENGTH(data)) FROM arrays").fetchone()[0])
    finally:
        db.close()


_TOOLS = json.dumps([{"name": f"T{i}", "description": "does things " * 40} for i in range(8)])


@pytest.mark.parametrize(
    "head",
    [
        # max_tokens sized to the room left, losing digits on the way
        lambda k: f'"max_tokens": {120_000 - 13_000 * k}',
        # an id longer than the first probe, and a second changing field
        lambda k: f'"request_id": "{k:040d}", "max_tokens": {2**k}',
    ],
    ids=["max_tokens", "id-and-number"],
)
async def test_a_head_that_changes_every_turn_costs_what_a_constant_one_does(
    tmp_path: pytest.TempPathFactory, head: Any
) -> None:
    """A field before the messages that changes every turn (module doc): each body
    is stored after its first bytes as deltas of the previous body's stream, so the
    session stores what it would with that field constant, not every body whole."""
    turns = 16
    changing = _sdk_bodies(turns, _TOOLS, [head(k) for k in range(turns)])
    constant = _sdk_bodies(turns, _TOOLS, [head(0)] * turns)
    urls = {name: f"sqlite:///{tmp_path}/{name}.db" for name in ("changing", "constant")}
    states = await _store_all(urls["changing"], changing)
    await _store_all(urls["constant"], constant)
    # Split from the second early difference in a row on (see `stream_origin`).
    assert [s.origin > 0 for s in states] == [False, False] + [True] * (turns - 2)
    assert all(s.origin < 200 for s in states)  # split right after the changing fields
    whole = sum(len(b) for b in changing)
    # A few bytes a turn more (the head piece, two 16-byte copies), never the body.
    extra = _stored_data(urls["changing"]) - _stored_data(urls["constant"])
    assert extra < turns * 128 and _stored_data(urls["constant"]) < whole / 20
    # Per body after the first split: its head, the stream's copy (depth 1), the
    # tail's copy (one hop from the first body).
    copies = _copies(urls["changing"])
    assert copies.count((16, 1)) == len(copies) == 2 * (turns - 2) + 1


async def test_a_split_body_repeated_is_its_previous_ref(sqlite_url: str) -> None:
    heads = [f'"max_tokens": {900 - k}' for k in range(5)]
    bodies = _sdk_bodies(5, _TOOLS, heads)
    # A retry (the same body), then the same messages with another max_tokens.
    again = _sdk_bodies(4, _TOOLS, [*heads[:3], '"max_tokens": 7'])[3]
    states = await _store_all(sqlite_url, [*bodies[:4], bodies[3], again, bodies[4]])
    assert states[4] == states[3]
    assert states[5].ref != states[3].ref and states[5].origin == states[3].origin - 2


async def test_a_head_that_stops_changing_or_a_restart_reads_back(sqlite_url: str) -> None:
    """Splits come and go: the head changes, stays, changes again; the state is lost
    (a restart stores the next body whole); a compaction replaces the history."""
    heads = [f'"max_tokens": {n}' for n in (500, 400, 400, 400, 30, 30, 2000, 1, 1)]
    bodies = _sdk_bodies(len(heads), _TOOLS, heads)
    async with await open_store(sqlite_url, create=True) as store:
        prefixes = BodyPrefixes()
        refs = []
        for k, body in enumerate(bodies):
            if k == 5:
                prefixes = BodyPrefixes()  # a restart
            ref, prefixes = await put_body(store, prefixes, body)
            refs.append(ref)
        compacted = b'{"max_tokens": 3, "messages": [{"role": "user", "content": "summary"}]}'
        ref, prefixes = await put_body(store, prefixes, compacted)
        refs.append(ref)
    async with await open_store(sqlite_url, options=StoreOptions(piece_cache_bytes=0)) as cold:
        got = [a.tobytes() for a in await cold.get_arrays(refs)]
    assert got == [*bodies, compacted]


async def test_split_bodies_read_back_on_every_backend(store_url: str) -> None:
    """Heads, stream copies and tail copies written in one commit each, read back
    hot and cold from either backend."""
    heads = [f'"max_tokens": {10 ** (k % 6)}, "metadata": {{"turn": {k}}}' for k in range(10)]
    bodies = _sdk_bodies(10, _TOOLS, heads)
    refs = []
    async with await open_store(store_url, create=True) as store:
        prefixes = BodyPrefixes()
        for body in bodies:
            before = store.fast_groups + store.generic_groups
            ref, prefixes = await put_body(store, prefixes, body)
            assert store.fast_groups + store.generic_groups == before + 1
            refs.append(ref)
        assert prefixes.origin > 0
        assert [(await store.get_array(r)).tobytes() for r in refs] == bodies
    async with await open_store(store_url, options=StoreOptions(piece_cache_bytes=0)) as cold:
        assert [a.tobytes() for a in await cold.get_arrays(refs)] == bodies
        assert (await cold.get_array(refs[-1])).tobytes() == bodies[-1]


async def test_a_split_ends_when_its_head_stops_changing(sqlite_url: str) -> None:
    """The stream's copy hashes the stream every turn: once the head has stayed the
    same `STEADY_TURNS` turns the body is its own stream again (stored whole once)."""
    heads = [f'"max_tokens": {900 - k}' for k in range(6)] + ['"max_tokens": 1'] * 14
    states = await _store_all(sqlite_url, _sdk_bodies(len(heads), _TOOLS, heads))
    split = [s.origin > 0 for s in states]
    steady = deltas.STEADY_TURNS
    # Split from body 2; body 6 is the first with head "1", body 6 + steady the first unsplit.
    assert split == [False, False] + [True] * (4 + steady) + [False] * (14 - steady)


@pytest.mark.parametrize("version", ["2.1.197", "2.1.330"])
async def test_claude_code_bodies_are_never_split(sqlite_url: str, version: str) -> None:
    """Real Claude Code request shapes (tests/data/claude_traffic): a first message
    whose cache marker moves on differs early once, never twice in a row."""
    import gzip
    from pathlib import Path

    found = 0
    for path in sorted(Path(f"tests/data/claude_traffic/{version}").glob("*.json.gz")):
        records = json.loads(gzip.decompress(path.read_bytes()))
        bodies = [
            json.dumps(r["body"]).encode() for r in records if r["path"].startswith("/v1/messages")
        ]
        bodies = [b for b in bodies if b != b"null"]
        found += len(bodies)
        async with await open_store(sqlite_url, create=True) as store:
            prefixes = BodyPrefixes()
            for body in bodies:
                ref, prefixes = await put_body(store, prefixes, body)
                assert prefixes.origin == 0
                assert (await store.get_array(ref)).tobytes() == body
    assert found > 20
