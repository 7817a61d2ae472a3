"""Benchmark the event store; prints a table of rates and ratios.

    python tools/bench_store.py [--pg URL] [--events N] [--rounds R]
        [--batched-rounds B] [--batched-only]

Every figure is compared with a baseline measured in the same run on the same
machine, so ratios stay meaningful across hardware:
  - batched appends (1,000 events a call, 16 sessions in turn) vs. the raw
    driver (sqlite3 / asyncpg executemany) into an equivalent table with the
    same indexes and durability settings, fed the very same events, whose
    payloads are as big as a live server's events (`LIVE_PAYLOAD_BYTES`).
    Store and raw runs alternate ABBA for B rounds: the table shows median
    rates, the median per-round ratio with its range, and the CPU per event
    of this process (all threads; noisy neighbours move it far less than
    wall time). Ids are time-ordered (UUIDv7, `recorder.log.ids.uuid7`); a
    second row shows random v4 ids, which scatter inserts over the event_id
    index;
  - 256 concurrent single-event appenders: group commit vs. one transaction
    per event (the same store with grouping disabled);
  - token storage of a 40-turn session (each prompt extends the previous one)
    vs. storing every turn's full prompt as raw int32;
  - raw request bodies of a 40-turn agent session (each body re-sends the
    whole conversation, +2,500 tokens of text per turn): bytes on disk and
    put time per turn (and the event loop's CPU per put, median of the last
    10 bodies) with `basis=` the previous body vs. without, stored
    whole and as the server stores them (`recorder.server.deltas.put_body`:
    its tail a copy of where it was first stored, so `basis=` changes nothing there),
    against what the last body alone costs compressed (its unique text),
    and the time to read the last body from a fresh store (a cold read
    decodes at most MAX_BASIS_DEPTH bases);
  - a live server's arrays per turn for the same session (and per token of
    its last context, by kind): the body as
    `put_body` stores it and the engine input (the fixture tokenizer's ids
    of the conversation, not random ones) as the suffix of the previous
    input, vs. both stored whole every turn: median time per turn and disk;
  - small-append latency, the live server's per-turn commit: one session,
    sequential turns of a 3-event append carrying a 50-int array
    (`append(..., arrays=[encode_array(...)])`), p50/p99. On both backends
    the plain-group fast path (SQLite: one thread hop; Postgres: three round
    trips on raw asyncpg) vs. the generic path (SQLAlchemy), and arrays= vs.
    `put_array` then `append` (two commits); on SQLite also vs. raw sqlite3
    doing the same inserts in one transaction (the floor).
    Modes alternate for R rounds; samples of all rounds are pooled.
Postgres runs when --pg or TR_TEST_POSTGRES_URL gives an admin URL; it makes
and drops a scratch database.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import msgspec
import numpy as np
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recorder.log.events import ArrayRef, NewEvent, SandboxEvent, encode_event, type_name
from recorder.log.ids import uuid7
from recorder.log.store import EventStore, StoreOptions, open_store
from recorder.log.store import arrays as codec
from recorder.log.store.sql import SqlEventStore
from recorder.log.store.sqlite import (
    INSERT_EVENTS_SQL,
    INSERT_PIECE_SQL,
    WRITER_CACHE_KIB,
    configure_connection,
)
from recorder.server.deltas import BodyPrefixes, put_body
from tools.benchkit.cpu import load_average, probe_span, speed_probe_ms
from tools.benchkit.stats import pct
from tools.benchkit.table import print_grid

BATCH = 1000
APPENDERS = 256
TURNS, TOKENS_PER_TURN, VOCAB = 40, 2500, 49_152
CHARS_PER_TOKEN = 4  # English prose and code through a BPE tokenizer

Row = tuple[str, str, str, str, str]  # benchmark, backend, result, baseline, ratio(target)


NewId = Callable[[], uuid.UUID]
ID_KINDS: dict[str, NewId] = {"v7": uuid7, "v4": uuid.uuid4}


def small_event(i: int, new_id: NewId = uuid7) -> NewEvent:
    return NewEvent(
        event=SandboxEvent(kind="tool_call", detail={"i": i, "ok": True}), event_id=new_id()
    )


# Payload sizes (bytes, msgpack) of a live server's events, one turn's worth by
# type from each of two recorded logs (tito_verdict, state_snapshot, response_sent,
# rendered_input, messages_request, generate_result, generate_attempt,
# chain_decision): batched appends carry events of these sizes in turn, ~260 B
# on average, not the ~30 B of a bare sandbox event.
LIVE_PAYLOAD_BYTES = (41, 326, 242, 68, 154, 145, 105, 56, 90, 1448, 435, 147, 277, 279, 329, 112)
_PAYLOAD_OVERHEAD = 23  # a SandboxEvent with {"i": ..., "pad": ""} and a long pad


def live_sized_event(i: int, new_id: NewId = uuid7) -> NewEvent:
    """The i-th event of a batched append, its payload as big as a live event's."""
    pad = "a" * max(0, LIVE_PAYLOAD_BYTES[i % len(LIVE_PAYLOAD_BYTES)] - _PAYLOAD_OVERHEAD)
    return NewEvent(
        event=SandboxEvent(kind="tool_call", detail={"i": i, "pad": pad}), event_id=new_id()
    )


