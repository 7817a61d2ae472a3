"""`replay reclassify/export --ray` on a real multi-node Ray cluster on this machine.

Three nodes (`ray.cluster_utils.Cluster`: a head and two workers, one CPU and a
small object store each), started once for the module. Workers reach the log by
URL (the SQLite file's path, PostgreSQL by address); the projection and the
export files equal the one-process run's, byte for byte, and the partitions ran
on more than one node.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_parallel import (
    ROOT,
    clear_projections,
    file_digest,
    parallel_logs,
    projection_digest,
    write_interleaved,
)

from recorder.log.store import EventStore
from replay.export import export_samples
from replay.reclassify import reclassify
from replay.rules import Rules
from replay.stats import log_stats
from tests.conftest import missing

pytestmark = pytest.mark.ray

NODES = 3
OBJECT_STORE = 80 * 2**20  # Ray's floor is 75 MiB
SLOW_START = {
    "RAY_agent_register_timeout_ms": "180000",
    "RAY_worker_register_timeout_seconds": "180",
}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A head and two worker nodes; this test process is connected as a driver."""
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError:
        missing("Ray", "pip install 'trajectory-recorder[ray]' (tools/setup.sh does)")
    # Worker processes import replay from this checkout, like a node with the package.
    # On a loaded 2-core machine a node's agents take long to start: wait for them
    # (the variables are read by the node processes the cluster starts).
    saved = {k: os.environ.get(k) for k in (*SLOW_START, "PYTHONPATH")}
    os.environ.update(SLOW_START)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved["PYTHONPATH"]) if p)
    node = {"num_cpus": 1, "object_store_memory": OBJECT_STORE}
    cluster = start_cluster(Cluster, node)
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        yield cluster.address
    finally:
        ray.shutdown()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_cluster(cluster_class: Any, node: dict[str, Any], tries: int = 3) -> Any:
    """Head and worker nodes; a start that times out under load is tried again."""
    for attempt in range(tries):
        cluster = cluster_class(
            initialize_head=True, head_node_args={**node, "include_dashboard": False}
        )
        try:
            for _ in range(NODES - 1):
                cluster.add_node(**node)
            cluster.wait_for_nodes()
            return cluster
        except Exception:
            cluster.shutdown()
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


async def test_reclassify_on_ray_equals_the_one_process_projection(
    ray_cluster: str, store: EventStore
) -> None:
    logs = parallel_logs()
    await write_interleaved(store, logs)
    serial = await reclassify(store, Rules(), workers=1)
    expected = await projection_digest(store)
    await clear_projections(store)
    seen: list[int] = []
    report = await reclassify(
        store, Rules(), workers=NODES, ray=ray_cluster, on_progress=seen.append
    )
    assert await projection_digest(store) == expected
    assert report.sessions == serial.sessions == len(logs)
    assert (report.kinds_after, report.trainable_after) == (
        serial.kinds_after,
        serial.trainable_after,
    )
    assert len(report.partitions) == NODES
    assert len({p.node for p in report.partitions}) >= 2, report.partitions
    assert all(p.peak_rss > 0 for p in report.partitions)
    assert seen and seen[-1] == sum(p.sessions for p in report.partitions)


async def test_stats_on_ray_equal_the_one_process_stats(
    ray_cluster: str, store: EventStore
) -> None:
    await write_interleaved(store, parallel_logs())
    serial = await log_stats(store, Rules())
    spread = await log_stats(store, Rules(), workers=NODES, ray=ray_cluster)
    assert msgspec.structs.replace(spread, partitions=[]) == serial
    assert len({p.node for p in spread.partitions}) >= 2, spread.partitions


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
async def test_export_on_ray_equals_the_one_process_file(
    ray_cluster: str, store: EventStore, tmp_path: Path, fmt: str
) -> None:
    await write_interleaved(store, parallel_logs())
    one, spread = tmp_path / f"one.{fmt}", tmp_path / f"ray.{fmt}"
    serial = await export_samples(store, one, fmt, Rules())  # type: ignore[arg-type]
    counts = await export_samples(store, spread, fmt, Rules(), workers=NODES, ray=ray_cluster)  # type: ignore[arg-type]
    assert file_digest(spread) == file_digest(one)
    assert (counts.sessions, counts.samples) == (serial.sessions, serial.samples)
    assert len({p.node for p in counts.partitions}) >= 2, counts.partitions
    assert not [p for p in tmp_path.iterdir() if ".parts-" in p.name], "part files left"


def test_cli_ray_option_from_a_fresh_process(
    ray_cluster: str, sqlite_url: str, tmp_path: Path
) -> None:
    """The console command joins the cluster by address and leaves it afterwards."""
    import asyncio

    from recorder.log.store import open_store

    async def fill() -> None:
        async with await open_store(sqlite_url, create=True) as s:
            await write_interleaved(s, parallel_logs(8))

    asyncio.run(fill())
    db = sqlite_url.removeprefix("sqlite+aiosqlite:///")
    env = {**os.environ, "COLUMNS": "200"}
    out = tmp_path / "s.jsonl"
    for args in (
        ["reclassify", "--ray", ray_cluster, "--workers", "2"],
        ["export", "--ray", ray_cluster, "--workers", "2", "--out", str(out)],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "replay.cli", *args, "--db", db],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        assert "2 workers on" in done.stdout
    assert out.stat().st_size > 0


def test_unreachable_cluster_is_a_clear_error(tmp_path: Path, sqlite_url: str) -> None:
    """No cluster at the address: the command says so at once (`ray.init` alone
    retries for minutes), without a traceback. Needs no cluster."""
    import asyncio

    from recorder.log.store import open_store

    async def fill() -> None:
        async with await open_store(sqlite_url, create=True) as s:
            await write_interleaved(s, parallel_logs(2))

    asyncio.run(fill())
    db = sqlite_url.removeprefix("sqlite+aiosqlite:///")
    done = subprocess.run(
        [sys.executable, "-m", "replay.cli", "reclassify", "--ray", "127.0.0.1:9", "--db", db],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "Ray cluster" in done.stderr, done.stderr
