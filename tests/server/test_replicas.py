"""Replicas: many `recorder serve` processes on one Postgres serve any turn of any session.

Every request of every session goes to a random replica, concurrently, and one
replica is SIGKILLed mid-run. Its state being a cache of the log, a replica
catches up from the session's head under the session's database lock, so no
request sees a ConcurrencyConflict. SQLite allows one server per file.
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

from recorder import events as ev
from replay.export import read_samples
from replay.samples import Sample
from tests.server.conftest import FIXTURE_TOKENIZER
from tests.server.test_e2e import echo
from tests.server.test_lifecycle import _admin, _start_serve
from tools.test_engine.scripted import ScriptedEngine

SESSIONS = 12
TURNS = 6
KILL_AFTER_TURNS = 25


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
    from recorder.store import open_store

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
