"""Parallel replay (local processes): the projection and the export files are the
one-process run's, byte for byte, for 1, 2 and 4 workers; Ray is never imported
without --ray. The Ray runs of the same comparisons are in test_ray.py."""

from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest
import sqlalchemy as sa
from builders import Log, _rewrite_refs, small_logs

from recorder.log.events import ArrayRef, NewEvent
from recorder.log.store import EventStore
from replay.export import export_samples, read_samples
from replay.parallel import wanted_sizes
from replay.partitions import auto_workers, plan_ranges
from replay.reclassify import reclassify
from replay.rules import Rules
from replay.stats import log_stats

ROOT = Path(__file__).resolve().parents[2]


def parallel_logs(n: int = 24) -> list[Log]:
    """The shapes of small_logs() plus the stream's corner cases, `n` sessions more:
    a session still open at the end of the log, one with a reward after its close
    (yielded twice: the later yield wins), one closed then cleanly re-opened."""
    logs = small_logs()
    for i in range(n):
        log = Log(f"p-{i:03d}").open(group_index=i % 4, sample_index=i)
        t = log.turn([1, 2, 3 + i], [10 + i, 11, 2], tool_uses=[("tu", "Bash")])
        t = log.turn(t.then([4, 5]), [12, 13 + i % 3], tool_results=["tu"])
        if i % 5 == 0:
            log.turn([1, 2, 90 + i], [14, 2])  # a wipe: a second segment
        log.reward(i / n)
        if i % 7 != 3:
            log.close()
        logs.append(log)
    late = Log("q-late").open()
    late.turn([1, 2, 3], [40, 2])
    late.close().reward(0.25)
    restarted = Log("r-restart").open()
    restarted.turn([1, 2], [41, 2])
    restarted.close("failed", reason="sandbox crashed").open(attempt=1)
    restarted.turn([1, 2], [42, 2])
    restarted.reward(1.0).close()
    open_only = Log("o-open").open()
    open_only.turn([1, 2, 3], [43])
    return [*logs, late, restarted, open_only]


async def write_interleaved(store: EventStore, logs: Sequence[Log], step: int = 2) -> None:
    """Append the logs round-robin, `step` events at a time, as a live server
    writes concurrent sessions: each session's events spread over the log."""
    queues: list[tuple[str, list[NewEvent]]] = []
    for log in logs:
        mapping: dict[bytes, ArrayRef] = {}
        for digest, arr in log.arrays.items():
            mapping[digest] = await store.put_array(arr)
        events = [
            NewEvent(event=_rewrite_refs(r.event, mapping), event_id=r.event_id, ts=r.ts)  # type: ignore[arg-type]
            for r in sorted(log.events, key=lambda r: r.seq)
        ]
        queues.append((log.session_id, events))
    while any(events for _sid, events in queues):
        for sid, events in queues:
            if events:
                await store.append(sid, events[:step])
                del events[:step]


async def projection_digest(store: EventStore) -> str:
    """Every row of the projection tables, in key order, and the names in the order written."""
    engine = store.read_engine  # type: ignore[attr-defined]
    h = hashlib.blake2b(digest_size=16)
    async with engine.connect() as conn:
        for (name,) in await conn.execute(
            sa.text("SELECT name FROM projection_names ORDER BY ordinal")
        ):
            h.update(f"name {name}\n".encode())
        rows = await conn.execute(
            sa.text(
                "SELECT name, session_id, covers_position, digest, payload FROM projections"
                ' ORDER BY name COLLATE "C", session_id COLLATE "C"'
                if store.url.startswith("postgresql")
                else "SELECT name, session_id, covers_position, digest, payload FROM projections"
                " ORDER BY name, session_id"
            )
        )
        count = 0
        for name, sid, pos, digest, payload in rows:
            count += 1
            h.update(f"{name} {sid} {pos} {digest} {len(payload)}\n".encode())
            h.update(bytes(payload))
    assert count > 0, "no projection rows to compare"
    return h.hexdigest()


async def clear_projections(store: EventStore) -> None:
    async with store.write_engine.begin() as conn:  # type: ignore[attr-defined]
        await conn.execute(sa.text("DELETE FROM projections"))
        await conn.execute(sa.text("DELETE FROM projection_names"))


