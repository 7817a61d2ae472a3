"""Replicas: many `recorder serve` processes on one Postgres serve any turn of any session.

Every request of every session goes to a random replica, concurrently, and one
replica is SIGKILLed mid-run. Its state being a cache of the log, a replica
catches up from the session's head under the session's database lock, so no
request sees a ConcurrencyConflict. SQLite allows one server per file.

Without a working lock (one server takes none, or the lock connections are
killed while turns run) two servers plan from one head; the log refuses the
second claim and that server plans again (tests/server/test_replica_conflicts.py
makes each case happen deterministically): clients still get their answers.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import msgspec
import pytest

from recorder.log import events as ev
from replay.export import read_samples
from replay.samples import Sample
from tests.server.conftest import FIXTURE_TOKENIZER, make_harness
from tests.server.test_e2e import echo
from tests.server.test_lifecycle import _admin, _start_serve
from tools.test_engine.scripted import ScriptedEngine

SESSIONS = 12
TURNS = 6
KILL_AFTER_TURNS = 25
# One session's concurrent conversations (as an agent's subagents), turns each.
LINES = 4
LINE_TURNS = 6


class Run:
    """The replicas still alive, and what the clients saw."""

    def __init__(self, procs: list[tuple[asyncio.subprocess.Process, str]]) -> None:
        self.procs = procs
        self.live = [base for _, base in procs]
        self.answered: dict[str, list[str]] = {}  # session -> acknowledged message ids
        self.server_errors: list[str] = []
        self.killed_in_flight = 0
        self.turns_done = 0
        self.samples: dict[str, list[dict[str, Any]]] = {}

    def pick(self) -> str:
        return random.choice(self.live)


async def _turn(run: Run, sid: str, messages: list[dict[str, Any]]) -> Any:
    """One turn on random replicas: a connection error (the killed one) is retried elsewhere."""
    while True:
        base = run.pick()
        client = anthropic.AsyncAnthropic(base_url=base, api_key=sid, max_retries=0)
        try:
            return await client.messages.create(model="m", max_tokens=40, messages=messages)
        except anthropic.APIConnectionError:
            if base in run.live:
                raise
            run.killed_in_flight += 1
        except anthropic.APIStatusError as exc:
            if exc.status_code >= 500:
                run.server_errors.append(f"{sid}: {exc.status_code} {exc.message}")
            raise
        finally:
            await client.close()


async def _session(run: Run, i: int) -> None:
    sid = (await _admin(run.pick(), "POST", "/sessions", {"session_id": f"rep-{i}"}))["session_id"]
    run.answered[sid] = []
    messages: list[dict[str, Any]] = []
    for t in range(TURNS):
        messages.append({"role": "user", "content": f"step {t} of session {i}"})
        answer = await _turn(run, sid, messages)
        run.answered[sid].append(answer.id)
        messages.append(echo(answer))
        run.turns_done += 1
        await asyncio.sleep(random.random() * 0.02)
    while True:
        base = run.pick()
        try:
            closed = await _admin(base, "POST", f"/sessions/{sid}/close", {"reward": float(i)})
            break
        except aiohttp.ClientError:
            if base in run.live:
                raise
    assert "samples" in closed, closed
    run.samples[sid] = closed["samples"]


async def _kill_one(run: Run) -> None:
    while run.turns_done < KILL_AFTER_TURNS:
        await asyncio.sleep(0.01)
    proc, base = run.procs[0]
    run.live.remove(base)
    proc.send_signal(signal.SIGKILL)
    await proc.wait()


def _exported(db_url: str, out: Path) -> dict[str, list[Sample]]:
    done = subprocess.run(
        [sys.executable, "-m", "replay.cli", "export", "--db", db_url, "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    by_session: dict[str, list[Sample]] = {}
    for sample in read_samples(out, "jsonl"):
        by_session.setdefault(sample.session_id, []).append(sample)
    return by_session


async def test_three_replicas_random_routing_and_a_kill(
    tokenizer: Any, postgres_url: str, tmp_path: Path
) -> None:
    from recorder.log.store import open_store

    random.seed(14)
    async with ScriptedEngine(tokenizer, context_length=4096) as engine:
        procs = [await _start_serve(engine.url, postgres_url) for _ in range(3)]
        run = Run(procs)
        try:
            await asyncio.gather(_kill_one(run), *(_session(run, i) for i in range(SESSIONS)))
        finally:
            for proc, _ in procs:
                if proc.returncode is None:
                    proc.terminate()
                    await proc.wait()
    assert run.server_errors == []
    assert len(run.live) == 2 and len(run.samples) == SESSIONS
    store = await open_store(postgres_url)
    unseen = 0  # answers made durable by the killed replica that never reached the client
    try:
        for sid, ids in run.answered.items():
            events = [r.event for r in await store.read_session(sid)]
            sent = [e.request_id for e in events if isinstance(e, ev.ResponseSent)]
            rest = iter(sent)
            assert all(i in rest for i in ids), sid  # every acknowledged answer, in order
            unseen += len(sent) - len(ids)
            actions = [e.action for e in events if isinstance(e, ev.ChainDecision)]
            if len(sent) == len(ids):
                assert actions[0] == "new" and set(actions[1:]) == {"extend"}, (sid, actions)
    finally:
        await store.close()
    # The kill may fall between a turn's durable answer and its send: the client
    # retries elsewhere, and that answer stays in the log, unseen (as after kill -9).
    assert unseen <= run.killed_in_flight, (unseen, run.killed_in_flight)
    exported = _exported(postgres_url, tmp_path / "samples.jsonl")
    for sid, live in run.samples.items():
        assert [msgspec.convert(s, Sample) for s in live] == exported[sid], sid


async def test_a_second_server_on_one_sqlite_file_is_refused(
    tokenizer: Any, tmp_path: Path
) -> None:
    db = tmp_path / "runs.db"
    async with ScriptedEngine(tokenizer, context_length=4096) as engine:
        proc, _ = await _start_serve(engine.url, db)
        try:
            second = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "recorder.cli", "serve", "--db", str(db),
                "--engine", engine.url, "--tokenizer", str(FIXTURE_TOKENIZER),
                "--chat-template", "chatml-tools", "--port", "0",
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )  # fmt: skip
            output, _ = await asyncio.wait_for(second.communicate(), timeout=60)
        finally:
            proc.terminate()
            await proc.wait()
    assert second.returncode != 0
    assert "another `recorder serve` already serves" in output.decode(), output.decode()


class Contended:
    """Two in-process servers serving one session's concurrent conversations."""

    def __init__(self, bases: list[str], session_id: str, admin: dict[str, str]) -> None:
        self.bases = bases
        self.session_id = session_id
        self.admin_headers = admin
        self.answered: list[str] = []  # acknowledged message ids
        self.noted: list[str] = []  # acknowledged rollout events (their detail's id)
        self.server_errors: list[str] = []
        self.retryable = 0  # 529s a client retried (allowed: a retry is safe)

    async def ask(self, messages: list[dict[str, Any]]) -> Any:
        while True:
            base = random.choice(self.bases)
            client = anthropic.AsyncAnthropic(
                base_url=base, api_key=self.session_id, max_retries=0, timeout=60
            )
            try:
                return await client.messages.create(model="m", max_tokens=40, messages=messages)
            except anthropic.APIStatusError as exc:
                retry = exc.response.headers.get("x-should-retry") != "false"
                if exc.status_code not in (503, 529) or not retry:
                    self.server_errors.append(f"{exc.status_code} {exc.message}")
                    raise
                self.retryable += 1
            finally:
                await client.close()

    async def admin(self, path: str, body: Any) -> Any:
        while True:
            async with (
                aiohttp.ClientSession() as http,
                http.post(
                    random.choice(self.bases) + path, json=body, headers=self.admin_headers
                ) as resp,
            ):
                data = await resp.json()
                if resp.status < 300:
                    return data
                if resp.status not in (503, 529):
                    self.server_errors.append(f"{resp.status} {data}")
                    raise AssertionError(data)
                self.retryable += 1

    async def line(self, i: int) -> None:
        messages: list[dict[str, Any]] = []
        for t in range(LINE_TURNS):
            messages.append({"role": "user", "content": f"line {i}, step {t}"})
            answer = await self.ask(messages)
            self.answered.append(answer.id)
            messages.append(echo(answer))
            note = f"{i}.{t}"
            event = {"kind": "agent.step", "detail": {"id": note}}
            await self.admin(f"/sessions/{self.session_id}/events", {"events": [event]})
            self.noted.append(note)


