"""Storage failures seen from a client (issue 15): a real full disk under a real server.

The SQLite log lives on a small tmpfs; a filler file takes the rest of it.
For Postgres the database is taken away from under the store: connections
to it refused (`ALLOW_CONNECTIONS false`) and the store's own terminated, as
a stopped server looks to a client, without stopping the cluster other tests
share. While the disk is full (or the database gone) every turn answers 529 `overloaded_error` with a plain
message (no driver text, retryable) and `/health` answers 503 naming the
cause; once space is freed the next turn is served and `/health` is ok again.
Every answer the client got a 200 for is in the log afterwards.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from recorder.log import events as ev
from recorder.model.tokenizer import Tokenizer
from tests.conftest import _postgres_admin_url, missing
from tests.server.conftest import Harness, make_harness


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        missing(
            f"cannot mount a small tmpfs: {done.stderr.decode().strip()}",
            "run the tests as root in a container that allows mount (CI does)",
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
async def harness_on_small_fs(tokenizer: Tokenizer, small_fs: Path) -> AsyncIterator[Harness]:
    h = await make_harness(tokenizer, f"sqlite+aiosqlite:///{small_fs / 'runs.db'}")
    try:
        yield h
    finally:
        await h.close()


def fill(directory: Path) -> Path:
    """Take every free byte of the filesystem holding `directory`."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


async def turn(h: Harness, sid: str, text: str) -> tuple[int, dict[str, str], Any]:
    assert h.http is not None
    raw = json.dumps(
        {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
    )
    headers = {"Authorization": f"Bearer {sid}", "Content-Type": "application/json"}
    async with h.http.post(h.url + "/v1/messages", data=raw, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def health(h: Harness) -> tuple[int, Any]:
    assert h.http is not None
    async with h.http.get(h.url + "/health") as resp:
        return resp.status, await resp.json()


async def test_disk_full(harness_on_small_fs: Harness, small_fs: Path) -> None:
    h = harness_on_small_fs
    sid = await h.open_session()
    answered: list[str] = []
    status, _, data = await turn(h, sid, "before")
    assert status == 200
    answered.append(data["id"])

    filler = fill(small_fs)
    failures: list[tuple[dict[str, str], Any]] = []
    for i in range(60):  # the log's pages already allocated may take a few turns
        status, headers, data = await turn(h, sid, f"while full {i} " + "x" * 20_000)
        if status == 200:
            answered.append(data["id"])
            continue
        assert status == 529, data
        failures.append((headers, data))
        if len(failures) == 3:
            break
    assert failures, "the disk never filled up"
    print(f"\n{len(answered)} answered, then 529: {failures[0][1]['error']['message']}")
    for headers, data in failures:
        assert data["type"] == "error" and data["error"]["type"] == "overloaded_error", data
        message = data["error"]["message"]
        assert "the disk is full" in message, message
        assert "sqlalchemy" not in message.lower() and "logged and recorded" not in message
        assert headers.get("x-should-retry") != "false"
    status, data = await health(h)
    assert status == 503 and data["status"] == "storage_failing", data
    assert data["storage"] == "the disk is full"

    filler.unlink()
    status, _, data = await turn(h, sid, "after")
    assert status == 200, data
    answered.append(data["id"])
    status, data = await health(h)
    assert status == 200 and data["status"] == "ok" and data["storage"] == "ok", data

    # Zero acknowledged answers lost: each 200 is in the log, read by a new store.
    await h.restart()
    sent = [e.request_id for e in await h.payloads(sid, ev.ResponseSent)]
    assert sorted(sent) == sorted(answered)


async def _set_database_reachable(url: str, reachable: bool) -> None:
    import asyncpg

    name = url.rpartition("/")[2]
    admin = _postgres_admin_url().replace("postgresql+asyncpg", "postgresql")
    conn = await asyncpg.connect(admin)
    try:
        await conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(reachable).lower()}')
        if not reachable:
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", name
            )
    finally:
        await conn.close()


async def test_database_stopped(tokenizer: Tokenizer, postgres_url: str) -> None:
    h = await make_harness(tokenizer, postgres_url)
    try:
        sid = await h.open_session()
        status, _, data = await turn(h, sid, "before")
        assert status == 200
        answered = [data["id"]]

        await _set_database_reachable(postgres_url, False)
        status, headers, data = await turn(h, sid, "while stopped")
        assert status == 529, data
        message = data["error"]["message"]
        assert data["error"]["type"] == "overloaded_error"
        assert "the database is unreachable" in message, message
        for internal in ("asyncpg", "sqlalchemy", "127.0.0.1", "postgres", "logged and recorded"):
            assert internal not in message.lower(), message
        assert headers.get("x-should-retry") != "false"
        status, data = await health(h)
        assert status == 503 and data["storage"] == "the database is unreachable", data

        await _set_database_reachable(postgres_url, True)
        for _ in range(3):  # as a client retries a 529: the pool reconnects
            status, _, data = await turn(h, sid, "after")
            if status == 200:
                break
        assert status == 200, data
        answered.append(data["id"])
        status, data = await health(h)
        assert status == 200 and data["storage"] == "ok", data

        await h.restart()
        sent = [e.request_id for e in await h.payloads(sid, ev.ResponseSent)]
        assert sorted(sent) == sorted(answered)
    finally:
        await _set_database_reachable(postgres_url, True)
        await h.close()
