"""Schema revision checks and the `recorder db` commands."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from recorder.cli import main
from recorder.log.events import NewEvent, RewardAssigned, SandboxEvent, SessionOpened
from recorder.log.store import SchemaOutOfDate, open_store
from recorder.log.store.migrations import head_revision
from recorder.log.store.postgres import TOAST_CHUNK_BYTES

RawExecute = Callable[..., Awaitable[list[tuple[object, ...]]]]
REPO = Path(__file__).resolve().parents[2]


async def _cli(*args: str) -> Result:
    # The command runs its own event loop, so it gets its own thread.
    return await asyncio.to_thread(CliRunner().invoke, main, list(args))


async def test_empty_database_asks_for_upgrade(store_url: str) -> None:
    if store_url.startswith("sqlite"):
        sqlite3.connect(store_url.split(":///", 1)[1]).execute(
            "CREATE TABLE t (x)"
        ).connection.close()
    with pytest.raises(SchemaOutOfDate, match=r"run `recorder db upgrade --db .+`"):
        await open_store(store_url)
    result = await _cli("db", "upgrade", "--db", store_url)
    assert result.exit_code == 0, result.output
    assert head_revision() in result.output
    async with await open_store(store_url) as store:
        assert await store.last_position() == 0


async def test_missing_sqlite_file_is_not_created(tmp_path: Path) -> None:
    path = tmp_path / "nope.db"
    with pytest.raises(SchemaOutOfDate, match="recorder db upgrade"):
        await open_store(str(path))
    assert not path.exists()


async def test_unknown_newer_revision_asks_to_upgrade_package(
    store_url: str, raw_execute: RawExecute
) -> None:
    store = await open_store(store_url, create=True)
    await store.close()
    await raw_execute(store_url, "UPDATE alembic_version SET version_num = 'fffffff'")
    with pytest.raises(SchemaOutOfDate, match="upgrade the package"):
        await open_store(store_url)


async def test_upgrade_is_idempotent_and_keeps_data(sqlite_url: str) -> None:
    async with await open_store(sqlite_url, create=True) as store:
        await store.append("s", [NewEvent(event=SandboxEvent(kind="k"))])
    async with await open_store(sqlite_url, create=True) as store:
        assert len(await store.read_all()) == 1


def test_cli_as_module_upgrades_a_path(tmp_path: Path) -> None:
    path = tmp_path / "cli.db"
    out = subprocess.run(
        [sys.executable, "-m", "recorder.cli", "db", "upgrade", "--db", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert path.exists() and "schema at revision" in out.stdout


async def test_cli_reports_store_errors_cleanly(tmp_path: Path) -> None:
    result = await _cli(
        "db", "copy", "--from", str(tmp_path / "missing.db"), "--to", str(tmp_path / "b.db")
    )
    assert result.exit_code == 1
    assert "recorder db upgrade" in result.output and "Traceback" not in result.output


@pytest.mark.postgres
async def test_copy_sqlite_to_postgres_reads_back_identical(
    sqlite_url: str, postgres_url: str, raw_execute: RawExecute
) -> None:
    rng = np.random.default_rng(5)
    async with await open_store(sqlite_url, create=True) as src:
        refs = []
        prev = None
        for _ in range(5):
            prev = await src.put_array(rng.integers(0, 50_000, 3000, dtype=np.int32), extends=prev)
            refs.append(prev)
        refs.append(await src.put_array(rng.random(3000, dtype=np.float32)))
        for s in ("a", "b", "c"):
            await src.append(s, [NewEvent(event=SessionOpened(session_id=s, metadata={"n": 1}))])
        await src.append("a", [NewEvent(event=RewardAssigned(reward=0.5))])
        await src.append("b", [NewEvent(event=SandboxEvent(kind=str(i))) for i in range(20)])
        await src.save_projection("rules-2", [("a", 4, "d1", b"p1")])
        await src.save_projection("rules-1", [("a", 4, "d2", b"p2"), ("b", 24, "d3", b"p3")])
        want = await src.read_all(limit=10_000)
        want_arrays = await src.get_arrays(refs)

    result = await _cli("db", "copy", "--from", sqlite_url, "--to", postgres_url)
    assert result.exit_code == 0, result.output
    assert "copied 24 events, 6 array pieces, 3 projection rows" in result.output

    # Pieces are re-split the way the target stores them (whole TOAST chunks + tail).
    split = await raw_execute(postgres_url, "SELECT LENGTH(data), data_tail FROM arrays")
    assert all(n % TOAST_CHUNK_BYTES == 0 for n, _ in split)
    assert all(tail is not None for _, tail in split)
    async with await open_store(postgres_url) as dst:
        assert await dst.read_all(limit=10_000) == want
        for a, b in zip(await dst.get_arrays(refs), want_arrays, strict=True):
            assert a.tobytes() == b.tobytes() and a.dtype == b.dtype
        assert await dst.projection_names() == ["rules-2", "rules-1"]
        assert (await dst.load_projection("rules-1"))["b"] == (24, "d3", b"p3")
        # The copy continues the position sequence instead of reusing positions.
        (pos,) = await dst.append("a", [NewEvent(event=SandboxEvent(kind="after"))])
        assert pos > want[-1].position
        assert await dst.session_ids() == ["a", "b", "c"]
        await dst.save_projection("rules-3", [])
        assert (await dst.projection_names())[-1] == "rules-3"

    again = await _cli("db", "copy", "--from", sqlite_url, "--to", postgres_url)
    assert again.exit_code == 1 and "already holds events" in again.output