def make_batches(n: int, new_id: NewId) -> list[list[NewEvent]]:
    """Events are built before the clock starts (for the store and the baselines alike)."""
    return [[live_sized_event(i, new_id) for i in range(b, b + BATCH)] for b in range(0, n, BATCH)]


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


# -- batched throughput -------------------------------------------------------


class Rate(msgspec.Struct, frozen=True):
    """Events per second (wall clock) and CPU seconds per event (this process, all threads)."""

    per_s: float
    cpu_s: float


def rate_of(n: int, wall_s: float, cpu_s: float) -> Rate:
    return Rate(n / wall_s, cpu_s / n)


async def store_batched(url: str, batches: list[list[NewEvent]]) -> Rate:
    store = await open_store(url, create=True)
    n = sum(map(len, batches))
    try:
        cpu0, t0 = time.process_time(), time.perf_counter()
        for k, batch in enumerate(batches):
            await store.append(f"s{k % 16}", batch)
        return rate_of(n, time.perf_counter() - t0, time.process_time() - cpu0)
    finally:
        await store.close()


def raw_rows(
    batches: list[list[NewEvent]], event_id: Callable[[NewEvent], object]
) -> Iterator[list[tuple[object, ...]]]:
    """Each batch's rows for the raw drivers, as the store lays them out (session s0..s15,
    seq numbers per session); encoded as they are consumed, so inside the timed loop."""
    seqs: dict[str, int] = {}
    for k, batch in enumerate(batches):
        sid = f"s{k % 16}"
        seq0 = seqs.get(sid, 0)
        now = time.time()
        yield [
            (sid, seq0 + j, event_id(ne), "sandbox_event", 1, now, encode_event(ne.event))
            for j, ne in enumerate(batch)
        ]
        seqs[sid] = seq0 + BATCH


def raw_sqlite_batched(path: Path, batches: list[list[NewEvent]]) -> Rate:
    conn = sqlite3.connect(path, isolation_level=None)
    configure_connection(conn, WRITER_CACHE_KIB)  # the store's settings (WAL, fsync, cache)
    conn.execute(
        "CREATE TABLE events (position INTEGER PRIMARY KEY, session_id TEXT NOT NULL, "
        "seq BIGINT NOT NULL, event_id BLOB NOT NULL UNIQUE, type TEXT NOT NULL, "
        "version INTEGER NOT NULL, ts DOUBLE NOT NULL, payload BLOB NOT NULL, "
        "UNIQUE (session_id, seq))"
    )
    n = sum(map(len, batches))
    cpu0, t0 = time.process_time(), time.perf_counter()
    for rows in raw_rows(batches, lambda ne: ne.event_id.bytes):
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "INSERT INTO events (session_id, seq, event_id, type, version, ts, payload) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        conn.execute("COMMIT")
    rate = rate_of(n, time.perf_counter() - t0, time.process_time() - cpu0)
    conn.close()
    return rate


async def raw_pg_batched(url: str, batches: list[list[NewEvent]]) -> Rate:
    import asyncpg

    conn = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
    await conn.execute(
        "CREATE TABLE raw_events (position BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, "
        "session_id TEXT NOT NULL, seq BIGINT NOT NULL, event_id UUID NOT NULL UNIQUE, "
        "type VARCHAR(64) NOT NULL, version INTEGER NOT NULL, ts DOUBLE PRECISION NOT NULL, "
        "payload BYTEA NOT NULL, UNIQUE (session_id, seq))"
    )
    n = sum(map(len, batches))
    cpu0, t0 = time.process_time(), time.perf_counter()
    for rows in raw_rows(batches, lambda ne: ne.event_id):
        async with conn.transaction():
            await conn.executemany(
                "INSERT INTO raw_events (session_id, seq, event_id, type, version, ts, payload) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7)",
                rows,
            )
    rate = rate_of(n, time.perf_counter() - t0, time.process_time() - cpu0)
    await conn.close()
    return rate


# -- concurrent single-event appenders ---------------------------------------


async def concurrent_singles(url: str, per_appender: int, *, grouped: bool) -> float:
    store = await open_store(url, create=True)
    assert isinstance(store, SqlEventStore)
    if not grouped:
        store.max_group_weight = 1

    async def appender(a: int) -> None:
        for i in range(per_appender):
            await store.append(f"c{a}", [small_event(i)])

    try:
        elapsed = await timed(lambda: asyncio.gather(*(appender(a) for a in range(APPENDERS))))
        return APPENDERS * per_appender / elapsed
    finally:
        await store.close()


# -- token storage --------------------------------------------------------------