async def _kill_lock_connections(url: str, stop: asyncio.Event, killing: bool) -> int:
    """Terminate every connection holding a session lock, again and again: Postgres
    frees their locks while the turns they guard run on. Returns how many it killed."""
    import asyncpg

    from recorder.log.store.session_locks import SESSION_LOCK_CLASS

    killed = 0
    if not killing:
        return killed
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
    try:
        while not stop.is_set():
            killed += await conn.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_locks WHERE locktype = "
                "'advisory' AND classid = $1 AND pid <> pg_backend_pid()",
                SESSION_LOCK_CLASS,
            )
            await asyncio.sleep(random.uniform(0.005, 0.04))
    finally:
        await conn.close()
    return killed


@pytest.mark.postgres
@pytest.mark.parametrize("lock", ["one_server_takes_none", "lock_connections_killed"])
async def test_one_session_on_two_servers_without_a_working_lock(
    tokenizer: Any, postgres_url: str, tmp_path: Path, lock: str
) -> None:
    from recorder.log.store import open_store
    from recorder.log.store.base import SessionLocks

    random.seed(14)
    h = await make_harness(tokenizer, postgres_url, engine_kwargs={"token_delay_s": 0.001})
    store = await open_store(postgres_url)
    if lock == "one_server_takes_none":
        store.session_locks = SessionLocks()  # a process that takes no lock
    second = await h.server_on(store)
    stop = asyncio.Event()
    try:
        run = Contended([h.url, second.url], await h.open_session(), h.admin_headers())
        killing = lock == "lock_connections_killed"
        killer = asyncio.ensure_future(_kill_lock_connections(postgres_url, stop, killing))
        await asyncio.gather(*(run.line(i) for i in range(LINES)))
        stop.set()
        killed = await killer
        closed = await run.admin(f"/sessions/{run.session_id}/close", {"reward": 1.0})
        healths = [await _get_json(base + "/health") for base in run.bases]
    finally:
        stop.set()
        await second.stop(grace_s=1)
        await store.close()
        await h.close()
    retried = sum(health["conflicts_retried"] for health in healths)
    print(f"\n{lock}: {retried} conflicts retried, {run.retryable} 529s, {killed} kills")
    assert run.server_errors == []
    assert lock != "lock_connections_killed" or killed > 0
    assert lock != "one_server_takes_none" or retried > 0  # the race did happen
    store = await open_store(postgres_url)
    try:
        events = [r.event for r in await store.read_session(run.session_id)]
    finally:
        await store.close()
    sent = {e.request_id for e in events if isinstance(e, ev.ResponseSent)}
    assert set(run.answered) <= sent  # every acknowledged answer is in the log
    notes = [e.detail["id"] for e in events if isinstance(e, ev.SandboxEvent)]
    assert sorted(notes) == sorted(run.noted)  # each acknowledged rollout event, once
    turns = [e.turn for e in events if isinstance(e, ev.MessagesRequest)]
    assert len(turns) == len(set(turns))  # no turn number claimed twice
    exported = _exported(postgres_url, tmp_path / "samples.jsonl")
    live = [msgspec.convert(s, Sample) for s in closed["samples"]]
    assert live == exported[run.session_id]
    assert sum(len(s.tokens) for s in live) > 0


