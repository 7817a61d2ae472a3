"""A reward is earned only by solving the task: the agent's repository holds base_commit
and its ancestors, nothing later (on every sandbox backend, from a local path or a URL);
edited tests are restored before grading; the gold patch never reaches a sandbox.

The agents are shell scripts run through the real driver, the real git, real sandboxes
(E2B through the real SDK against its doubles) and a real recorder."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from rollout_harness import chat_tokenizer, policy_recorder
from sandbox_backends import Backend
from task_repos import FAIL_TO_PASS, MARKER, PASS_TO_PASS, base_repo, git, hide_the_fix_everywhere

from recorder.rollout.agent import AgentSpec
from recorder.rollout.driver import RolloutRequest, RolloutResult, run_rollout
from recorder.rollout.tasks import Task, task_from_dict
from tests.server.conftest import Harness

FIX = "sed -i '0,/return a - b/s//return a + b/' calc.py"

# Everything an agent can ask git about its repository, written to findings.txt (which
# travels back in the agent's diff), then the one-liner that scored 1 before.
SEARCH = r"""
set -u
M=%(marker)s
{
echo "== rev-list"; git rev-list --all
echo "== log"; git log --all --format=%%H
echo "== refs"; git for-each-ref
echo "== reflog"; git reflog show --all --format=%%H 2>&1
echo "== stash"; git stash list
echo "== fsck"; git fsck --lost-found --unreachable --no-progress 2>&1
echo "== objects"; git cat-file --batch-all-objects --batch-check
echo "== remotes"; git remote -v
echo "== marker"; git cat-file --batch-all-objects --batch 2>/dev/null | grep -a -c "$M"
echo "== packs"; for i in .git/objects/pack/*.idx; do git verify-pack -v "$i"; done \
    | grep -c -E '^[0-9a-f]{40} (commit|tree|blob|tag) '
echo "== workdir"; ls -A ..
echo "== grep"; grep -r -a -l "$M" .. 2>/dev/null | grep -v findings.txt
echo "== end"
} > findings.txt 2>&1
git checkout "$(git rev-list --all -n1)" -- .
"""


@pytest.fixture
async def recorder(sqlite_url: str) -> AsyncIterator[Harness]:
    h = await policy_recorder(chat_tokenizer(), sqlite_url)
    try:
        yield h
    finally:
        await h.close()


def calc_task(repo: str, base: str, **kw: Any) -> Task:
    row: dict[str, Any] = {
        "instance_id": "calc-hidden-fix",
        "repo": repo,
        "base_commit": base,
        "problem_statement": "add() in calc.py subtracts; make tests/test_calc.py pass.",
        "tests": {"FAIL_TO_PASS": FAIL_TO_PASS, "PASS_TO_PASS": PASS_TO_PASS},
        **kw,
    }
    return task_from_dict(row)


async def rollout(h: Harness, backend: Backend, task: Task, command: str) -> RolloutResult:
    req = RolloutRequest(
        task=task,
        recorder_url=h.url,
        admin_token=h.config.admin_token,
        sandbox=backend.spec(),
        agent=AgentSpec(command=command),
    )
    return await run_rollout(req)


def findings(diff: str) -> dict[str, list[str]]:
    """The sections of findings.txt, read back from the agent's diff."""
    start = diff.index("+++ b/findings.txt")
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for line in diff[start:].splitlines()[2:]:
        if not line.startswith("+"):
            break
        text = line[1:]
        if text.startswith("== "):
            current = sections.setdefault(text[3:], [])
        elif text.strip():
            current.append(text)
    return sections


@pytest.mark.parametrize("source", ["path", "url"])
async def test_the_agent_finds_nothing_newer_than_base_commit(
    recorder: Harness, backend: Backend, tmp_path: Path, source: str
) -> None:
    src = tmp_path / "src"
    base = base_repo(src, history=3)
    hide_the_fix_everywhere(src, tmp_path / "upstream")
    assert MARKER in (src / "calc.py").read_text()  # the task repo's own HEAD has the fix
    repo = str(src) if source == "path" else f"file://{src}"
    task = calc_task(repo, base[:10])  # a short hash, as task files often name it

    script = tmp_path / "search.sh"
    script.write_text(SEARCH % {"marker": MARKER})
    cheat = await rollout(recorder, backend, task, f"bash {script}")
    assert (cheat.outcome, cheat.reward) == ("failed", 0.0), cheat.evidence
    found = findings(cheat.diff)
    history = git(src, "rev-list", base).split()
    objects = git(src, "rev-list", "--objects", base).splitlines()
    assert sorted(found["rev-list"]) == sorted(history)
    assert sorted(found["log"]) == sorted(history)
    assert found["refs"] == []
    assert set(found["reflog"]) <= {base}
    assert found["stash"] == []
    assert found["fsck"] == []
    assert len(found["objects"]) == len(objects)
    assert found["remotes"] == []
    assert found["marker"] == ["0"]
    assert found["packs"] == [str(len(objects))]
    assert not [f for f in found["workdir"] if "pack" in f or "bundle" in f or "tr-" in f]
    assert found["grep"] == []
    assert cheat.evidence["tests_failed"] == FAIL_TO_PASS

    solved = await rollout(recorder, backend, task, FIX)
    assert (solved.outcome, solved.reward) == ("passed", 1.0), solved.evidence