def session_turns() -> list[np.ndarray]:
    rng = np.random.default_rng(1234)
    return [rng.integers(0, VOCAB, TOKENS_PER_TURN, dtype=np.int32) for _ in range(TURNS)]


async def store_turns(url: str) -> list[ArrayRef]:
    store = await open_store(url, create=True)
    refs: list[ArrayRef] = []
    prev: ArrayRef | None = None
    try:
        for new in session_turns():
            prev = await store.put_array(new, extends=prev)
            refs.append(prev)
        # Honesty check: the last ref reads back as the whole session.
        full = await store.get_array(refs[-1])
        assert full.tobytes() == np.concatenate(session_turns()).tobytes()
    finally:
        await store.close()
    return refs


def sqlite_file_bytes(path: Path) -> int:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("VACUUM")
    conn.close()
    return path.stat().st_size


def raw_full_prompts_sqlite(path: Path) -> int:
    """What storing each turn's whole prompt as raw int32 costs on disk."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE prompts (turn INTEGER PRIMARY KEY, ids BLOB NOT NULL)")
    prompt = np.zeros(0, np.int32)
    for t, new in enumerate(session_turns()):
        prompt = np.concatenate([prompt, new])
        conn.execute("INSERT INTO prompts VALUES (?, ?)", (t, prompt.tobytes()))
    conn.close()
    return sqlite_file_bytes(path)


async def token_storage_sqlite(url: str) -> tuple[float, float, float]:
    """(on-disk bytes / unique token, compressed bytes / token, naive / ours)."""
    db = _path(url)
    empty = db.with_name(db.stem + "-empty.db")
    await (await open_store(str(empty), create=True)).close()
    base = sqlite_file_bytes(empty)
    await store_turns(url)
    used = sqlite_file_bytes(db) - base
    data = compressed_bytes(db)
    naive = raw_full_prompts_sqlite(db.with_name(db.stem + "-naive.db"))
    tokens = TURNS * TOKENS_PER_TURN
    return used / tokens, data / tokens, naive / used


# A piece's compressed bytes are data || data_tail (see migration 0002).
COMPRESSED_SQL = "SELECT SUM(LENGTH(data) + COALESCE(LENGTH(data_tail), 0)) FROM arrays"


def compressed_bytes(db: Path) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute(COMPRESSED_SQL).fetchone()[0])
    finally:
        conn.close()


async def token_storage_pg(url: str) -> tuple[float, float, float]:
    """Like the SQLite figure: table + TOAST + indexes, minus the empty table's size."""
    import asyncpg

    await (await open_store(url, create=True)).close()
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
    try:
        await conn.execute("VACUUM FULL arrays")
        empty = await conn.fetchval("SELECT pg_total_relation_size('arrays')")
        await store_turns(url)
        await conn.execute("VACUUM FULL arrays")
        used = await conn.fetchval("SELECT pg_total_relation_size('arrays')") - empty
        data = await conn.fetchval(COMPRESSED_SQL)
        await conn.execute("CREATE TABLE naive_prompts (turn INT PRIMARY KEY, ids BYTEA)")
        await conn.execute("ALTER TABLE naive_prompts ALTER COLUMN ids SET STORAGE EXTERNAL")
        prompt = np.zeros(0, np.int32)
        for t, new in enumerate(session_turns()):
            prompt = np.concatenate([prompt, new])
            await conn.execute("INSERT INTO naive_prompts VALUES ($1, $2)", t, prompt.tobytes())
        await conn.execute("VACUUM FULL naive_prompts")
        naive = await conn.fetchval("SELECT pg_total_relation_size('naive_prompts')")
    finally:
        await conn.close()
    tokens = TURNS * TOKENS_PER_TURN
    return used / tokens, data / tokens, naive / used


# -- request bodies -------------------------------------------------------------


def agent_bodies() -> list[bytes]:
    """Messages API bodies of a 40-turn agent session, Claude Code style.

    Each turn appends an assistant message (text + a tool call) and the tool
    result, ~TOKENS_PER_TURN tokens of text in all, and re-sends everything
    before it, then the same system prompt and tools; the cache breakpoint
    moves to the newest message every turn. Text is Zipf-distributed words,
    so it compresses about like prose.
    """
    rng = np.random.default_rng(4321)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocab = ["".join(rng.choice(letters, int(rng.integers(2, 10)))) for _ in range(20_000)]
    weights = 1 / np.arange(1, len(vocab) + 1)
    weights /= weights.sum()

    def text(chars: int) -> str:
        words = rng.choice(vocab, chars // 5, p=weights)
        return " ".join(words)[:chars]

    system = [{"type": "text", "text": text(12_000)}]
    tools = [
        {
            "name": f"Tool{i}",
            "description": text(1_500),
            "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}}},
        }
        for i in range(16)
    ]
    messages: list[dict[str, object]] = [
        {"role": "user", "content": [{"type": "text", "text": text(2_000)}]}
    ]
    per_turn = TOKENS_PER_TURN * CHARS_PER_TOKEN
    bodies = []
    for turn in range(TURNS):
        call = f"toolu_{turn:04d}"
        result: dict[str, object] = {
            "type": "tool_result",
            "tool_use_id": call,
            "content": text(per_turn - 1_700),
        }
        messages += [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": text(1_500)},
                    {"type": "tool_use", "id": call, "name": "Bash", "input": {"cmd": text(200)}},
                ],
            },
            {"role": "user", "content": [result]},
        ]
        result["cache_control"] = {"type": "ephemeral"}
        body = {
            "model": "claude-sonnet-4-5",
            "messages": messages,
            "system": system,
            "tools": tools,
            "metadata": {"user_id": "bench"},
            "max_tokens": 32_000,
            "stream": True,
        }
        bodies.append(json.dumps(body).encode())
        del result["cache_control"]
    return bodies


