"""kill -9 mid-burst loses no acknowledged event and leaves a clean store."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path

from recorder.log.events import NewEvent, SandboxEvent
from recorder.log.store import open_store

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


async def test_sigkill_mid_burst_keeps_every_acknowledged_event(store_url: str) -> None:
    store = await open_store(store_url, create=True)
    await store.close()
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HERE / "burst_writer.py"),
        store_url,
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    acked: list[uuid.UUID] = []
    try:
        assert (await asyncio.wait_for(proc.stdout.readline(), 60)).strip() == b"ready"
        while len(acked) < 300:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line, "the writer exited early"
            acked.append(uuid.UUID(line.decode().strip()))
    finally:
        proc.send_signal(signal.SIGKILL)
        # Lines the writer printed before dying are acknowledged too.
        rest = await proc.stdout.read()
        await proc.wait()
    acked += [uuid.UUID(x) for x in rest.decode().split() if len(x) == 36]
    assert proc.returncode == -signal.SIGKILL

    async with await open_store(store_url) as after:
        stored = {e.event_id for e in await after.read_all(limit=1_000_000)}
        assert set(acked) <= stored
        for sid in await after.session_ids():
            seqs = [e.seq for e in await after.read_session(sid)]
            assert seqs == list(range(len(seqs)))
        await after.append("after-crash", [NewEvent(event=SandboxEvent(kind="ok"))])
