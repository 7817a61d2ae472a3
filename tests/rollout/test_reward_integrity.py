"""A reward is earned only by solving the task: the agent's repository holds base_commit
and its ancestors, nothing later (on every sandbox backend, from a local path or a URL);
edited tests are restored before grading; the gold patch never reaches a sandbox.

The agents are shell scripts run through the real driver, the real git, real sandboxes
(E2B through the real SDK against its doubles) and a real recorder."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from rollout_harness import chat_tokenizer, policy_recorder
from sandbox_backends import Backend
from task_repos import FAIL_TO_PASS, MARKER, PASS_TO_PASS, base_repo, git, hide_the_fix_everywhere

from recorder.log import events as ev
from recorder.rollout import protect
from recorder.rollout.agent import AgentSpec
from recorder.rollout.driver import RolloutRequest, RolloutResult, run_group, run_rollout
from recorder.rollout.sandbox import SandboxSpec
from recorder.rollout.sandbox import local as local_sandbox
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
    assert cheat.evidence["tests_failed"] == FAIL_TO_PASS, cheat.evidence

    solved = await rollout(recorder, backend, task, FIX)
    assert (solved.outcome, solved.reward) == ("passed", 1.0), solved.evidence


# -- protected tests -------------------------------------------------------------------

# Rewrites the listed tests to pass and adds a conftest.py that passes everything.
REWRITE = (
    "printf 'def test_add():\\n    pass\\n\\n\\ndef test_sub():\\n    pass\\n' "
    "> tests/test_calc.py && "
    "printf 'import pytest\\n\\n\\n@pytest.hookimpl(tryfirst=True)\\n"
    "def pytest_runtest_call(item):\\n    return True\\n' > tests/conftest.py"
)
# The test SWE-bench style tasks ship in test_patch: a new test file for add().
ADD_TEST = "from calc import add\n\n\ndef test_add_sums():\n    assert add(2, 3) == 5\n"
TEST_PATCH = (
    "diff --git a/tests/test_add.py b/tests/test_add.py\nnew file mode 100644\n"
    "--- /dev/null\n+++ b/tests/test_add.py\n@@ -0,0 +1,5 @@\n"
    + "".join(f"+{line}\n" for line in ADD_TEST.splitlines())
)
# Pre-creates test_patch's new file with a test that always passes.
PLANT = "printf 'def test_add_sums():\\n    pass\\n' > tests/test_add.py"


def local(tmp_path: Path) -> Backend:
    (tmp_path / "local").mkdir(exist_ok=True)
    return Backend("local", tmp_path)


@pytest.mark.parametrize(
    ("protection", "agent", "reward"),
    [
        ("default", REWRITE, 0.0),
        ("protected_paths", REWRITE, 0.0),
        ("test_patch", PLANT, 0.0),
        ("test_patch", FIX, 1.0),
        ("none", REWRITE, 1.0),  # the attack is real: a task that opts out pays for it
    ],
)
async def test_rewriting_the_tests_earns_nothing(
    recorder: Harness, tmp_path: Path, protection: str, agent: str, reward: float
) -> None:
    src = tmp_path / "src"
    base = base_repo(src)
    pytest_all = {"tests": None, "eval_cmd": "python -m pytest -q -p no:cacheprovider tests"}
    task = {
        "default": lambda: calc_task(str(src), base),
        "protected_paths": lambda: calc_task(str(src), base, protected_paths=["tests/**"], **pytest_all),
        "test_patch": lambda: calc_task(
            str(src), base, tests={"FAIL_TO_PASS": ["tests/test_add.py::test_add_sums"]},
            test_patch=TEST_PATCH,
        ),
        "none": lambda: calc_task(str(src), base, protected_paths=[], **pytest_all),
    }[protection]()  # fmt: skip
    result = await rollout(recorder, local(tmp_path), task, agent)
    assert (result.reward, result.infra_cause) == (reward, None), result.evidence
    edited = (
        ["tests/test_add.py"] if agent == PLANT else ["tests/conftest.py", "tests/test_calc.py"]
    )
    if agent != FIX:
        for path in edited:  # the trainer still sees the attempt
            assert f"+++ b/{path}" in result.diff
    if reward == 0.0:
        assert sorted(result.evidence["protected_changed"]) == edited
        (restored,) = [
            e.detail
            for e in await recorder.payloads(result.session_id, ev.SandboxEvent)
            if e.kind == "protected_restored"
        ]
        assert sorted(restored["paths"]) == edited


async def test_a_test_patch_the_agent_conflicts_with_is_reward_zero_with_the_reason(
    recorder: Harness, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    base = base_repo(src)
    # Changes the line the agent's edit changes too; the task protects nothing.
    test_patch = (
        "diff --git a/tests/test_calc.py b/tests/test_calc.py\n"
        "--- a/tests/test_calc.py\n+++ b/tests/test_calc.py\n@@ -4,2 +4,2 @@\n"
        " def test_add():\n-    assert add(2, 3) == 5\n+    assert add(2, 3) == 5 and add(0, 0) == 0\n"
    )
    task = calc_task(str(src), base, protected_paths=[], test_patch=test_patch)
    rewrite = "sed -i 's/assert add(2, 3) == 5/assert add(2, 3) == -1/' tests/test_calc.py"
    result = await rollout(recorder, local(tmp_path), task, rewrite)
    assert (result.outcome, result.reward, result.infra_cause) == ("failed", 0.0, None)
    assert result.evidence["failure"] == "test_patch_conflict"
    assert "tests/test_calc.py" in result.evidence["output_tail"]
    assert "test_patch does not apply" in result.evidence["output_tail"]
    (reward,) = await recorder.payloads(result.session_id, ev.RewardAssigned)
    assert reward.reward == 0.0 and reward.detail["failure"] == "test_patch_conflict"
    kinds = [e.kind for e in await recorder.payloads(result.session_id, ev.SandboxEvent)]
    assert "test_patch_applied" not in kinds and kinds[-2] == "eval_result"


# -- the test runner's report -------------------------------------------------------------

PYTEST_EXIT_CODE = {"tests": None, "eval_cmd": "python -m pytest -q -p no:cacheprovider tests"}
GRADERS = ["tests", "pytest exit code"]


def graded_by(grader: str) -> dict[str, Any]:
    """Task fields for a `tests` grader, or for pytest's exit code (tests protected by glob)."""
    return {} if grader == "tests" else {**PYTEST_EXIT_CODE, "protected_paths": ["tests/**"]}