class WithoutBasis:
    """A store that ignores `basis=`: the same callers, the old encoding."""

    def __init__(self, store: EventStore) -> None:
        self.store = store

    async def put_array(
        self,
        array: np.ndarray,
        *,
        extends: ArrayRef | None = None,
        basis: ArrayRef | None = None,
        basis_offset: int | None = None,
        cache: bool = True,
        along: list[codec.EncodedArray] | None = None,
        prior: np.ndarray | bytes | None = None,
    ) -> ArrayRef:
        return await self.store.put_array(array, extends=extends, cache=cache, along=along or ())


class BodyTimes(msgspec.Struct, frozen=True):
    put_s: float  # median seconds per body put
    cold_read_s: float  # reading the last body from a fresh store (empty piece cache)
    put_cpu_s: float = 0.0  # median event-loop CPU per put, the last 10 (largest) bodies


async def store_bodies(url: str, bodies: list[bytes], *, deltas: bool, basis: bool) -> BodyTimes:
    """Store a session's bodies, then read them all back cold to check them."""
    store = await open_store(url, create=True)
    target: EventStore = store if basis else WithoutBasis(store)  # type: ignore[assignment]
    refs: list[ArrayRef] = []
    previous = BodyPrefixes()
    elapsed: list[float] = []
    cpu: list[float] = []
    try:
        for body in bodies:
            t0, c0 = time.perf_counter(), time.thread_time()
            if deltas:
                ref, previous = await put_body(target, previous, body)
            else:
                data = np.frombuffer(body, np.uint8)
                ref = await target.put_array(data, basis=refs[-1] if refs else None)
            elapsed.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            refs.append(ref)
    finally:
        await store.close()
    async with await open_store(url, options=StoreOptions(piece_cache_bytes=0)) as cold:
        t0 = time.perf_counter()
        last = await cold.get_array(refs[-1])
        cold_read = time.perf_counter() - t0
        got = await cold.get_arrays(refs)
    assert last.tobytes() == bodies[-1], "the last body did not read back identical"
    assert [a.tobytes() for a in got] == bodies, "bodies did not read back identical"
    return BodyTimes(statistics.median(elapsed), cold_read, statistics.median(cpu[-10:]))


async def arrays_on_disk(
    url: str, is_pg: bool, fill: Callable[[], Awaitable[BodyTimes]]
) -> tuple[int, BodyTimes]:
    """(bytes the arrays table grew by on disk, what `fill` returned)."""
    if not is_pg:
        db = _path(url)
        empty = db.with_name(db.stem + "-empty.db")
        await (await open_store(str(empty), create=True)).close()
        result = await fill()
        return sqlite_file_bytes(db) - sqlite_file_bytes(empty), result
    import asyncpg

    await (await open_store(url, create=True)).close()
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
    try:
        await conn.execute("VACUUM FULL arrays")
        empty = await conn.fetchval("SELECT pg_total_relation_size('arrays')")
        result = await fill()
        await conn.execute("VACUUM FULL arrays")
        used = await conn.fetchval("SELECT pg_total_relation_size('arrays')") - empty
    finally:
        await conn.close()
    return int(used), result


async def body_storage(fresh: FreshUrl, is_pg: bool) -> list[Row]:
    """Rows: bodies stored whole and as server deltas, each with basis vs. without."""
    bodies = agent_bodies()
    unique = len(codec.encode_piece(np.frombuffer(bodies[-1], np.uint8), "uint8", None).data)
    backend = "postgres" if is_pg else "sqlite"
    rows: list[Row] = []
    for deltas, label in ((False, "whole"), (True, "server deltas")):
        measured: dict[bool, tuple[int, BodyTimes]] = {}
        for basis in (False, True):
            async with fresh() as url:
                fill = functools.partial(store_bodies, url, bodies, deltas=deltas, basis=basis)
                measured[basis] = await arrays_on_disk(url, is_pg, fill)
        (on, t_on), (off, t_off) = measured[True], measured[False]
        rows.append(
            (
                f"bodies {TURNS} turns, {label}, basis=prev",
                backend,
                f"{on / 1e3:,.0f} kB = {on / unique:.1f}x last body; put "
                f"{t_on.put_s * 1e3:.1f} ms/turn (CPU {t_on.put_cpu_s * 1e3:.2f}); cold read "
                f"{t_on.cold_read_s * 1e3:.0f} ms",
                f"no basis {off / 1e3:,.0f} kB = {off / unique:.1f}x; put "
                f"{t_off.put_s * 1e3:.1f} ms (CPU {t_off.put_cpu_s * 1e3:.2f}); read "
                f"{t_off.cold_read_s * 1e3:.0f} ms",
                f"{off / on:.1f}x smaller, put {t_on.put_s / t_off.put_s:.2f}x time",
            )
        )
    return [*rows, await changing_head_row(fresh, is_pg, bodies)]


