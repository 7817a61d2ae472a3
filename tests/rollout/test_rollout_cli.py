"""`recorder rollout` as a user runs it: subprocesses all the way (engine, CLI, its recorder)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_harness import shipped_tasks

from recorder.log import events as ev
from recorder.log.store import open_store
from recorder.rollout.sandbox.local import marked_pids
from tests.conftest import claude_code_binary
from tools.tasks.build import TASKS
from tools.test_engine.launch import REPO_ROOT, free_port

TOKENIZER = REPO_ROOT / "tests" / "data" / "smollm2-tokenizer"
TEMPLATE = REPO_ROOT / "recorder" / "model" / "templates" / "chatml-tools.jinja"


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), e.get("PYTHONPATH")]))
    return e


@pytest.fixture
def task_engine(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = open(tmp_path / "engine.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.tasks.engine", "--port", str(port)],
        env=env(), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                break
        except OSError:
            time.sleep(0.2)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def cli(tmp_path: Path, engine: str, *extra: str) -> list[str]:
    shipped_tasks()  # builds the repositories
    return [
        sys.executable, "-m", "recorder.cli", "rollout",
        "--tasks", str(TASKS), "--engine", engine, "--db", str(tmp_path / "runs.db"),
        "--tokenizer", str(TOKENIZER), "--chat-template", str(TEMPLATE),
        "--tool-parser", "qwen25", "--reasoning-parser", "qwen3", "--context-length", "200000",
        "--out", str(tmp_path / "samples.jsonl"), "--no-progress",
        "--sandbox-option", f"root={tmp_path / 'sbx'}", *extra,
    ]  # fmt: skip


async def sessions(db: Path) -> dict[str, list[object]]:
    store = await open_store(str(db))
    try:
        return {
            sid: [r.event for r in await store.read_session(sid)]
            for sid in await store.session_ids()
        }
    finally:
        await store.close()


@pytest.mark.claude
def test_rollout_cli_runs_the_shipped_tasks(tmp_path: Path, task_engine: str) -> None:
    (tmp_path / "sbx").mkdir()
    cmd = cli(tmp_path, task_engine, "--samples-per-task", "1", "--concurrency", "3")
    cmd += ["--agent-binary", claude_code_binary(), "--temperature", "0.5"]
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rollout summary" in done.stdout and "passed" in done.stdout
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sorted(x["instance_id"] for x in lines) == sorted(shipped_tasks())
    assert {x["result"]["outcome"] for x in lines} == {"passed"}
    assert sorted(x["group_index"] for x in lines) == [0, 1, 2]
    assert all(sum(s["loss_mask"]) > 0 for x in lines for s in x["result"]["samples"])
    assert list((tmp_path / "sbx").iterdir()) == []


def test_ctrl_c_kills_agents_removes_sandboxes_and_aborts_sessions(
    tmp_path: Path, task_engine: str
) -> None:
    root = tmp_path / "sbx"
    root.mkdir()
    cmd = cli(tmp_path, task_engine, "--samples-per-task", "2", "--concurrency", "4")
    cmd += ["--agent-command", "sleep 600"]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while len([p for p in root.iterdir() if (p / "prompt.txt").exists()]) < 4:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out.decode()
    assert b"interrupted" in out
    logs = asyncio.run(sessions(tmp_path / "runs.db"))
    assert len(logs) == 4
    for events in logs.values():
        (closed,) = [e for e in events if isinstance(e, ev.SessionClosed)]
        assert closed.status == "aborted" and closed.reason.startswith("cancelled")
    ids = [
        str(e.detail["sandbox_id"])
        for events in logs.values()
        for e in events
        if isinstance(e, ev.SandboxEvent) and e.kind == "sandbox_created"
    ]
    assert len(ids) == 4
    assert [pid for i in ids for pid in marked_pids(i)] == []
    assert list(root.iterdir()) == []


@pytest.mark.claude
def test_quickstart_rollout_runs_real_rollouts() -> None:
    claude_code_binary()
    cmd = [sys.executable, "-m", "tools.quickstart_rollout", "--samples", "1"]
    done = subprocess.run(
        cmd, env=env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "3 rollouts passed" in done.stdout
    assert "eval_result" in done.stdout and "session_closed" in done.stdout  # replay show