# A line in pytest's report format, printed by the module under test when the process
# exits: after pytest's own summary, where a reader that lets the last word win takes it.
FORGE_REPORT = (
    "printf 'import atexit\\n\\natexit.register(print, \"PASSED tests/test_calc.py::test_add\")\\n'"
    " >> calc.py"
)
# A plugin in the repository that reports every test as passed ...
PLUGIN = (
    "printf 'import pytest\\n\\n\\n@pytest.hookimpl(hookwrapper=True)\\n"
    "def pytest_runtest_makereport(item, call):\\n    report = (yield).get_result()\\n"
    '    report.outcome = "passed"\\n    report.longrepr = None\\n\' > forge.py'
)
# ... loaded by a pytest config file (pytest reads the one nearest the tests first).
CONFIGS = {
    "pytest.ini": "[pytest]\\naddopts = -p forge\\n",
    "tests/pytest.ini": "[pytest]\\naddopts = -p forge\\n",
    "tox.ini": "[pytest]\\naddopts = -p forge\\n",
    "setup.cfg": "[tool:pytest]\\naddopts = -p forge\\n",
    "pyproject.toml": '[tool.pytest.ini_options]\\naddopts = "-p forge"\\n',
}


def plugin_through(config: str) -> str:
    return f"{PLUGIN} && printf '{CONFIGS[config]}' > {config}"