def sdk_order(bodies: list[bytes], *, changing: bool) -> list[bytes]:
    """The bodies with the Anthropic SDK's key order (sorted: `max_tokens` first), its
    value sized to the room left every turn (`changing`) or constant."""
    out = []
    for k, body in enumerate(bodies):
        fields = json.loads(body)
        fields["max_tokens"] = 128_000 - 3_001 * k if changing else 128_000
        out.append(json.dumps(dict(sorted(fields.items()))).encode())
    return out


async def changing_head_row(fresh: FreshUrl, is_pg: bool, bodies: list[bytes]) -> Row:
    """A field before the messages that changes every turn (`recorder.server.deltas`:
    a body's stream) against the same bodies with it constant, as the server stores them."""
    measured: dict[bool, tuple[int, BodyTimes]] = {}
    for changing in (True, False):
        ordered = sdk_order(bodies, changing=changing)
        async with fresh() as url:
            fill = functools.partial(store_bodies, url, ordered, deltas=True, basis=True)
            measured[changing] = await arrays_on_disk(url, is_pg, fill)
    (on, t_on), (off, t_off) = measured[True], measured[False]
    return (
        f"bodies {TURNS} turns, server deltas, max_tokens first and changing every turn",
        "postgres" if is_pg else "sqlite",
        f"{on / 1e3:,.0f} kB; put {t_on.put_s * 1e3:.1f} ms/turn (CPU {t_on.put_cpu_s * 1e3:.2f}); "
        f"cold read {t_on.cold_read_s * 1e3:.0f} ms",
        f"max_tokens constant {off / 1e3:,.0f} kB; put {t_off.put_s * 1e3:.1f} ms "
        f"(CPU {t_off.put_cpu_s * 1e3:.2f}); read {t_off.cold_read_s * 1e3:.0f} ms",
        f"{on / off:.2f}x the bytes, put CPU {t_on.put_cpu_s / t_off.put_cpu_s:.2f}x",
    )


# -- a live server's per-turn arrays, realistic content ----------------------------


def agent_turn_ids(bodies: list[bytes]) -> list[np.ndarray]:
    """Engine input ids per turn: each turn's input is the previous input plus
    its new messages' text through the fixture tokenizer (real token ids, not
    random ones: they compress like a model's)."""
    from recorder.model.tokenizer import load_tokenizer

    tok = load_tokenizer(str(Path(__file__).resolve().parents[1] / "tests/data/smollm2-tokenizer"))
    out: list[np.ndarray] = []
    seen = 0
    for body in bodies:
        req = json.loads(body)
        preamble = "" if out else json.dumps(req["system"]) + json.dumps(req["tools"])
        new = preamble + json.dumps(req["messages"][seen:])
        seen = len(req["messages"])
        ids = np.asarray(tok.encode(new), np.int32)
        out.append(ids if not out else np.concatenate([out[-1], ids]))
    return out


async def store_server_turns(
    url: str,
    bodies: list[bytes],
    inputs: list[np.ndarray],
    *,
    deltas: bool,
    sizes: dict[str, int] | None = None,
) -> list[float]:
    """Seconds per turn to store a turn's body and engine input: as the server does
    (`deltas`: `put_body`, input as the suffix of the previous input) or whole
    every turn. `sizes` gets the stored (compressed) bytes per dtype."""
    store = await open_store(url, create=True)
    out = []
    previous, prev_input = BodyPrefixes(), None
    try:
        for body, ids in zip(bodies, inputs, strict=True):
            t0 = time.perf_counter()
            if deltas:
                _, previous = await put_body(store, previous, body)
                start = prev_input.length if prev_input is not None else 0
                prev_input = await store.put_array(ids[start:], extends=prev_input)
            else:
                await store.put_array(np.frombuffer(body, np.uint8))
                await store.put_array(ids)
            out.append(time.perf_counter() - t0)
        if sizes is not None and isinstance(store, SqlEventStore):
            async with store.read_engine.connect() as conn:
                query = sa.text(
                    "SELECT dtype, SUM(LENGTH(data) + COALESCE(LENGTH(data_tail), 0)) "
                    "FROM arrays GROUP BY dtype"
                )
                sizes.update((d, int(n)) for d, n in (await conn.execute(query)).all())
    finally:
        await store.close()
    return out


