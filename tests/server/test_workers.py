"""`recorder serve --workers N`: N processes on one port, each a replica on one Postgres log.

The kernel spreads new connections across the workers (SO_REUSEPORT), so one
session's turns reach different workers; every client opens a new connection
per turn here, which makes that happen on most turns. Each worker holds its
own session cache, so a turn served by the other worker must catch up from
the log: the chains stay exact (one "new", then only extensions), every
acknowledged answer is in the log in order, and the samples a close returns
live equal `replay export`'s. SQLite has one writer per file: `--workers 2`
on SQLite is refused before anything starts.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from recorder.log import events as ev
from recorder.log.store import open_store
from recorder.server import free_port
from replay.samples import Sample
from tests.server.conftest import FIXTURE_TOKENIZER
from tests.server.test_replicas import Run, _exported, _session
from tools.test_engine.scripted import ScriptedEngine

SESSIONS = 8


def _serve_args(engine_url: str, db: str, port: int, workers: int) -> list[str]:
    return [
        sys.executable, "-m", "recorder.cli", "serve", "--db", db, "--engine", engine_url,
        "--tokenizer", str(FIXTURE_TOKENIZER), "--chat-template", "chatml-tools",
        "--tool-parser", "qwen25", "--port", str(port), "--workers", str(workers),
    ]  # fmt: skip


async def _healthy(base: str, proc: subprocess.Popen[bytes]) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(1200):
            if proc.poll() is not None:
                raise RuntimeError(f"recorder serve exited with {proc.returncode}")
            try:
                async with http.get(base + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError("recorder serve --workers 2 did not become healthy")


async def test_two_workers_on_one_port_serve_one_sessions_turns_exactly(
    tokenizer: Any, postgres_url: str, tmp_path: Path
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "TR_ADMIN_TOKEN": "tok"}
    async with ScriptedEngine(tokenizer, context_length=4096) as engine:
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                _serve_args(engine.url, postgres_url, port, 2),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        try:
            await _healthy(base, proc)
            run = Run([])
            run.live = [base]  # one address: the kernel picks the worker
            await asyncio.gather(*(_session(run, i) for i in range(SESSIONS)))
        finally:
            proc.send_signal(signal.SIGTERM)
            status = await asyncio.to_thread(proc.wait, 60)
    log = log_path.read_text()
    assert status == 0, log
    served_by = {m.group(1) for m in re.finditer(r"\[(\d+)\]: turn session=", log)}
    assert len(served_by) == 2, log  # both workers served turns
    assert log.count("stopped; the log is flushed") == 2, log  # each stopped gracefully
    assert not run.server_errors, run.server_errors
    store = await open_store(postgres_url)
    try:
        for sid, ids in run.answered.items():
            events = [r.event for r in await store.read_session(sid)]
            sent = [e.request_id for e in events if isinstance(e, ev.ResponseSent)]
            assert sent == ids, sid  # every acknowledged answer, in order, nothing else
            actions = [e.action for e in events if isinstance(e, ev.ChainDecision)]
            assert actions[0] == "new" and set(actions[1:]) == {"extend"}, (sid, actions)
    finally:
        await store.close()
    exported = _exported(postgres_url, tmp_path / "samples.jsonl")
    for sid, live in run.samples.items():
        assert [msgspec.convert(s, Sample) for s in live] == exported[sid], sid


def test_workers_on_sqlite_are_refused_before_anything_starts(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    done = subprocess.run(
        _serve_args("http://127.0.0.1:9", str(db), free_port(), 2),
        capture_output=True,
        text=True,
        env={**os.environ, "TR_ADMIN_TOKEN": "tok"},
        timeout=120,
    )
    assert done.returncode != 0
    assert "--workers 2 needs a Postgres --db" in done.stderr, done.stderr
    assert not db.exists()