def file_digest(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


# -- partition planning (pure) ---------------------------------------------------


def test_ranges_split_evenly_and_cover_everything() -> None:
    ids = [f"s{i:04d}" for i in range(10)]
    ranges = plan_ranges(ids, 3)
    assert ranges == [(None, "s0003"), ("s0003", "s0006"), ("s0006", None)]
    assert plan_ranges(ids, 1) == [(None, None)]
    assert plan_ranges(["only"], 4) == [(None, None)]
    assert plan_ranges([], 4) == [(None, None)]


def test_weighted_ranges_give_each_worker_an_equal_share_of_the_events() -> None:
    """Rollout ids sort a task's samples side by side: equal counts of sessions
    gave one worker every long task. Weighted by events, the split is even."""
    ids = [f"ro-task{i // 8:03d}-s{i % 8}" for i in range(64)]
    sizes = {sid: 400 if n < 16 else 20 for n, sid in enumerate(ids)}  # two long tasks first
    share = [_weight(r, sizes) for r in plan_ranges(ids, 2, sizes)]
    assert [_weight(r, sizes) for r in plan_ranges(ids, 2)] == [6400 + 16 * 20, 32 * 20]
    assert abs(share[0] - share[1]) <= max(sizes.values())
    assert sum(share) == sum(sizes.values())
    for parts in (1, 2, 3, 5, 64, 100):
        ranges = plan_ranges(ids, parts, sizes)
        assert len(ranges) == min(parts, len(ids))
        # Contiguous, every id in exactly one range, none empty.
        assert ranges[0][0] is None and ranges[-1][1] is None
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        assert all(_weight(r, sizes) > 0 for r in ranges)
        ideal = sum(sizes.values()) / len(ranges)
        assert max(_weight(r, sizes) for r in ranges) <= ideal + max(sizes.values())
    # Equal weights cut as equal counts do; a missing or zero size weighs 1.
    assert plan_ranges(ids, 4, dict.fromkeys(ids, 7)) == plan_ranges(ids, 4)
    assert plan_ranges(["a", "b"], 2, {"a": 0}) == [(None, "b"), ("b", None)]
    assert plan_ranges([], 3, {}) == [(None, None)]


def _weight(bounds: tuple[str | None, str | None], sizes: dict[str, int]) -> int:
    lo, hi = bounds
    return sum(n for s, n in sizes.items() if (lo is None or s >= lo) and (hi is None or s < hi))


def test_auto_workers_uses_every_core_but_not_for_a_small_log() -> None:
    assert auto_workers(2000, cores=2) == 2
    assert auto_workers(100_000, cores=16) == 16
    assert auto_workers(100, cores=2) == 1  # fewer than 64 sessions per worker
    assert auto_workers(0, cores=2) == 1


# -- byte-identical results ------------------------------------------------------


async def test_reclassify_projection_is_byte_identical_for_1_2_4_workers(
    store: EventStore,
) -> None:
    logs = parallel_logs()
    await write_interleaved(store, logs)
    digests, reports = {}, {}
    for workers in (1, 2, 4):
        await clear_projections(store)
        report = await reclassify(store, Rules(), workers=workers)
        digests[workers] = await projection_digest(store)
        reports[workers] = report
        assert report.sessions == len(logs)
    assert digests[2] == digests[1] and digests[4] == digests[1]
    one = reports[1]
    for workers in (2, 4):
        report = reports[workers]
        assert (report.kinds_after, report.status_after, report.trainable_after) == (
            one.kinds_after,
            one.status_after,
            one.trainable_after,
        )
        assert len(report.partitions) == workers
        assert sum(p.sessions for p in report.partitions) >= len(logs)
        assert all(p.peak_rss > 0 for p in report.partitions)
    # A re-run over the whole projection in parallel compares against it: nothing changed.
    again = await reclassify(store, Rules(), workers=2)
    assert again.changed_samples == [] and again.new_sessions == 0
    # The session filter and dry runs work the same in parallel.
    dry = await reclassify(store, Rules(), workers=2, dry_run=True, session_ids=["a-linear"])
    assert dry.sessions == 1 and dry.dry_run


async def test_workers_split_the_log_by_events_not_by_sessions(store: EventStore) -> None:
    """Long sessions sorted first (a long task's samples): the first worker takes
    fewer of them, and the projection is still the one-process run's."""
    logs = []
    for i in range(12):
        log = Log(f"ro-t{i:02d}").open()
        ids = [1, 2, 3]
        for k in range(24 if i < 3 else 2):
            ids = log.turn(ids, [10 + k, 2]).then([4, 5 + k])
        logs.append(log.close())
    await write_interleaved(store, logs)
    one = await reclassify(store, Rules(), workers=1)
    digest = await projection_digest(store)
    await clear_projections(store)
    two = await reclassify(store, Rules(), workers=2)
    assert await projection_digest(store) == digest
    assert two.trainable_after == one.trainable_after
    # An equal count (6 and 6) gave the first worker 78 of the 90 turns; by
    # events each worker's share is within one session of half.
    first, second = (p.sessions for p in two.partitions)
    assert first + second == 12 and first < 6
    sizes = [n for _sid, n in sorted((await store.session_sizes()).items())]
    share = sum(sizes[:first])
    assert abs(share - (sum(sizes) - share)) <= max(sizes)


async def test_sessions_listed_by_the_caller_are_not_listed_again(
    store: EventStore, tmp_path: Path
) -> None:
    """The command line lists the sessions once (its progress total) and hands
    them on: the log is not scanned for them a second time."""
    logs = parallel_logs(4)
    await write_interleaved(store, logs)
    sizes = await wanted_sizes(store, None)
    listed = 0
    session_sizes = store.session_sizes

    async def counted() -> dict[str, int]:
        nonlocal listed
        listed += 1
        return await session_sizes()

    store.session_sizes = counted  # type: ignore[method-assign]
    for workers in (None, 2):
        report = await reclassify(store, Rules(), workers=workers, sizes=sizes)
        assert report.sessions == len(logs)
        counts = await export_samples(
            store, tmp_path / f"{workers}.jsonl", "jsonl", Rules(), workers=workers, sizes=sizes
        )
        assert counts.sessions == len(logs)
    assert listed == 0


async def test_stats_are_the_one_process_stats_for_1_2_4_workers(store: EventStore) -> None:
    """`replay stats` in parallel: the same numbers (the late-rewarded session
    counted once, by its last yield), whichever worker read each session."""
    logs = parallel_logs()
    await write_interleaved(store, logs)
    stats = {workers: await log_stats(store, Rules(), workers=workers) for workers in (1, 2, 4)}
    one = stats[1]
    assert one.sessions == len(logs) and one.turns > 0 and one.trainable_tokens > 0
    assert one.partitions == []
    for workers in (2, 4):
        assert len(stats[workers].partitions) == workers
        assert msgspec.structs.replace(stats[workers], partitions=[]) == one
    # Default: one per core, but a log this small runs in one process.
    assert (await log_stats(store, Rules(), workers=None)).partitions == []


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
async def test_export_is_byte_identical_for_1_2_4_workers(
    store: EventStore, tmp_path: Path, fmt: str
) -> None:
    logs = parallel_logs()
    await write_interleaved(store, logs)
    digests, counts = {}, {}
    for workers in (1, 2, 4):
        out = tmp_path / f"samples-{workers}.{fmt}"
        counts[workers] = await export_samples(store, out, fmt, Rules(), workers=workers)  # type: ignore[arg-type]
        digests[workers] = file_digest(out)
        assert not [p for p in tmp_path.iterdir() if ".parts-" in p.name], "part files left"
    assert digests[2] == digests[1] and digests[4] == digests[1]
    # Counted as the samples are written, they are what the file holds (one
    # session is yielded twice: only its last yield's rows are in the file).
    in_file = list(read_samples(tmp_path / f"samples-1.{fmt}", fmt))  # type: ignore[arg-type]
    expected = (
        len(logs),
        len(in_file),
        sum("placeholder" in s.metadata for s in in_file),
        sum(sum(s.loss_mask) for s in in_file),
    )
    assert expected[3] > 0 and expected[2] > 0
    for workers in (1, 2, 4):
        c = counts[workers]
        assert (c.sessions, c.samples, c.placeholders, c.trainable_tokens) == expected
        assert len(c.partitions) == (0 if workers == 1 else workers)


async def test_export_parquet_with_a_superseded_yield_keeps_one_process_row_groups(
    sqlite_store: EventStore, tmp_path: Path
) -> None:
    """The serial export drops a re-yielded session's first rows in a rewrite; the
    rewrite uses the same row groups as a run that never wrote them (`batch`=4
    makes several groups), so the parallel file equals it byte for byte."""
    await write_interleaved(sqlite_store, parallel_logs(12))
    one, two = tmp_path / "one.parquet", tmp_path / "two.parquet"
    await export_samples(sqlite_store, one, "parquet", Rules(), batch=4)
    await export_samples(sqlite_store, two, "parquet", Rules(), batch=4, workers=3)
    assert file_digest(one) == file_digest(two)


# -- Ray stays out unless asked for ------------------------------------------------


def test_ray_is_never_imported_without_the_ray_option(sqlite_url: str, tmp_path: Path) -> None:
    """A `ray` package that raises on import, first on the path of the CLI and of
    every worker process it spawns: runs without --ray succeed, a run with --ray
    fails on it (so the tripwire is live)."""
    import asyncio

    from recorder.log.store import open_store

    async def fill() -> None:
        async with await open_store(sqlite_url, create=True) as s:
            await write_interleaved(s, parallel_logs(8))

    asyncio.run(fill())
    trap = tmp_path / "trap" / "ray"
    trap.mkdir(parents=True)
    (trap / "__init__.py").write_text("raise RuntimeError('ray was imported')\n")
    env = {**os.environ, "PYTHONPATH": f"{trap.parent}{os.pathsep}{ROOT}", "COLUMNS": "200"}
    db = sqlite_url.removeprefix("sqlite+aiosqlite:///")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "replay.cli", *args, "--db", db],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )

    for args in (
        ("reclassify", "--workers", "2"),
        ("reclassify",),
        ("export", "--workers", "2", "--out", str(tmp_path / "s.jsonl")),
        ("export", "--out", str(tmp_path / "t.jsonl")),
    ):
        done = cli(*args)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        assert "ray was imported" not in done.stderr
    tripped = cli("reclassify", "--ray", "127.0.0.1:1")
    assert tripped.returncode != 0 and "ray was imported" in tripped.stderr