async def server_turn_rows(fresh: FreshUrl, is_pg: bool) -> list[Row]:
    bodies = agent_bodies()
    inputs = agent_turn_ids(bodies)
    backend = "postgres" if is_pg else "sqlite"
    times: dict[bool, list[float]] = {}
    disk: dict[bool, int] = {}
    sizes: dict[bool, dict[str, int]] = {True: {}, False: {}}
    for deltas in (True, False):

        async def fill(url: str, deltas: bool = deltas) -> BodyTimes:
            times[deltas] = await store_server_turns(
                url, bodies, inputs, deltas=deltas, sizes=sizes[deltas]
            )
            return BodyTimes(0.0, 0.0)

        async with fresh() as url:
            disk[deltas], _ = await arrays_on_disk(url, is_pg, functools.partial(fill, url))
    ours, whole = statistics.median(times[True]), statistics.median(times[False])
    return [
        (
            f"turn: body + input ids, {TURNS} turns to {len(inputs[-1]):,} tokens, median",
            backend,
            f"{ours * 1e3:.2f} ms/turn, {disk[True] / 1e3:,.0f} kB on disk",
            f"whole every turn {whole * 1e3:.2f} ms, {disk[False] / 1e3:,.0f} kB",
            f"{whole / ours:.1f}x faster, {disk[False] / disk[True]:.1f}x smaller",
        ),
        per_context_token_row(backend, len(inputs[-1]), sizes),
    ]


def per_context_token_row(backend: str, tokens: int, sizes: dict[bool, dict[str, int]]) -> Row:
    """The same session's stored arrays per token of its last context, by kind.

    A live log also holds events (~2 B per context token); `bench_training`
    prints a live server's log by kind, events included.
    """

    def kinds(by_dtype: dict[str, int]) -> str:
        ids, bodies = by_dtype.get("int32", 0) / tokens, by_dtype.get("uint8", 0) / tokens
        return f"ids {ids:.2f} + bodies {bodies:.2f} = {ids + bodies:.2f} B"

    ours, whole = (sum(sizes[k].values()) for k in (True, False))
    return (
        f"turn arrays per context token ({tokens:,} tokens at the end)",
        backend,
        kinds(sizes[True]),
        f"whole every turn: {kinds(sizes[False])}",
        f"{whole / max(ours, 1):.1f}x smaller",
    )


# -- small-append latency -------------------------------------------------------

LATENCY_WARMUP, LATENCY_TURNS, TURN_ARRAY = 20, 100, 50
Turn = Callable[[EventStore, int, np.random.Generator], Awaitable[object]]


def turn_events(i: int, ref: ArrayRef) -> list[NewEvent]:
    detail = {"turn": i, "ref": ref.digest.hex()}
    return [NewEvent(event=SandboxEvent(kind=k, detail=detail)) for k in ("in", "out", "sent")]


def turn_array(rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, VOCAB, TURN_ARRAY, dtype=np.int32)


async def turn_with_arrays(store: EventStore, i: int, rng: np.random.Generator) -> object:
    encoded = codec.encode_array(turn_array(rng))
    return await store.append("turns", turn_events(i, encoded.ref), arrays=[encoded])


async def turn_put_then_append(store: EventStore, i: int, rng: np.random.Generator) -> object:
    ref = await store.put_array(turn_array(rng))
    return await store.append("turns", turn_events(i, ref))


async def turn_latencies(url: str, turn: Turn, *, fast: bool = True) -> list[float]:
    """Seconds per turn, sequential, after a warm-up (`fast=False`: the generic path)."""
    store = await open_store(url, create=True)
    assert isinstance(store, SqlEventStore)
    store.fast_writes = fast
    rng = np.random.default_rng(7)
    out = []
    try:
        for i in range(LATENCY_WARMUP + LATENCY_TURNS):
            t0 = time.perf_counter()
            await turn(store, i, rng)
            if i >= LATENCY_WARMUP:
                out.append(time.perf_counter() - t0)
    finally:
        await store.close()
    return out


async def raw_sqlite_turn_latencies(url: str) -> list[float]:
    """The same turns through raw sqlite3, in the store's schema, with the
    store's pragmas: one BEGIN IMMEDIATE, the piece, the events, COMMIT."""
    await (await open_store(url, create=True)).close()
    conn = sqlite3.connect(_path(url))
    configure_connection(conn, WRITER_CACHE_KIB)
    rng = np.random.default_rng(7)
    out = []
    for i in range(LATENCY_WARMUP + LATENCY_TURNS):
        t0 = time.perf_counter()
        encoded = codec.encode_array(turn_array(rng))
        (piece,) = encoded.pieces
        now = time.time()
        rows = [
            (
                3 * i + k + 1,
                "turns",
                3 * i + k,
                ne.event_id.bytes,
                type_name(ne.event),
                type(ne.event).VERSION,
                now,
                encode_event(ne.event),
            )
            for k, ne in enumerate(turn_events(i, encoded.ref))
        ]
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            INSERT_PIECE_SQL,
            {
                "digest": piece.digest,
                "parent": piece.parent,
                "dtype": piece.dtype,
                "total_length": piece.total_length,
                "codec": piece.codec,
                "data": piece.data,
                "data_tail": None,
                "basis": None,
                "basis_depth": 0,
            },
        )
        conn.executemany(INSERT_EVENTS_SQL, rows)
        conn.execute("COMMIT")
        if i >= LATENCY_WARMUP:
            out.append(time.perf_counter() - t0)
    conn.close()
    return out


