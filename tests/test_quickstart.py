"""The README quickstart: one command records a session and replays it.

`python -m tools.quickstart` runs as a real subprocess (scripted engine, a
temporary db); the assertions read the log it leaves behind.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import msgspec
import psutil
import pytest

from recorder.log import events as ev
from recorder.log.store import open_store
from replay.reclassify import SAMPLES_PREFIX
from replay.samples import SessionResult, check_invariants, result_digest
from tools.quickstart import (
    Children,
    QuickstartError,
    run_bash,
    run_write,
    scripted_replies,
    wait_healthy,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


class Run(msgspec.Struct):
    returncode: int
    stdout: str
    stderr: str
    db: Path
    live: SessionResult


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("quickstart")
    db, samples = tmp / "qs.db", tmp / "live-samples.json"
    done = subprocess.run(
        [sys.executable, "-m", "tools.quickstart", "--db", str(db), "--save-samples", str(samples)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, f"quickstart failed:\n{done.stdout}\n{done.stderr}"
    live = msgspec.json.decode(samples.read_bytes(), type=SessionResult)
    return Run(done.returncode, done.stdout, done.stderr, db, live)


async def _read_log(db: Path) -> tuple[list[ev.RecordedEvent], dict[str, tuple[int, str, bytes]]]:
    store = await open_store(str(db))
    try:
        (session_id,) = await store.session_ids()
        events = await store.read_session(session_id)
        names = [n for n in await store.projection_names() if n.startswith(SAMPLES_PREFIX)]
        assert len(names) == 1, names
        return events, await store.load_projection(names[0])
    finally:
        await store.close()


def test_live_close_gives_subagent_wipe_final_in_order(quickstart: Run) -> None:
    live = quickstart.live
    assert live.status == "completed" and not live.placeholder
    assert [s.metadata["segment_kind"] for s in live.samples] == ["subagent", "wipe", "final"]
    assert [s.kind for s in live.segments] == ["subagent", "wipe", "final"]
    assert live.turns_total == len(scripted_replies())
    assert sum(s.reward for s in live.samples) == pytest.approx(1.0)
    for sample in live.samples:
        check_invariants(sample)
        assert sum(sample.loss_mask) > 0


def test_reclassify_reproduces_the_live_samples(quickstart: Run) -> None:
    events, projection = asyncio.run(_read_log(quickstart.db))
    session_id = events[0].session_id
    assert session_id == quickstart.live.session_id
    _position, digest, _payload = projection[session_id]
    assert digest == result_digest(quickstart.live)


def test_log_records_subagent_and_compaction_decisions(quickstart: Run) -> None:
    events, _ = asyncio.run(_read_log(quickstart.db))
    decisions = [e.event for e in events if isinstance(e.event, ev.ChainDecision)]
    reasons = [d.reason for d in decisions]
    assert reasons.count("subagent") == 1 and reasons.count("compaction") == 1
    assert reasons.index("subagent") < reasons.index("compaction")
    (subagent,) = [d for d in decisions if d.reason == "subagent"]
    assert subagent.dispatch_tool_use_id is not None
    streamed = [e.event.stream for e in events if isinstance(e.event, ev.MessagesRequest)]
    assert any(streamed) and not all(streamed)
    assert isinstance(events[-1].event, ev.SessionClosed)


def test_output_shows_the_replay_commands(quickstart: Run) -> None:
    out = quickstart.stdout
    for command in ("replay stats", "replay show", "replay reclassify"):
        assert f"$ {command} --db {quickstart.db}" in out
    assert "byte for byte" in out


def test_no_child_process_outlives_the_run(quickstart: Run) -> None:
    leftovers = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if str(quickstart.db) in cmdline:
            leftovers.append(cmdline)
    assert leftovers == []


def test_bash_tool_runs_only_read_only_commands(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello\n")
    assert run_bash(tmp_path, {"command": "cat a.txt"}).text == "hello\n"
    refused = run_bash(tmp_path, {"command": "rm a.txt"})
    assert refused.is_error and "read-only" in refused.text
    assert (tmp_path / "a.txt").exists()
    assert run_bash(tmp_path, {"command": "cat missing.txt"}).is_error
    assert run_bash(tmp_path, {"command": 'echo "unclosed'}).is_error


def test_write_tool_stays_inside_the_workspace(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    assert not run_write(repo, {"file_path": "pkg/x.py", "content": "x = 1\n"}).is_error
    assert (repo / "pkg" / "x.py").read_text() == "x = 1\n"
    escaped = run_write(repo, {"file_path": "../outside.txt", "content": "no"})
    assert escaped.is_error and not (tmp_path / "outside.txt").exists()


def test_a_child_that_dies_at_startup_is_a_clear_error(tmp_path: Path) -> None:
    children = Children()
    child = children.start(
        "engine",
        ["-c", "import sys; print('cannot bind'); sys.exit(3)"],
        tmp_path / "engine.log",
        {"PATH": "/usr/bin:/bin"},
    )
    with pytest.raises(QuickstartError, match=r"engine exited with code 3[\s\S]*cannot bind"):
        wait_healthy(child, "http://127.0.0.1:9", timeout_s=30)
    children.stop_all()
    assert children.running == []
