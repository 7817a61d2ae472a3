"""A whole recording stack for the hooks' end-to-end tests.

`recorder serve` runs in its own process (as in a training run: the hooks sit
in trainer workers and reach it only by URL); the scripted engine behind it
plays a model that fixes the shipped tasks (tools/tasks/policy.py); the agent
is `mini_agent.py` (Anthropic Messages over HTTP, one Bash tool) in a local
sandbox, so no real CLI is needed.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from recorder.rollout.tasks import Task, load_tasks
from tests.conftest import sandbox_reachable_tmp_path

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "tests" / "data" / "smollm2-tokenizer"
TEMPLATE = REPO / "recorder" / "model" / "templates" / "chatml-tools.jinja"
MINI_AGENT = Path(__file__).resolve().parent / "mini_agent.py"
ADMIN = "hook-test-admin"


@dataclass(frozen=True)
class Stack:
    recorder_url: str
    tasks: dict[str, Task]

    def env(self) -> dict[str, str]:
        """The TR_* settings a trainer worker would carry (see recorder.integrations.common)."""
        agent = {
            "command": f"{{agent}} {shlex.quote(str(MINI_AGENT))} {{prompt_file}}",
            "binary": sys.executable,
            "install": False,
        }
        return {
            "TR_RECORDER_URL": self.recorder_url,
            "TR_ADMIN_TOKEN": ADMIN,
            # The stand-in agent is this interpreter with the anthropic SDK, under /root
            # (pyenv) here: a sandbox user of its own could not run it. Isolation is
            # tested in tests/rollout; these tests are about the hooks.
            "TR_SANDBOX": json.dumps({"backend": "local", "options": {"user": "driver"}}),
            "TR_AGENT": json.dumps(agent),
            "TR_WALL_BUDGET_S": "120",
        }


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout_s:g} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from recorder.model.tokenizer import load_tokenizer
    from tools.tasks.build import build_all
    from tools.tasks.policy import task_policy
    from tools.test_engine.core import EngineCore
    from tools.test_engine.launch import ThreadedEngine, free_port
    from tools.test_engine.scripted import ScriptedBackend

    tasks, errors = load_tasks(build_all())
    assert not errors, errors
    tokenizer = load_tokenizer(str(TOKENIZER))

    def core() -> EngineCore:
        backend = ScriptedBackend(tokenizer, [], default_reply=task_policy(tokenizer))
        return EngineCore(backend, tokenizer)

    tmp = tmp_path_factory.mktemp("stack")
    log = tmp / "recorder.log"
    with ThreadedEngine(core) as engine, log.open("wb") as out:
        port = free_port()
        args = [
            sys.executable, "-m", "recorder.cli", "serve",
            "--db", f"sqlite+aiosqlite:///{tmp / 'runs.db'}",
            "--engine", engine.url,
            "--tokenizer", str(TOKENIZER),
            "--chat-template", str(TEMPLATE),
            "--tool-parser", "qwen25",
            "--port", str(port),
            "--model-name", "test-model",
        ]  # fmt: skip
        env = {**os.environ, "TR_ADMIN_TOKEN": ADMIN, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(proc, url, log, timeout_s=120)
            yield Stack(recorder_url=url, tasks={t.instance_id: t for t in tasks})
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def tmp_path(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A temporary directory local sandboxes' own users can reach (tests run as root)."""
    yield from sandbox_reachable_tmp_path(request.node.name)