def fmt_latency(samples: list[float]) -> str:
    return f"p50 {pct(samples, 50):.2f} ms, p99 {pct(samples, 99):.2f} ms"


def latency_ratio(ours: list[float], base: list[float]) -> str:
    return f"{statistics.median(base) / statistics.median(ours):.2f}x faster p50"


async def latency_rows(fresh: FreshUrl, is_pg: bool, rounds: int) -> list[Row]:
    backend = "postgres" if is_pg else "sqlite"
    modes: dict[str, Callable[[str], Awaitable[list[float]]]] = {
        "arrays": lambda url: turn_latencies(url, turn_with_arrays),
        "generic": lambda url: turn_latencies(url, turn_with_arrays, fast=False),
        "put+append": lambda url: turn_latencies(url, turn_put_then_append),
    }
    if not is_pg:
        modes["raw"] = raw_sqlite_turn_latencies
    samples: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(rounds):
        for mode, run in modes.items():
            async with fresh() as url:
                samples[mode] += await run(url)
    label = f"turn: 3-event append + {TURN_ARRAY}-int array"
    ours = samples["arrays"]
    rows: list[Row] = [
        (
            f"{label}, fast path vs generic",
            backend,
            fmt_latency(ours),
            f"generic path {fmt_latency(samples['generic'])}",
            latency_ratio(ours, samples["generic"]),
        )
    ]
    if not is_pg:
        rows += [
            (
                f"{label}, one hop vs raw sqlite3",
                backend,
                fmt_latency(ours),
                f"raw sqlite3 {fmt_latency(samples['raw'])}",
                f"{statistics.median(ours) / statistics.median(samples['raw']):.2f}x raw time",
            ),
        ]
    rows.append(
        (
            f"{label}, arrays= vs put_array+append",
            backend,
            fmt_latency(samples["arrays"]),
            f"2 commits {fmt_latency(samples['put+append'])}",
            latency_ratio(samples["arrays"], samples["put+append"]),
        )
    )
    return rows


# -- Postgres scratch database ------------------------------------------------


async def pg_database(admin_url: str) -> tuple[str, Callable[[], Awaitable[None]]]:
    import asyncpg

    admin = admin_url.replace("postgresql+asyncpg", "postgresql")
    name = f"bench_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(admin)
    await conn.execute(f'CREATE DATABASE "{name}"')
    await conn.close()

    async def drop() -> None:
        c = await asyncpg.connect(admin)
        await c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await c.close()

    url = admin_url.rpartition("/")[0] + "/" + name
    if url.startswith("postgresql://"):
        url = "postgresql+asyncpg://" + url.removeprefix("postgresql://")
    return url, drop


# -- main -----------------------------------------------------------------------


def fmt_rate(x: float) -> str:
    return f"{x:,.0f} ev/s"


FreshUrl = Callable[[], AbstractAsyncContextManager[str]]


class Batched(msgspec.Struct, frozen=True):
    """Medians over the rounds of one batched comparison."""

    ours: Rate
    raw: Rate
    ratios: list[float]  # per round, ours / raw events per second, sorted

    def row(self, label: str, backend: str, driver: str) -> Row:
        lo, mid, hi = self.ratios[0], statistics.median(self.ratios), self.ratios[-1]
        cpu_ratio = self.raw.cpu_s / self.ours.cpu_s
        return (
            label,
            backend,
            f"{fmt_rate(self.ours.per_s)}, CPU {self.ours.cpu_s * 1e6:.1f} us/event",
            f"raw {driver} {fmt_rate(self.raw.per_s)}, CPU {self.raw.cpu_s * 1e6:.1f} us/event",
            f"{mid:.2f}x raw ({lo:.2f}-{hi:.2f}, {len(self.ratios)} rounds), CPU {cpu_ratio:.2f}x",
        )


