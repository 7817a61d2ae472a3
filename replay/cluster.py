"""Replay partitions as Ray tasks (`replay reclassify/export --ray [ADDRESS]`).

The only module of the package that imports Ray, and only when a run asks for
it (`pip install 'trajectory-recorder[ray]'`). Each partition of
`replay.parallel` becomes one task that gets the `Job` (the database URL, the
rules and its session-id range: no event data) and streams its output back
as a Ray generator, one `Chunk` at a time, so neither the task nor the driver
holds more than a chunk in flight. Tasks are spread over the cluster's nodes
(`SPREAD`); every node must have this package installed and reach the
database by the same URL (PostgreSQL by host name; SQLite only on one
machine or a shared filesystem, by absolute path).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec

from replay.parallel import Chunk, Job, PartResult, PartSink, make_jobs, part_paths, worker_chunks
from replay.partitions import auto_workers


class RayUnavailable(RuntimeError):
    """`--ray` was asked for but Ray is not installed or not reachable."""


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayUnavailable("--ray needs Ray: pip install 'trajectory-recorder[ray]'") from None
    return ray


def connect(address: str | None) -> bool:
    """Join the cluster at `address` (None: `ray.init()`'s default, i.e.
    RAY_ADDRESS, a cluster started on this machine, or a new local one).
    Returns True when this call connected (and so should disconnect)."""
    ray = _ray()
    if ray.is_initialized():
        return False
    if address:
        _probe(address)
    try:
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    except ConnectionError as exc:
        raise RayUnavailable(f"cannot reach the Ray cluster at {address!r}: {exc}") from None
    return True


def _probe(address: str, timeout: float = 10.0) -> None:
    """Fail fast on a `host:port` nobody listens on: `ray.init` retries such an
    address for minutes before it gives up."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", "local", ...: Ray resolves those itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise RayUnavailable(
            f"cannot reach the Ray cluster at {address!r}: {exc}; start one with "
            "`ray start --head` or pass the head's address"
        ) from None


def _task(job_bytes: bytes) -> Iterator[bytes]:
    """One partition inside a Ray worker: its chunks, as they are produced."""
    import ray

    job = msgspec.msgpack.decode(job_bytes, type=Job)
    node = ray.get_runtime_context().get_node_id()
    loop = asyncio.new_event_loop()
    chunks = worker_chunks(job, node=node)
    try:
        while True:
            try:
                chunk = loop.run_until_complete(anext(chunks))
            except StopAsyncIteration:
                return
            yield msgspec.msgpack.encode(chunk)
    finally:
        loop.run_until_complete(chunks.aclose())
        loop.close()


async def run_on_ray(
    base: Job,
    sizes: Mapping[str, int],
    *,
    workers: int | None,
    part_dir: Path | None,
    address: str | None,
    on_progress: Callable[[int], None] | None,
    cpus: float = 1.0,
) -> list[PartResult]:
    """Split the sessions `sizes` weighs into ranges (`workers`, default one per CPU of the cluster,
    fewer for a small log), run each as a Ray task and gather their chunks as
    they stream in."""
    ray = _ray()
    owned = connect(address)
    try:
        if workers is None:
            workers = auto_workers(len(sizes), int(ray.cluster_resources().get("CPU", 1)))
        jobs = make_jobs(base, sizes, workers)
        remote = ray.remote(_task).options(
            num_cpus=cpus, scheduling_strategy="SPREAD", num_returns="streaming"
        )
        done = 0

        async def gather(job: Job, part: Path | None) -> PartResult:
            nonlocal done
            sink = PartSink(part)
            try:
                async for ref in remote.remote(msgspec.msgpack.encode(job)):
                    chunk = msgspec.msgpack.decode(await ref, type=Chunk)
                    sink.add(chunk)
                    done += chunk.sessions
                    if on_progress is not None:
                        on_progress(done)
            finally:
                result = sink.close()
            return result

        parts = part_paths(part_dir, len(jobs))
        return list(await asyncio.gather(*(gather(j, p) for j, p in zip(jobs, parts, strict=True))))
    finally:
        if owned:
            ray.shutdown()
