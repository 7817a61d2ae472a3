"""A real rollout, start to finish: `python -m tools.quickstart_rollout [--samples 2] [--keep]`.

It builds the shipped task set (tools/tasks: tiny git repositories with a
failing test), starts the scripted task engine (SGLang's `/generate`
protocol; it answers each task with the tool calls of a correct fix) and runs

    recorder rollout --tasks tools/tasks/tasks.jsonl --engine URL --db runs.db
        --sandbox local --samples-per-task N --concurrency 4 --out samples.jsonl

which starts its own `recorder serve`, runs the real Claude Code CLI in a
local sandbox per rollout, grades each diff in a fresh sandbox and closes
each session with its reward. It then prints one session's whole story with
`replay show` (sandbox, agent, turns, diff, eval, reward) and checks that
every rollout passed with trained tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import click

from recorder.rollout.agent import local_binary
from tools.tasks.build import build_all
from tools.tasks.engine import CHAT_TEMPLATE, CONTEXT_LENGTH, TOKENIZER_DIR
from tools.test_engine.launch import REPO_ROOT, free_port


def say(message: str) -> None:
    click.echo(click.style("quickstart-rollout", fg="cyan", bold=True) + " " + message)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _start_engine(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.tasks.engine", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=REPO_ROOT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise click.ClickException(f"the task engine exited; see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise click.ClickException(f"the task engine did not start; see {log}")


@click.command()
@click.option("--samples", type=int, default=2, show_default=True, help="Samples per task.")
@click.option("--keep", is_flag=True, help="Keep the scratch directory (log, samples).")
def main(samples: int, keep: bool) -> None:
    """Run real Claude Code rollouts of the shipped tasks through the recorder."""
    if local_binary() is None:
        raise click.ClickException("the Claude Code CLI is missing: run bash tools/setup.sh")
    tasks_file = build_all()
    scratch = Path(tempfile.mkdtemp(prefix="quickstart-rollout-"))
    db, out = scratch / "runs.db", scratch / "samples.jsonl"
    say(f"task set {tasks_file}; scratch directory {scratch}")
    engine, engine_url = _start_engine(scratch / "engine.log")
    try:
        say(f"scripted task engine on {engine_url}; running `recorder rollout`")
        cmd = [
            sys.executable, "-m", "recorder.cli", "rollout",
            "--tasks", str(tasks_file), "--engine", engine_url, "--db", str(db),
            "--tokenizer", str(TOKENIZER_DIR), "--chat-template", str(CHAT_TEMPLATE),
            "--tool-parser", "qwen25", "--reasoning-parser", "qwen3",
            "--context-length", str(CONTEXT_LENGTH), "--sandbox", "local",
            "--samples-per-task", str(samples), "--concurrency", "4",
            "--temperature", "0.8", "--turn-budget", "20", "--wall-budget", "300",
            "--out", str(out),
        ]  # fmt: skip
        if subprocess.run(cmd, env=_env(), cwd=REPO_ROOT).returncode != 0:
            raise click.ClickException("recorder rollout failed")
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        first = lines[0]["result"]["session_id"]
        say(f"the story of session {first}, as the log tells it (replay show):")
        subprocess.run(
            [sys.executable, "-m", "replay.cli", "show", "--db", str(db), "--session", first],
            env=_env(), cwd=REPO_ROOT, check=True,
        )  # fmt: skip
        bad = [x for x in lines if x["result"]["outcome"] != "passed"]
        trained = sum(sum(s["loss_mask"]) for x in lines for s in x["result"]["samples"])
        if bad or len(lines) != samples * 3 or trained == 0:
            raise click.ClickException(f"unexpected rollouts: {bad or lines}")
        say(f"{len(lines)} rollouts passed, {trained} trained tokens; samples in {out}")
    finally:
        engine.terminate()
        engine.wait(30)
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            say(f"kept {scratch}")


if __name__ == "__main__":
    main()