async def batched_rounds(
    fresh: FreshUrl, is_pg: bool, events: int, rounds: int, new_id: NewId
) -> Batched:
    """Store and raw driver on the same events, in the order ABBA BAAB ... so
    drifting load hits both alike; medians of the rates, CPU per event and of
    the per-round ratios (CPU: this process, all threads, so the raw driver's
    share of a Postgres server's work is not counted on either side)."""
    ours: list[Rate] = []
    raw: list[Rate] = []

    async def run_ours(batches: list[list[NewEvent]]) -> None:
        async with fresh() as url:
            ours.append(await store_batched(url, batches))

    async def run_raw(batches: list[list[NewEvent]]) -> None:
        async with fresh() as url:
            raw.append(
                await raw_pg_batched(url, batches)
                if is_pg
                else raw_sqlite_batched(_path(url), batches)
            )

    for r in range(rounds):
        batches = make_batches(events, new_id)
        first, second = (run_ours, run_raw) if r % 2 == 0 else (run_raw, run_ours)
        await first(batches)
        await second(batches)

    def median(rates: list[Rate]) -> Rate:
        return Rate(
            statistics.median(x.per_s for x in rates), statistics.median(x.cpu_s for x in rates)
        )

    ratios = sorted(o.per_s / r.per_s for o, r in zip(ours, raw, strict=True))
    return Batched(median(ours), median(raw), ratios)


async def bench_backend(
    backend: str,
    fresh: FreshUrl,
    events: int,
    rounds: int,
    per_appender: int,
    batched_rounds_n: int,
    batched_only: bool = False,
) -> list[Row]:
    """The measurements on one backend, each on a fresh database."""
    is_pg = backend == "postgres"
    driver = "asyncpg" if is_pg else "sqlite3"
    target = "15,000" if is_pg else "50,000"
    rows: list[Row] = []
    for kind, new_id in ID_KINDS.items():
        batched = await batched_rounds(fresh, is_pg, events, batched_rounds_n, new_id)
        label = f"batched x{BATCH} live-sized events, {kind} ids (>= {target}/s, >= 0.9x raw)"
        rows.append(batched.row(label, backend, driver))
    if batched_only:
        return rows
    async with fresh() as url:
        grouped = await concurrent_singles(url, per_appender, grouped=True)
    async with fresh() as url:
        single = await concurrent_singles(url, max(1, per_appender // 5), grouped=False)
    async with fresh() as url:
        per_token, data_per_token, ratio = await (
            token_storage_pg(url) if is_pg else token_storage_sqlite(url)
        )
    bodies = await body_storage(fresh, is_pg)
    bodies += await server_turn_rows(fresh, is_pg)
    latency = await latency_rows(fresh, is_pg, rounds)
    return [
        *rows,
        (
            f"{APPENDERS} appenders, 1 event each (>= 10x)",
            backend,
            f"group {fmt_rate(grouped)}",
            f"txn/event {fmt_rate(single)}",
            f"{grouped / single:.1f}x",
        ),
        (
            f"tokens {TURNS}x{TOKENS_PER_TURN}/turn (<= 2.5 B, >= 15x)",
            backend,
            f"{per_token:.2f} B/unique token on disk ({data_per_token:.2f} B compressed)",
            "every full prompt, raw int32, on disk",
            f"{ratio:.1f}x smaller",
        ),
        *bodies,
        *latency,
    ]


def _path(url: str) -> Path:
    return Path(url.split(":///", 1)[1])


class Args(msgspec.Struct, frozen=True):
    events: int
    rounds: int
    batched_rounds: int
    per_appender: int
    batched_only: bool
    pg: str | None


async def bench(args: Args) -> list[Row]:
    pg_admin = args.pg
    common = (args.events, args.rounds, args.per_appender, args.batched_rounds, args.batched_only)
    with tempfile.TemporaryDirectory() as d:
        names = iter(range(1_000_000))

        @asynccontextmanager
        async def fresh_sqlite() -> AsyncIterator[str]:
            yield f"sqlite+aiosqlite:///{Path(d) / f'bench{next(names)}.db'}"

        rows = await bench_backend("sqlite", fresh_sqlite, *common)
    if pg_admin:

        @asynccontextmanager
        async def fresh_pg() -> AsyncIterator[str]:
            url, drop = await pg_database(pg_admin)
            try:
                yield url
            finally:
                await drop()

        rows += await bench_backend("postgres", fresh_pg, *common)
    return rows


def print_table(rows: list[Row]) -> None:
    print_grid(("benchmark", "backend", "result", "baseline (same run)", "ratio"), rows)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--pg", default=os.environ.get("TR_TEST_POSTGRES_URL"), help="Postgres admin URL"
    )
    ap.add_argument("--events", type=int, default=50_000, help="events per batched run")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the latency comparisons")
    ap.add_argument(
        "--batched-rounds", type=int, default=10, help="store/raw batched runs, alternating"
    )
    ap.add_argument("--per-appender", type=int, default=20, help="events per concurrent appender")
    ap.add_argument("--batched-only", action="store_true", help="only the batched comparison")
    a = ap.parse_args()
    args = Args(a.events, a.rounds, a.batched_rounds, a.per_appender, a.batched_only, a.pg)
    probe_before = speed_probe_ms()
    print_table(asyncio.run(bench(args)))
    print(f"{load_average()}; {probe_span(probe_before)}")


if __name__ == "__main__":
    main()
