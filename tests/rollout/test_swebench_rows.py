"""A downloaded SWE-bench JSONL (rows written in the published format, its repository a
local mirror) through `recorder rollout` end to end: the rows load as they are, the
agent's sandbox holds neither the gold patch nor the later history, the test_patch
grades, and the gold patch is nowhere in the event log either."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import test_rollout_cli as cli_tests
from task_repos import MARKER, base_repo, hide_the_fix_everywhere
from test_reward_integrity import TEST_PATCH

task_engine = cli_tests.task_engine  # the scripted engine `recorder serve` is pointed at

GOLD = "gold-only-5d1e"  # only in the rows' `patch`
GOLD_PATCH = (
    "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n"
    f" def add(a, b):\n-    return a - b\n+    return a + b  # {GOLD}\n"
)
# Looks for the gold patch and the later fix everywhere the agent can, then fixes the
# bug unless the prompt says not to. findings.txt travels back in the diff.
AGENT = r"""
set -u
{
echo "== sandbox"; grep -r -a -l -e %(gold)s -e %(marker)s .. 2>/dev/null | grep -v findings.txt
echo "== env"; env | grep -c -e %(gold)s -e %(marker)s
echo "== objects"; git cat-file --batch-all-objects --batch | grep -a -c -e %(gold)s -e %(marker)s
echo "== end"
} > findings.txt
grep -q NOFIX ../prompt.txt || sed -i '0,/return a - b/s//return a + b/' calc.py
"""


def row(instance_id: str, base: str, problem: str) -> dict[str, object]:
    """One row with SWE-bench's published columns (test lists as JSON strings)."""
    return {
        "repo": "acme/calc",
        "instance_id": instance_id,
        "base_commit": base,
        "patch": GOLD_PATCH,
        "test_patch": TEST_PATCH,
        "problem_statement": problem,
        "hints_text": "see the issue thread",
        "created_at": "2023-06-01T12:00:00Z",
        "version": "1.0",
        "FAIL_TO_PASS": json.dumps(["tests/test_add.py::test_add_sums"]),
        "PASS_TO_PASS": json.dumps(["tests/test_calc.py::test_sub"]),
        "environment_setup_commit": base,
        "difficulty": "<15 min fix",
    }


def findings(diff: str) -> dict[str, list[str]]:
    lines = diff[diff.index("+++ b/findings.txt") :].splitlines()[2:]
    sections: dict[str, list[str]] = {}
    for line in lines:
        if not line.startswith("+"):
            break
        if line.startswith("+== "):
            current = sections.setdefault(line[4:], [])
        else:
            current.append(line[1:])
    return sections


def test_a_downloaded_swe_bench_file_runs_end_to_end(tmp_path: Path, task_engine: str) -> None:
    mirror = tmp_path / "mirrors" / "acme__calc"
    base = base_repo(mirror, history=2)
    hide_the_fix_everywhere(mirror, tmp_path / "upstream")
    tasks = tmp_path / "swe-bench.jsonl"
    rows = [
        row("acme__calc-1", base, "add() in calc.py subtracts its arguments."),
        row("acme__calc-2", base, "add() in calc.py subtracts (NOFIX: leave it)."),
    ]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "agent.sh").write_text(AGENT % {"gold": GOLD, "marker": MARKER})
    (tmp_path / "sbx").mkdir()
    cmd = [
        sys.executable, "-m", "recorder.cli", "rollout",
        "--tasks", str(tasks), "--repo-mirrors", str(tmp_path / "mirrors"),
        "--engine", task_engine, "--db", str(tmp_path / "runs.db"),
        "--tokenizer", str(cli_tests.TOKENIZER), "--chat-template", str(cli_tests.TEMPLATE),
        "--out", str(tmp_path / "samples.jsonl"), "--no-progress", "--samples-per-task", "1",
        "--sandbox-option", f"root={tmp_path / 'sbx'}",
        "--agent-command", f"bash {tmp_path / 'agent.sh'}",
    ]  # fmt: skip
    done = subprocess.run(cmd, env=cli_tests.env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skipping" not in done.stderr
    out = {
        x["instance_id"]: x["result"]
        for x in map(json.loads, (tmp_path / "samples.jsonl").read_text().splitlines())
    }
    assert {k: (r["outcome"], r["reward"]) for k, r in out.items()} == {
        "acme__calc-1": ("passed", 1.0),
        "acme__calc-2": ("failed", 0.0),
    }
    assert out["acme__calc-2"]["evidence"]["tests_failed"] == ["tests/test_add.py::test_add_sums"]
    for result in out.values():
        assert findings(result["diff"]) == {
            "sandbox": [],
            "env": ["0"],
            "objects": ["0"],
            "end": [],
        }
    logs = asyncio.run(cli_tests.sessions(tmp_path / "runs.db"))
    assert len(logs) == 2
    assert GOLD.encode() not in msgspec.json.encode(logs)
    assert list((tmp_path / "sbx").iterdir()) == []