async def _get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return await resp.json()


async def _open_count_settles(bases: list[str], sessions: int) -> list[Any]:
    """/health of each replica once none holds a session open (the close watch polls)."""
    for _ in range(400):
        healths = [await _get_json(base + "/health") for base in bases]
        if all(h["sessions_open"] == 0 for h in healths):
            return healths
        await asyncio.sleep(0.05)
    raise AssertionError(f"replicas still hold closed sessions as open: {healths}")


@pytest.mark.postgres
@pytest.mark.parametrize("routing", ["sticky", "random"])
async def test_replicas_drop_sessions_closed_elsewhere(
    tokenizer: Any, postgres_url: str, routing: str
) -> None:
    """Issue 24 item 2. `sticky`: the README's recipe routes by bearer token, so each
    session's turns land on one replica and every admin close (one token) on the
    other; `random`: every request on either. Afterwards neither replica holds a
    closed session as open, and a turn on a dropped one is refused as closed (the
    session is rebuilt from the log)."""
    from recorder.log.store import open_store

    random.seed(24)
    sessions = 8
    h = await make_harness(tokenizer, postgres_url, admin_token="tok", close_watch_interval_s=0.05)
    store = await open_store(postgres_url)
    other = await h.server_on(store)
    bases = [h.url, other.url]
    try:
        sids = [
            await _admin(random.choice(bases), "POST", "/sessions", {}) for _ in range(sessions)
        ]
        ids = [s["session_id"] for s in sids]
        for sid in ids:
            for t in range(2):
                base = h.url if routing == "sticky" else random.choice(bases)
                client = anthropic.AsyncAnthropic(base_url=base, api_key=sid, max_retries=0)
                try:
                    await client.messages.create(
                        model="m", max_tokens=8, messages=[{"role": "user", "content": f"t{t}"}]
                    )
                finally:
                    await client.close()
        served_open = h.ctx.registry.open_count()
        assert served_open > 0  # the first replica held sessions it served
        for sid in ids:
            base = other.url if routing == "sticky" else random.choice(bases)
            await _admin(base, "POST", f"/sessions/{sid}/close", {"reward": 1.0})
        healths = await _open_count_settles(bases, sessions)
        print(f"\n{routing}: first replica held {served_open} open, then {healths}")
        assert sum(health["sessions_closed_elsewhere"] for health in healths) >= (
            sessions if routing == "sticky" else 1
        )
        client = anthropic.AsyncAnthropic(base_url=h.url, api_key=ids[0], max_retries=0)
        try:
            with pytest.raises(anthropic.APIStatusError) as refused:
                await client.messages.create(
                    model="m", max_tokens=8, messages=[{"role": "user", "content": "after"}]
                )
        finally:
            await client.close()
        assert refused.value.status_code == 409
    finally:
        await other.stop(grace_s=1)
        await store.close()
        await h.close()
