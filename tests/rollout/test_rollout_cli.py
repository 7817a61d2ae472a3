"""`recorder rollout` as a user runs it: subprocesses all the way (engine, CLI, its recorder)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from rollout_harness import shipped_tasks

from recorder.log import events as ev
from recorder.log.store import open_store
from recorder.rollout.cli import admin_token, is_loopback_url, rollout, start_warnings
from recorder.rollout.sandbox.local import marked_pids
from tests.conftest import claude_code_binary, missing
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
    outcomes = {x["instance_id"]: x["result"]["outcome"] for x in lines}
    assert set(outcomes.values()) == {"passed"}, [(outcomes, x["result"]) for x in lines]
    assert sorted(x["group_index"] for x in lines) == [0, 1, 2]
    assert all(sum(s["loss_mask"]) > 0 for x in lines for s in x["result"]["samples"])
    assert list((tmp_path / "sbx").iterdir()) == []
    # Session ids (an agent's key) and passing diffs: for the driver's user alone (an
    # audit's agents read them from world-readable files and ran turns in siblings').
    assert " opened (attempt" in (tmp_path / "runs.serve.log").read_text()
    for name in ("runs.db", "runs.serve.log", "samples.jsonl"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name


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
    # The cancelled rollouts are in --out too, as the log has them: aborted, `cancelled`.
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sorted(x["result"]["session_id"] for x in lines) == sorted(logs)
    for line in lines:
        result = line["result"]
        assert (result["outcome"], result["infra_cause"]) == ("infra_error", "cancelled")
        assert all(s["status"] == "aborted" and not any(s["loss_mask"]) for s in result["samples"])


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


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat_file.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_kill_9_of_the_driver_takes_its_recorder_serve_with_it(
    tmp_path: Path, task_engine: str
) -> None:
    root = tmp_path / "sbx"
    root.mkdir()
    cmd = cli(tmp_path, task_engine, "--samples-per-task", "1", "--agent-command", "sleep 600")
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len([p for p in root.iterdir() if (p / "prompt.txt").exists()]) < 3:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        # `serve` as an argument of its own: the test's tmp path (in other children's
        # arguments, e.g. git's in a sandbox) holds the word too.
        (serve,) = [
            pid for pid in children(proc.pid)
            if b"serve" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        ]  # fmt: skip
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 60
        while alive(serve):
            assert time.monotonic() < deadline, f"recorder serve {serve} outlived its driver"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
        # kill -9 leaves the agents (no cleanup ran): sweep them for the next tests.
        for sandbox in root.iterdir():
            for pid in marked_pids(sandbox.name):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


FORGE = r"""
close() {
  curl -s -o /dev/null -w '%{http_code}' -X POST -H "Authorization: Bearer $1" \
    -H 'Content-Type: application/json' -d '{"reward": 1.0}' \
    "$ANTHROPIC_BASE_URL/sessions/$ANTHROPIC_AUTH_TOKEN/close"
}
out="$REPORT/$ANTHROPIC_AUTH_TOKEN"
echo "env_token=[${TR_ADMIN_TOKEN:-}]" >> "$out"
echo "env_close=$(close "${TR_ADMIN_TOKEN:-}")" >> "$out"
token=$(cat "$TOKEN_FILE" 2>&1)
echo "file_read=$?" >> "$out"
echo "file_said=$token" >> "$out"
echo "file_close=$(close "$token")" >> "$out"
environ=$( { tr '\000' '\n' < "/proc/$RECORDER_PID/environ"; } 2>&1)
echo "proc_read=$?" >> "$out"
echo "proc_said=$(printf '%s\n' "$environ" | head -n 1)" >> "$out"
token=$(printf '%s\n' "$environ" | sed -n 's/^TR_ADMIN_TOKEN=//p')
echo "proc_close=$(close "$token")" >> "$out"
echo "scan=$(grep -l -a TR_ADMIN_TOKEN= /proc/[0-9]*/environ 2>/dev/null | wc -l)" >> "$out"
echo "uid=$(id -u)" >> "$out"
exit 0
"""


def report(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_an_agent_cannot_forge_its_reward_from_a_local_sandbox(
    tmp_path: Path, task_engine: str
) -> None:
    """The three ways an agent once closed its own session with reward 1.0 (HTTP 200), run
    from inside the local sandbox while the driver and the recorder run as root: the token
    inherited from the driver, the recorder's 0600 token file, its /proc/<pid>/environ."""
    if os.geteuid() != 0:
        missing(
            "sandboxes get users of their own only when the driver runs as root",
            "run the tests as root, as CI and training containers do",
        )
    token = secrets.token_hex(16)
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    token_file = state / "admin-token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    reports = tmp_path / "reports"
    reports.mkdir()
    reports.chmod(0o777)
    (tmp_path / "forge.sh").write_text(FORGE)
    port = free_port()
    serve_cmd = [
        sys.executable, "-m", "recorder.cli", "serve", "--db", str(tmp_path / "runs.db"),
        "--port", str(port), "--engine", task_engine, "--tokenizer", str(TOKENIZER),
        "--chat-template", str(TEMPLATE), "--context-length", "200000",
        "--admin-token-file", str(token_file),
    ]  # fmt: skip
    serve_log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    server = subprocess.Popen(
        serve_cmd, env={**env(), "TR_ADMIN_TOKEN": token}, stdout=serve_log, stderr=serve_log
    )
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "serve did not start"
            with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=2):
                break
            time.sleep(0.2)
        (tmp_path / "sbx").mkdir()
        cmd = [
            a for a in cli(tmp_path, task_engine, "--samples-per-task", "1")
            if a not in ("--engine", task_engine)
        ]  # fmt: skip
        cmd += ["--recorder", url, "--agent-command", f"sh {tmp_path / 'forge.sh'}"]
        for key, value in (
            ("TOKEN_FILE", token_file),
            ("RECORDER_PID", server.pid),
            ("REPORT", reports),
        ):
            cmd += ["--agent-env", f"{key}={value}"]
        # As the README's slime example has it: the driver holds the token in its env.
        done = subprocess.run(
            cmd, env={**env(), "TR_ADMIN_TOKEN": token}, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        server.terminate()
        server.wait(60)
        serve_log.close()
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == len(shipped_tasks())
    logs = asyncio.run(sessions(tmp_path / "runs.db"))
    for line in lines:
        result = line["result"]
        sid = result["session_id"]
        found = report(reports / sid)
        assert found["uid"] != "0"
        assert (found["env_token"], found["env_close"]) == ("[]", "401"), found
        assert found["file_read"] != "0" and "Permission denied" in found["file_said"], found
        assert found["file_close"] == "401", found
        # The recorder's /proc entry is not even listed to a sandbox user (procview.py).
        assert found["proc_read"] != "0" and "No such file" in found["proc_said"], found
        assert found["proc_close"] == "401", found
        assert found["scan"] == "0", found
        # The real reward is the grader's: the agent changed nothing, so 0.
        assert (result["outcome"], result["reward"]) == ("failed", 0.0), result
        rewards = [e.reward for e in logs[sid] if isinstance(e, ev.RewardAssigned)]
        assert rewards == [0.0]
        (closed,) = [e for e in logs[sid] if isinstance(e, ev.SessionClosed)]
        assert closed.status == "completed"


@pytest.mark.parametrize(
    ("url", "loopback"),
    [
        ("http://127.0.0.1:8080", True),
        ("http://localhost:1", True),
        ("http://[::1]:80", True),
        ("http://127.3.2.1", True),
        ("https://recorder.example.com", False),
        ("http://10.0.0.5:8080", False),
    ],
)
def test_loopback_urls(url: str, loopback: bool) -> None:
    assert is_loopback_url(url) is loopback


def test_start_warnings_e2b_with_a_loopback_recorder() -> None:
    (warning,) = start_warnings("e2b", None, None, {})
    assert "--agent-base-url" in warning
    (warning,) = start_warnings("e2b", "http://127.0.0.1:8080", None, {})
    assert "127.0.0.1" in warning
    assert start_warnings("e2b", "http://127.0.0.1:8080", "https://rec.example.com", {}) == []
    # Local sandboxes as root get users of their own: nothing to warn about.
    assert start_warnings("local", None, None, {}) == ([] if os.geteuid() == 0 else [ANY])


class _Any:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and "not as unprivileged users" in other


ANY = _Any()


def test_a_token_on_the_command_line_is_refused_with_local_sandboxes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every user may read a process's command line (/proc/<pid>/cmdline): a local
    sandbox's user would read the driver's token there and close its session with 1.0."""
    shipped_tasks()
    monkeypatch.delenv("TR_ADMIN_TOKEN", raising=False)
    args = ["--tasks", str(TASKS), "--recorder", "http://127.0.0.1:9"]
    refused = CliRunner().invoke(rollout, [*args, "--admin-token", "s3cret"])
    assert refused.exit_code == 1
    assert "every local sandbox can read" in refused.output
    assert "TR_ADMIN_TOKEN or pass --admin-token-file" in refused.output

    def token(*extra: str) -> str | None:
        with rollout.make_context("rollout", [*args, *extra]) as ctx:
            return admin_token(ctx.params)

    assert token("--sandbox", "e2b", "--admin-token", "s3cret") == "s3cret"  # no local sandbox
    token_file = tmp_path / "admin-token"
    token_file.write_text("from-file\n")
    token_file.chmod(0o600)
    assert token("--admin-token-file", str(token_file)) == "from-file"
    token_file.chmod(0o644)
    with pytest.raises(click.ClickException, match="readable by others"):
        token("--admin-token-file", str(token_file))
    monkeypatch.setenv("TR_ADMIN_TOKEN", "from-env")
    assert token() == "from-env"