async def test_a_pass_printed_after_the_runners_report_earns_nothing(
    recorder: Harness, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    task = calc_task(str(src), base_repo(src))
    result = await rollout(recorder, local(tmp_path), task, FORGE_REPORT)
    assert (result.reward, result.infra_cause) == (0.0, None), result.evidence
    assert result.evidence["tests_failed"] == FAIL_TO_PASS
    # The forged line did reach the grader's output, after pytest's summary.
    tail = result.evidence["output_tail"]
    assert tail.rstrip().endswith("PASSED tests/test_calc.py::test_add")
    assert "FAILED tests/test_calc.py::test_add" in tail


async def assert_restored_and_real(
    recorder: Harness, tmp_path: Path, agent: str, planted: str
) -> None:
    """`agent` earns 0 on the default protection, its `planted` file restored (and still
    in the diff the trainer sees); on a task that protects nothing, with pytest's own
    files unprotected too (`protect.pytest_reads`, which no task can opt out of), it
    earns 1: the attack is real."""
    src = tmp_path / "src"
    base = base_repo(src)
    result = await rollout(recorder, local(tmp_path), calc_task(str(src), base), agent)
    assert (result.reward, result.infra_cause) == (0.0, None), result.evidence
    assert result.evidence["protected_changed"] == [planted]
    assert f"+++ b/{planted}" in result.diff
    opted_out = calc_task(str(src), base, protected_paths=[])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(protect, "pytest_reads", lambda task: [])
        result = await rollout(recorder, local(tmp_path), opted_out, agent)
    assert (result.reward, result.infra_cause) == (1.0, None), result.evidence


@pytest.mark.parametrize("config", list(CONFIGS))
async def test_a_runner_plugin_loaded_by_a_config_file_earns_nothing(
    recorder: Harness, tmp_path: Path, config: str
) -> None:
    await assert_restored_and_real(recorder, tmp_path, plugin_through(config), config)


# The runner itself replaced from the repository's root, which `python -m pytest` puts first
# on sys.path: a `pytest.py` that prints a pass for every id it is given, or package
# metadata whose pytest11 entry point is a plugin pytest loads before any test.
FAKE_RUNNER = (
    'printf \'import sys\\n\\nids = [a for a in sys.argv[1:] if "::" in a]\\n'
    'for i in ids:\\n    print("PASSED", i)\\n'
    'print(max(len(ids), 1), "passed in 0.01s")\\n\' > pytest.py'
)
ENTRY_POINT = (
    f"{PLUGIN} && mkdir forge-1.0.dist-info && printf 'Metadata-Version: 2.1\\nName: forge\\n"
    "Version: 1.0\\n' > forge-1.0.dist-info/METADATA && printf '[pytest11]\\nforge = forge\\n'"
    " > forge-1.0.dist-info/entry_points.txt"
)
ROOT_SHADOWS = {
    "runner": (FAKE_RUNNER, ["pytest.py"]),
    # package metadata is protected in every directory: its files are removed
    "entry point": (
        ENTRY_POINT,
        ["forge-1.0.dist-info/METADATA", "forge-1.0.dist-info/entry_points.txt"],
    ),
}


@pytest.mark.parametrize("agent", list(ROOT_SHADOWS))
@pytest.mark.parametrize("grader", GRADERS)
async def test_a_runner_replaced_from_the_repository_root_earns_nothing(
    recorder: Harness, tmp_path: Path, agent: str, grader: str
) -> None:
    src = tmp_path / "src"
    base = base_repo(src)
    kw = graded_by(grader)
    command, removed = ROOT_SHADOWS[agent]
    result = await rollout(recorder, local(tmp_path), calc_task(str(src), base, **kw), command)
    assert (result.reward, result.infra_cause) == (0.0, None), result.evidence
    assert result.evidence["protected_changed"] == removed
    assert f"+++ b/{removed[0]}" in result.diff  # the trainer still sees the attempt
    # A fix that also adds them earns its reward: they are removed, the fix stays.
    fixed = await rollout(
        recorder, local(tmp_path), calc_task(str(src), base, **kw), f"{command} && {FIX}"
    )
    assert (fixed.reward, fixed.evidence["protected_changed"]) == (1.0, removed), fixed.evidence


# One rollout of a group plants a pytest config and a conftest that passes every test in
# each directory above its sandbox that it can write, then keeps working while a sibling is
# graded: pytest takes the nearest config up to / (with the system's temp dir as the
# sandboxes' root, /tmp was one: the sibling earned 1 without a fix).
PLANT_ABOVE = f"""{PLUGIN} && mv forge.py conftest.py
for d in $(p=$(dirname "$PWD"); while [ "$p" != / ]; do p=$(dirname "$p"); echo "$p"; done); do
  cp conftest.py "$d/" 2>/dev/null && printf '[pytest]\\n' > "$d/pytest.ini" 2>/dev/null \\
    && chmod 644 "$d/conftest.py" "$d/pytest.ini" && echo "$d" >> planted.txt
done
rm conftest.py; sleep 20"""


@pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes share nothing only as users of their own")
async def test_a_sibling_cannot_plant_a_pass_above_the_other_sandboxes(
    recorder: Harness, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    task = calc_task(str(src), base_repo(src))
    commands = [PLANT_ABOVE, "echo '# nothing fixed' >> calc.py"]
    group = [
        RolloutRequest(
            task=task,
            recorder_url=recorder.url,
            admin_token=recorder.config.admin_token,
            sandbox=SandboxSpec(),  # the default root, where a training run's sandboxes go
            agent=AgentSpec(command=command),
            sample_index=i,
        )
        for i, command in enumerate(commands)
    ]
    try:
        results = await run_group(group, concurrency=2)
    finally:  # what a failed defence left above the sandboxes (a sandbox user's files)
        for parent in Path(local_sandbox.ROOT_SANDBOXES, "x").parents:
            for planted in (parent / "pytest.ini", parent / "conftest.py"):
                if planted.is_file() and planted.stat().st_uid != 0:
                    planted.unlink()
    assert (results[1].reward, results[1].infra_cause) == (0.0, None), results[1].evidence
    assert "planted.txt" not in results[0].diff  # it could write above itself nowhere


# A module beside the tests with the name of the module under test: pytest puts the tests'
# directory first on sys.path, so `from calc import add` finds it, and calc.py stays buggy.
SHADOW = (
    "printf 'def add(a, b):\\n    return a + b\\n\\n\\ndef sub(a, b):\\n    return a - b\\n'"
    " > tests/calc.py"
)


# The same module, ignored by a .gitignore of the patch's (added with -f, so it was in the
# diff): a grader that lists the patch's files with a plain `git add -A` never sees it.
IGNORED_SHADOW = f"printf 'tests/calc.py\\n' >> .gitignore && {SHADOW} && git add -f tests/calc.py"


async def test_a_module_shadowing_the_code_under_test_earns_nothing(
    recorder: Harness, tmp_path: Path
) -> None:
    await assert_restored_and_real(recorder, tmp_path, SHADOW, "tests/calc.py")


async def test_a_module_the_agent_force_added_past_its_gitignore_never_reaches_the_eval(
    recorder: Harness, tmp_path: Path
) -> None:
    """The diff is taken with an index of its own (`diff.take_diff`): what the agent
    forced into its index is not in it, and the restore's pass over ignored files in
    the eval stays as a second line."""
    src = tmp_path / "src"
    task = calc_task(str(src), base_repo(src))
    result = await rollout(recorder, local(tmp_path), task, IGNORED_SHADOW)
    assert (result.reward, result.infra_cause) == (0.0, None), result.evidence
    assert "+++ b/tests/calc.py" not in result.diff and "+++ b/.gitignore" in result.diff


# The tests' directory replaced by a symlink to passing tests of the agent's.
SYMLINKED_TESTS = (
    "mkdir fake && printf 'def test_add():\\n    pass\\n\\n\\ndef test_sub():\\n    pass\\n'"
    " > fake/test_calc.py && git rm -rq tests && ln -s fake tests"
)


async def test_tests_replaced_by_a_symlink_earn_nothing(recorder: Harness, tmp_path: Path) -> None:
    src = tmp_path / "src"
    task = calc_task(str(src), base_repo(src))
    result = await rollout(recorder, local(tmp_path), task, SYMLINKED_TESTS)
    assert (result.reward, result.infra_cause) == (0.0, None), result.evidence
    assert "tests/test_calc.py" in result.evidence["protected_changed"]
    assert result.evidence["tests_failed"] == FAIL_TO_PASS


# -- the grader's exit code ---------------------------------------------------------------

# The module under test ends the grader's process with exit code 0: on import, before any
# test ran, or at exit, after pytest counted the failure.
EXIT_ON_IMPORT = "printf 'import os\\n\\nos._exit(0)\\n' >> calc.py"
EXIT_AT_EXIT = "printf 'import atexit\\nimport os\\n\\natexit.register(os._exit, 0)\\n' >> calc.py"


@pytest.mark.parametrize("agent", [EXIT_ON_IMPORT, EXIT_AT_EXIT], ids=["on-import", "at-exit"])
@pytest.mark.parametrize("grader", GRADERS)
async def test_exit_code_zero_from_the_code_under_test_earns_nothing(
    recorder: Harness, tmp_path: Path, agent: str, grader: str
) -> None:
    src = tmp_path / "src"
    base = base_repo(src)
    kw = graded_by(grader)
    result = await rollout(recorder, local(tmp_path), calc_task(str(src), base, **kw), agent)
    assert (result.reward, result.infra_cause) == (0.0, None), result.evidence
    assert result.evidence["exit_code"] == 0
    if grader == "tests":  # not reported (on import), or reported FAILED (at exit)
        assert FAIL_TO_PASS[0] in result.evidence["tests_failed"]
    else:
        assert result.evidence["failure"] == "exit_code_without_pytest_pass"
    # The fix still passes the same grader.
    solved = await rollout(recorder, local(tmp_path), calc_task(str(src), base, **kw), FIX)
    assert (solved.reward, solved.evidence["failure"]) == (1.0, None), solved.evidence


async def test_a_grader_outside_pytest_has_only_the_exit_code(
    recorder: Harness, tmp_path: Path
) -> None:
    """The limit README states: a plain exit-code grader trusts the process it runs, and a
    marker line it prints last is no help (the module under test reads it from its own
    command line, as an audit showed). A grader that runs the check under pytest is not
    fooled (test_reward_integrity_tree.py: the shipped wordcount task does so)."""
    src = tmp_path / "src"
    check = "python -c 'from calc import add; assert add(2, 3) == 5'"
    task = calc_task(str(src), base_repo(src), tests=None, eval_cmd=check, protected_paths=[])
    result = await rollout(recorder, local(tmp_path), task, EXIT_ON_IMPORT)
    assert (result.reward, result.infra_cause) == (1.0, None), result.evidence
    marked = calc_task(
        str(src), task.base_commit, tests=None, eval_script=MARKED, protected_paths=[]
    )
    result = await rollout(recorder, local(tmp_path), marked, PRINT_THE_MARKER)
    assert (result.reward, result.infra_cause) == (1.0, None), result.evidence
    solved = await rollout(recorder, local(tmp_path), marked, FIX)
    assert solved.reward == 1.0, solved.evidence


MARKED = (
    "python -c 'from calc import add; assert add(2, 3) == 5; print(\"graded-7d1f\")'"
    " | grep -qx graded-7d1f\n"
)
# Appended to calc.py: print what the grader's command line prints, then leave.
PRINT_THE_MARKER = (
    'printf \'import os, re\\n\\nfor _m in re.findall(r"print[(].([a-z0-9-]+).[)]", '
    'open("/proc/self/cmdline").read()):\\n    print(_m, flush=True)\\nos._exit(0)\\n\''
    " >> calc.py"
)