# -- workers forked by the command line ---------------------------------------------


def test_cli_forks_its_workers_and_the_projection_is_the_serial_one(
    store_url: str, tmp_path: Path
) -> None:
    """`_run(fork=2)` in a fresh single-threaded process forks two workers before
    it opens the store, the run uses them (not spawned ones), and the projection
    equals the one-process run's byte for byte."""
    import asyncio

    from recorder.log.store import open_store

    async def fill() -> None:
        async with await open_store(store_url, create=True) as s:
            await write_interleaved(s, parallel_logs(8))

    asyncio.run(fill())
    script = tmp_path / "forked.py"
    script.write_text(
        "import sys\n"
        "from replay import parallel\n"
        "from replay.cli import _run\n"
        "from replay.reclassify import reclassify\n"
        "from replay.rules import Rules\n"
        "used = []\n"
        "real = parallel._run_on_pool\n"
        "async def spy(pool, *args):\n"
        "    used.append(pool)\n"
        "    return await real(pool, *args)\n"
        "parallel._run_on_pool = spy\n"
        "workers = int(sys.argv[2])\n"
        "report = _run(sys.argv[1], lambda s: reclassify(s, Rules(), workers=workers),\n"
        "              streaming=True, fork=2)\n"
        "forked = [p for p in used if p._mp_context.get_start_method() == 'fork']\n"
        "print(report.sessions, len(report.partitions), len(used), len(forked))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(workers: int) -> str:
        done = subprocess.run(
            [sys.executable, str(script), store_url, str(workers)],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    async def digest_then_clear() -> str:
        async with await open_store(store_url) as s:
            d = await projection_digest(s)
            await clear_projections(s)
            return d

    n = len(parallel_logs(8))
    assert run(1) == [str(n), "0", "0", "0"]  # one process: no pool at all
    serial = asyncio.run(digest_then_clear())
    assert run(2) == [str(n), "2", "1", "1"]  # the forked pool ran both partitions
    assert asyncio.run(digest_then_clear()) == serial


def test_a_store_url_names_the_backend_whose_imports_workers_preload(tmp_path: Path) -> None:
    """`forked_workers(url=...)` preloads the store backend that URL names (a
    SQLite run does not import the Postgres driver), and every backend when
    the URL cannot be told."""
    from replay.parallel import _backend

    assert _backend(str(tmp_path / "runs.db")) == "sqlite"
    assert _backend(f"sqlite:///{tmp_path}/runs.db") == "sqlite"
    assert _backend("postgresql://user@host/db") == "postgresql"
    assert _backend("mysql://user@host/db") is None
    assert _backend(None) is None


class _UnpicklableError(Exception):
    """A driver error as SQLAlchemy raises one: its statement's parameters attached."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.params = memoryview(b"a payload")


async def test_a_worker_error_that_does_not_pickle_reaches_the_driver_by_its_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It used to arrive as "cannot pickle 'memoryview' object", the real error lost."""
    import pickle

    import recorder.log.store as store_module
    from replay.parallel import Job, WorkerFailed, worker_chunks

    async def broken_store(*_args: object, **_kwargs: object) -> EventStore:
        raise _UnpicklableError("database disk image is malformed")

    monkeypatch.setattr(store_module, "open_store", broken_store)
    job = Job(
        kind="stats", url="sqlite:///nowhere.db", rules=Rules(), covers=0, sessions=(None, None)
    )
    with pytest.raises(WorkerFailed) as caught:
        async for _chunk in worker_chunks(job):
            pass
    assert "_UnpicklableError: database disk image is malformed" in str(caught.value)
    assert str(pickle.loads(pickle.dumps(caught.value))) == str(caught.value)

    async def failing_store(*_args: object, **_kwargs: object) -> EventStore:
        raise ValueError("bad url")  # pickles: reaches the driver as itself

    monkeypatch.setattr(store_module, "open_store", failing_store)
    with pytest.raises(ValueError, match="bad url"):
        async for _chunk in worker_chunks(job):
            pass
