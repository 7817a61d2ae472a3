"""Grading a patch: run the task's grader in a fresh sandbox and turn its output into a reward.

The parsing and the reward are pure functions (`parse_test_report`,
`grade_tests`, `grade_exit`); `run_grader` is the one I/O step. A grader that
cannot run at all (exit 126/127: command not found or not executable) is
infrastructure (`eval_crashed`), unless its pytest started (then the code under
test chose that status); any other outcome, a timeout included, is the patch's
result.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from typing import Any

import msgspec

from recorder.rollout.errors import InfraError
from recorder.rollout.proof import Proof, clean, outcomes, read_proofs
from recorder.rollout.protect import runs_pytest
from recorder.rollout.sandbox import CommandTimeout, ExecResult, Sandbox
from recorder.rollout.tasks import Task, TestSpec
from recorder.rollout.workspace import tail

_REPORT_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XPASS|XFAIL|SKIPPED)\s+(\S+)")
_FAILURES = ("FAILED", "ERROR")
_COLOR = re.compile(r"\x1b\[[0-9;]*m")  # `--color=yes`: SGR codes inside the lines
_CANNOT_RUN = (126, 127)


class GraderCannotRun(InfraError):
    """The grader exited 126/127 (not found, not executable) before its pytest started:
    infrastructure, unless the patch is what broke it (`driver._Rollout.patched_grade`)."""


class Grade(msgspec.Struct, frozen=True, kw_only=True):
    reward: float
    passed: bool
    exit_code: int | None
    tests_passed: list[str] = []
    tests_failed: list[str] = []
    timed_out: bool = False
    output_tail: str = ""
    # Why the patch earned 0 whatever its grader printed:
    # - "test_patch_conflict";
    # - "pytest_did_not_finish" (`grade_tests`: no report of our plugin's);
    # - "exit_code_without_pytest_pass" (`grade_exit`);
    # - "grader_plugin_not_loaded" (no pytest of the grader's loaded our plugin: its
    #   command keeps it out, such as `python -I`);
    # - "grader_broken_by_patch" (the grader could not run with the patch, and could
    #   without it: `driver`);
    # - "patch_apply" (the agent's diff does not apply on the tree it was taken against);
    # - "diff_forged" (the diff changes what setup made, which no diff the driver takes
    #   holds);
    # - "repository_broken" (the agent's repository could not be diffed: `.git` removed);
    # - "disk_full" (the agent's sandbox, or the eval's after the patch, filled a disk of
    #   its own).
    failure: str | None = None
    # Protected paths the agent's patch changed (restored as setup left them before grading).
    protected_changed: list[str] = []

    @classmethod
    def zero(cls, failure: str | None, why: str, **fields: Any) -> Grade:
        """Reward 0 for `failure`, decided without the grader's verdict (`why` kept)."""
        return cls(
            reward=0.0,
            passed=False,
            exit_code=None,
            failure=failure,
            output_tail=tail(why, 2000),
            **fields,
        )

    def evidence(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def parse_test_report(text: str) -> dict[str, str]:
    """test id -> PASSED/FAILED/... from a pytest `-rA` style report.

    The last word wins, except that a FAILED or ERROR line for an id is never
    taken back: the code under test prints what it likes, before pytest's
    summary (echoed in its captured output) or after it (at exit), and a
    `PASSED <id>` line of its own must not turn the runner's failure into a
    pass. (A test that passed and then failed its teardown is an ERROR, as
    pytest counts it.)
    """
    outcomes: dict[str, str] = {}
    for line in _COLOR.sub("", text).splitlines():
        m = _REPORT_LINE.match(line.strip())
        if m and outcomes.get(m.group(2)) not in _FAILURES:
            outcomes[m.group(2)] = m.group(1)
    return outcomes


def grade_tests(spec: TestSpec, result: ExecResult, mode: str, proof: Proof | None = None) -> Grade:
    """Every listed test must have passed (or XPASSed); one not reported has failed.

    With `proof` (the grader runs pytest) only our plugin's reports count
    (`proof.read_proofs`); without it, the runner's `-rA` lines on the output."""
    text = result.stdout + "\n" + result.stderr
    failure = None
    if proof is None:
        report = parse_test_report(text)
        passed = [t for t in spec.all if report.get(t) in ("PASSED", "XPASS")]
    else:
        runs = read_proofs(text, proof.nonce)
        found = outcomes(runs)
        passed = [t for t in spec.all if found.get(t) == "passed"]
        failure = None if runs else "pytest_did_not_finish"
    failed = [t for t in spec.all if t not in passed]
    all_passed = not failed
    reward = len(passed) / len(spec.all) if mode == "fraction" else float(all_passed)
    return Grade(
        reward=reward,
        passed=all_passed,
        exit_code=result.exit_code,
        tests_passed=passed,
        tests_failed=failed,
        output_tail=tail(result.stdout + result.stderr),
        failure=failure,
    )


def grade_exit(result: ExecResult, proof: Proof | None = None) -> Grade:
    """Exit code 0 passes; when the grader runs pytest (`proof`), pytest must have said so.

    The code under test runs in the grader's process and can end it with exit
    code 0 whatever the tests did (`os._exit(0)` on import, before any test
    ran, or from an atexit hook after pytest counted a failure), having printed
    whatever pytest would. So a grader that runs pytest passes only if each of
    its pytest runs reported, through our plugin, exit status 0, a test passed
    and none failed. Any other grader is its exit code: the code under test can
    end it with 0, and nothing outside that process can tell (see the README).
    """
    output = result.stdout + result.stderr
    ok = result.exit_code == 0
    failure = None
    if ok and proof is not None and not clean(read_proofs(output, proof.nonce)):
        ok, failure = False, "exit_code_without_pytest_pass"
    return Grade(
        reward=float(ok),
        passed=ok,
        exit_code=result.exit_code,
        output_tail=tail(output),
        failure=failure,
    )


async def _pytest_started(sb: Sandbox, proof: Proof | None) -> bool:
    """Did the grader's pytest load our plugin (it takes its nonce file as it loads)?
    Then the grader could run, and an exit status of 126/127 is the code under test's:
    a sixth audit's `os._exit(127)` in the module under test had turned a policy's
    failure into an infrastructure abort (masked: no gradient)."""
    if proof is None:
        return False
    gone = await sb.exec(f"test ! -e {shlex.quote(proof.nonce_file(sb.workdir))}", timeout_s=60)
    return gone.exit_code == 0


async def _plugin_loaded(sb: Sandbox, proof: Proof, result: ExecResult) -> bool:
    """Did a pytest of the grader's load our plugin (it reported, or took its nonce)?"""
    if read_proofs(result.stdout + result.stderr, proof.nonce):
        return True
    return await _pytest_started(sb, proof)


def grader_command(task: Task, workdir: str) -> str:
    if task.tests is not None:
        return task.tests.cmd.replace("{tests}", " ".join(shlex.quote(t) for t in task.tests.all))
    if task.eval_script is not None:
        return f"bash {shlex.quote(posixpath.join(workdir, 'eval.sh'))}"
    assert task.eval_cmd is not None
    return task.eval_cmd


async def run_grader(sb: Sandbox, task: Task, repo: str) -> Grade:
    proof = Proof.new() if runs_pytest(task) else None
    if task.eval_script is not None:
        script = task.eval_script
        if proof is not None:
            script = proof.kept_through(script, sb.workdir)
        await sb.write_file(posixpath.join(sb.workdir, "eval.sh"), script)
    cmd = grader_command(task, sb.workdir)
    if proof is not None:
        for path, text in proof.files(sb.workdir).items():
            await sb.write_file(path, text)
        cmd = proof.wrap(cmd, sb.workdir)
    try:
        result = await sb.exec(cmd, timeout_s=task.eval_timeout_s, cwd=repo)
    except CommandTimeout:
        return Grade(reward=0.0, passed=False, exit_code=None, timed_out=True)
    if result.exit_code in _CANNOT_RUN and not await _pytest_started(sb, proof):
        raise GraderCannotRun(
            "eval_crashed",
            f"the grader could not run (exit {result.exit_code}): {tail(result.stderr, 500)}",
        )
    if task.tests is not None:
        grade = grade_tests(task.tests, result, task.reward, proof)
    else:
        grade = grade_exit(result, proof)
    if proof is not None and not grade.passed and not await _plugin_loaded(sb, proof, result):
        # Still 0 (a patch may be what kept pytest from starting), but named: a task
        # whose grader never loads the plugin gives every patch 0, a correct fix too.
        grade = msgspec.structs.replace(grade, failure="grader_plugin_not_loaded")
    return grade
