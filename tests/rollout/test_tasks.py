"""Task files and grading: pure checks, no sandbox."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import msgspec
import pytest

from recorder.rollout.evaluate import (
    grade_exit,
    grade_tests,
    parse_test_report,
)
from recorder.rollout.proof import Proof
from recorder.rollout.protect import module_name, runs_pytest, shadowing_entries
from recorder.rollout.sandbox import ExecResult
from recorder.rollout.tasks import TaskError, TestSpec, load_tasks, task_from_dict

GOOD = {
    "instance_id": "t-1",
    "repo": "repos/t",
    "base_commit": "abc123",
    "problem_statement": "fix it",
    "eval_cmd": "true",
}


def test_a_bad_line_is_reported_by_line_and_field_and_the_others_load(tmp_path: Path) -> None:
    lines = [
        json.dumps(GOOD),
        "",
        json.dumps({**GOOD, "instance_id": "t-2", "repo": 7}),
        "{not json",
        json.dumps({**GOOD, "instance_id": "t-3", "tests": {"FAIL_TO_PASS": ["a"]}}),
        json.dumps({k: v for k, v in GOOD.items() if k != "problem_statement"}),
        json.dumps(
            {**GOOD, "instance_id": "t-4", "eval_cmd": None, "tests": {"FAIL_TO_PASS": [1]}}
        ),
        json.dumps({**GOOD, "instance_id": "t-5", "reward": "half"}),
        json.dumps(GOOD),
        json.dumps(
            {
                **GOOD,
                "instance_id": "t-6",
                "eval_cmd": None,
                "eval_script": "exit 0",
                "setup": ["x"],
            }
        ),
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    tasks, errors = load_tasks(path)
    assert [t.instance_id for t in tasks] == ["t-1", "t-6"]
    assert tasks[0].repo == str(tmp_path / "repos" / "t")  # relative to the task file
    assert [(e.line, e.field) for e in errors] == [
        (3, "repo"),
        (4, ""),
        (5, ""),
        (6, "problem_statement"),
        (7, "tests.FAIL_TO_PASS[0]"),
        (8, "reward"),
        (9, "instance_id"),
    ]
    assert "exactly one of eval_cmd, tests, eval_script" in errors[2].message
    assert "duplicate" in errors[6].message
    assert str(errors[0]).startswith("line 3: repo:")


def test_git_urls_stay_as_they_are() -> None:
    for url in ("https://github.com/o/r.git", "git@github.com:o/r.git"):
        task = task_from_dict({**GOOD, "repo": url}, base_dir=Path("/x"))
        assert task.repo == url and not task.is_local_repo


REPORT = """
tests/test_x.py::test_a PASSED
=========================== short test summary info ============================
PASSED tests/test_x.py::test_a
FAILED tests/test_x.py::test_b - assert 1 == 2
ERROR tests/test_y.py::test_c - ImportError
"""


def test_report_parsing_and_rewards() -> None:
    assert parse_test_report(REPORT) == {
        "tests/test_x.py::test_a": "PASSED",
        "tests/test_x.py::test_b": "FAILED",
        "tests/test_y.py::test_c": "ERROR",
    }
    spec = TestSpec(
        fail_to_pass=["tests/test_x.py::test_a", "tests/test_x.py::test_b"],
        pass_to_pass=["tests/test_y.py::test_c", "tests/test_z.py::test_unreported"],
    )
    run = ExecResult(1, REPORT, "")
    binary = grade_tests(spec, run, "binary")
    assert (binary.reward, binary.passed) == (0.0, False)
    assert binary.tests_passed == ["tests/test_x.py::test_a"]
    assert binary.tests_failed == [
        "tests/test_x.py::test_b",
        "tests/test_y.py::test_c",
        "tests/test_z.py::test_unreported",  # not reported = failed
    ]
    assert grade_tests(spec, run, "fraction").reward == 0.25
    everything = ExecResult(0, "\n".join(f"PASSED {t}" for t in spec.all), "")
    assert grade_tests(spec, everything, "binary").reward == 1.0
    assert grade_exit(ExecResult(0, "", "")).reward == 1.0
    assert grade_exit(ExecResult(2, "", "boom")).reward == 0.0


# pytest's output when the module under test prints report lines of its own: during the
# test (echoed with its captured output, before the summary) and at exit (after it).
FORGED = """
F.
----------------------------- Captured stdout call -----------------------------
=========================== short test summary info ============================
PASSED tests/test_x.py::test_a
1 passed in 0.01s
=========================== short test summary info ============================
PASSED tests/test_x.py::test_b
FAILED tests/test_x.py::test_a - assert -1 == 5
1 failed, 1 passed in 0.14s
PASSED tests/test_x.py::test_a
XPASS tests/test_x.py::test_a
"""


def test_a_failure_the_runner_reported_is_never_taken_back() -> None:
    assert parse_test_report(FORGED) == {
        "tests/test_x.py::test_a": "FAILED",
        "tests/test_x.py::test_b": "PASSED",
    }
    spec = TestSpec(
        fail_to_pass=["tests/test_x.py::test_a"], pass_to_pass=["tests/test_x.py::test_b"]
    )
    grade = grade_tests(spec, ExecResult(1, FORGED, ""), "binary")
    assert (grade.reward, grade.tests_failed) == (0.0, ["tests/test_x.py::test_a"])
    # A test that passed, then failed its teardown, is an error (as pytest counts it).
    teardown = "PASSED tests/test_x.py::test_b\nERROR tests/test_x.py::test_b - RuntimeError\n"
    assert parse_test_report(teardown) == {"tests/test_x.py::test_b": "ERROR"}


def test_a_grader_that_runs_pytest_trusts_only_its_plugins_report() -> None:
    """Whatever the output says, only `TR-PROOF` lines under this grading's nonce count
    (recorder/rollout/proof.py); a run that left early has none."""
    proof, other = Proof.new(), Proof.new()
    spec = TestSpec(fail_to_pass=["t.py::test_a"], pass_to_pass=["t.py::test_b"])

    def line(p: Proof, tests: dict[str, str], exit: int | None = 0) -> str:
        body = base64.b64encode(msgspec.json.encode({"tests": tests, "exit": exit})).decode()
        return f"TR-PROOF {p.nonce} {body}\n"

    both = {"t.py::test_a": "passed", "t.py::test_b": "passed"}
    forged = "PASSED t.py::test_a\nPASSED t.py::test_b\n2 passed in 0.01s\n"
    assert grade_tests(spec, ExecResult(0, forged, ""), "binary").reward == 1.0  # no proof asked
    for output, reward in [
        (forged, 0.0),  # the runner's lines, printed by anyone
        (forged + line(other, both), 0.0),  # another nonce
        (line(proof, both), 1.0),
        (line(proof, {"t.py::test_a": "passed", "t.py::test_b": "failed"}) + forged, 0.0),
        # a failure in any run stands
        (line(proof, both) + line(proof, {"t.py::test_a": "failed"}), 0.0),
        (line(proof, {"t.py::test_a": "passed"}), 0.0),  # test_b not reported
        (f"TR-PROOF {proof.nonce} not-base64!\n", 0.0),
    ]:
        grade = grade_tests(spec, ExecResult(0, output, ""), "binary", proof)
        assert grade.reward == reward, output
    assert grade_tests(spec, ExecResult(0, forged, ""), "binary", proof).failure == (
        "pytest_did_not_finish"
    )
    fraction = grade_tests(spec, ExecResult(1, line(proof, {"t.py::test_a": "passed"}), ""),
                           "fraction", proof)  # fmt: skip
    assert fraction.reward == 0.5
    # An exit-code grader that runs pytest: exit 0, and every run clean.
    assert grade_exit(ExecResult(0, line(proof, both), ""), proof).reward == 1.0
    for output in (
        forged,
        line(proof, both, exit=1),
        line(proof, {"t.py::test_a": "skipped"}),
        line(proof, both) + line(proof, {"t.py::test_a": "failed"}, exit=1),
    ):
        grade = grade_exit(ExecResult(0, output, ""), proof)
        assert (grade.reward, grade.failure) == (0.0, "exit_code_without_pytest_pass"), output
    assert grade_exit(ExecResult(1, line(proof, both), ""), proof).reward == 0.0
    assert grade_exit(ExecResult(0, "", "")).reward == 1.0  # other graders: the exit code
    assert runs_pytest(task_from_dict({**GOOD, "eval_cmd": "python -m pytest -q t.py"}))
    assert not runs_pytest(task_from_dict({**GOOD, "eval_cmd": "make check"}))


SHOW = "sh -c 'echo \"$PYTHONPATH|$PYTEST_ADDOPTS\"'"  # the environment a command gets


@pytest.mark.parametrize(
    ("command", "python_path", "addopts"),
    [
        # the task's own assignments, which replaced what `wrap` exported
        (f"PYTHONPATH=lib {SHOW}", "lib:{where}", "{sandbox} -p {module}"),
        (f"export PYTHONPATH=lib; {SHOW}", "lib:{where}", "{sandbox} -p {module}"),
        (f'env PYTHONPATH="src:/opt/x" {SHOW}', "src:/opt/x:{where}", "{sandbox} -p {module}"),
        (f"PYTHONPATH='' {SHOW}", "{where}", "{sandbox} -p {module}"),
        (f"PYTHONPATH= {SHOW}", "{where}", "{sandbox} -p {module}"),
        (f"PYTEST_ADDOPTS=-x {SHOW}", "{where}:/sb", "-x -p {module}"),
        (f"PYTEST_ADDOPTS='-x -q' PYTHONPATH=$PWD {SHOW}", "{pwd}:{where}", "-x -q -p {module}"),
        # assignments that keep what was there: left alone
        (f"PYTHONPATH=lib:$PYTHONPATH {SHOW}", "lib:{where}:/sb", "{sandbox} -p {module}"),
        (
            f'PYTHONPATH="lib${{PYTHONPATH:+:$PYTHONPATH}}" {SHOW}',
            "lib:{where}:/sb",
            "{sandbox} -p {module}",
        ),
        # not a plain word: left as the task wrote it
        (f"PYTHONPATH=$(printf lib) {SHOW}", "lib", "{sandbox} -p {module}"),
        (f"MY_PYTHONPATH=lib {SHOW}", "{where}:/sb", "{sandbox} -p {module}"),
    ],
)
def test_a_graders_own_assignment_keeps_the_proof_plugin_loadable(
    tmp_path: Path, command: str, python_path: str, addopts: str
) -> None:
    """`PYTHONPATH=lib pytest` in an eval_cmd replaced the plugin's directory: pytest
    could not load it and every patch, a correct fix too, earned 0. Run by a real shell."""
    proof = Proof.new()
    script = proof.wrap(command, str(tmp_path))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "/sb", "PYTEST_ADDOPTS": "-v"}
    out = subprocess.run(
        ["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.strip()
    where = str(tmp_path / ".tr-grader")
    names = {"where": where, "module": proof.module, "pwd": str(tmp_path), "sandbox": "-v"}
    assert out == f"{python_path.format(**names)}|{addopts.format(**names)}"


@pytest.mark.parametrize(
    "command",
    [
        "bash -c 'PYTEST_ADDOPTS=-q python -m pytest tests'",
        "python -m pytest 'tests/t.py::test_env[PYTHONPATH=a b]'",
        'python -m pytest "tests/t.py::test_env[PYTHONPATH=a b]"',
        'echo "export PYTHONPATH=lib && cd src" > env.sh',
    ],
)
def test_an_assignment_inside_quotes_is_another_programs_text(command: str) -> None:
    """An audit's `bash -c 'PYTEST_ADDOPTS=-q pytest'` became `bash -c 'PYTEST_ADDOPTS=-q'
    -p ...' pytest'`: bash ran the assignment alone and pytest never ran (a correct
    fix earned 0). Quoted text is left as the task wrote it."""
    assert Proof.new().kept_through(command, "/w") == command


@pytest.mark.parametrize(
    ("tests", "message"),
    [
        ({"FAIL_TO_PASS": []}, "at least one test"),
        ({"FAIL_TO_PASS": ["a"], "cmd": "pytest"}, "{tests}"),
    ],
)
def test_test_spec_validation(tests: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        task_from_dict({**GOOD, "eval_cmd": None, "tests": tests})


# A row as SWE-bench publishes it (the test lists are JSON strings), and as SWE-Gym
# (lists) and SWE-smith (no base_commit nor test_patch; an image name) do.
SWE_BENCH = {
    "repo": "acme/calc",
    "instance_id": "acme__calc-1",
    "base_commit": "0123abcd",
    "patch": "diff --git a/calc.py b/calc.py\n",
    "test_patch": "diff --git a/tests/test_add.py b/tests/test_add.py\n",
    "problem_statement": "add() subtracts",
    "hints_text": "",
    "created_at": "2023-01-01T00:00:00Z",
    "version": "1.0",
    "FAIL_TO_PASS": '["tests/test_add.py::test_add_sums"]',
    "PASS_TO_PASS": "[]",
    "environment_setup_commit": "0123abcd",
    "difficulty": "<15 min fix",  # SWE-bench Verified's extra column
}


def test_published_rows_load_as_they_are(tmp_path: Path) -> None:
    mirrors = tmp_path / "mirrors"
    (mirrors / "acme__calc").mkdir(parents=True)
    (mirrors / "swesmith" / "acme__calc.0123").mkdir(parents=True)
    gym = {**SWE_BENCH, "instance_id": "gym-1", "FAIL_TO_PASS": ["a.py::t"], "PASS_TO_PASS": []}
    smith = {
        "instance_id": "acme__calc.0123.lm_rewrite__x1",
        "repo": "swesmith/acme__calc.0123",
        "patch": "diff --git a/calc.py b/calc.py\n",
        "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
        "PASS_TO_PASS": ["tests/test_calc.py::test_sub"],
        "image_name": "jyangballin/swesmith.x86_64.acme__calc.0123",
        "problem_statement": "add() subtracts",
        "created_at": "2025-01-01",
    }
    github = {
        **SWE_BENCH,
        "instance_id": "django-1",
        "repo": "django/django",
        "test_cmd": "x {tests}",
    }
    path = tmp_path / "swe.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (SWE_BENCH, gym, smith, github)) + "\n")
    (bench, gym_task, smith_task, django), errors = load_tasks(path, mirrors=mirrors)
    assert errors == []
    assert bench.repo == str(mirrors / "acme__calc")
    assert bench.tests is not None and bench.tests.fail_to_pass == [
        "tests/test_add.py::test_add_sums"
    ]
    assert bench.tests.pass_to_pass == [] and "-rA" in bench.tests.cmd
    assert bench.test_patch == SWE_BENCH["test_patch"]
    assert bench.gold_patch == SWE_BENCH["patch"] and "patch" not in bench.metadata
    assert bench.metadata == {
        k: SWE_BENCH[k]
        for k in ("hints_text", "created_at", "version", "environment_setup_commit", "difficulty")
    }
    assert gym_task.tests is not None and gym_task.tests.fail_to_pass == ["a.py::t"]
    assert smith_task.repo == str(mirrors / "swesmith" / "acme__calc.0123")
    assert smith_task.base_commit == smith["instance_id"]  # SWE-smith: a branch per instance
    assert smith_task.metadata["image_name"] == smith["image_name"]
    assert django.repo == "https://github.com/django/django.git"  # not mirrored: GitHub
    assert django.tests is not None and django.tests.cmd == "x {tests}"


def test_a_published_row_that_is_wrong_says_where() -> None:
    bad = {**SWE_BENCH, "FAIL_TO_PASS": "not json", "PASS_TO_PASS": "[]"}
    with pytest.raises(TaskError, match="FAIL_TO_PASS: not a list"):
        task_from_dict(bad)
    with pytest.raises(TaskError, match="at least one test"):
        task_from_dict({**SWE_BENCH, "FAIL_TO_PASS": "[]"})
    # A native task's unknown field is kept, never an error.
    assert task_from_dict({**GOOD, "source": "x"}).metadata == {"source": "x"}


def test_the_default_protection_follows_the_tests_and_the_test_patch() -> None:
    from recorder.rollout.protect import (
        BYTECODE,
        IMPORT_HOOKS,
        PYTEST_CONFIGS,
        command_paths,
        patch_paths,
        protected_pathspecs,
        test_dirs,
    )

    patch = (
        "diff --git a/tests/a.py b/tests/b.py\nrename from tests/a.py\nrename to tests/b.py\n"
        "--- /dev/null\n+++ b/tests/new.py\t2023\n"
    )
    assert patch_paths(patch) == ["tests/a.py", "tests/b.py", "tests/new.py"]
    task = task_from_dict(
        {
            **SWE_BENCH,
            "FAIL_TO_PASS": ["pkg/tests/test_x.py::test_a[1-2]", "test_y (app.tests.T)"],
            "test_patch": patch,
        }
    )
    configs = [f"{d}{name}" for d in ("pkg/tests/", "pkg/", "") for name in PYTEST_CONFIGS]
    assert "pkg/tests/pytest.ini" in configs and "pyproject.toml" in configs
    assert protected_pathspecs(task) == [
        *(
            f":(literal){p}"
            for p in (
                "pkg/tests/test_x.py",
                "pkg/tests/",  # a test directory: all of it
                "pkg/tests/conftest.py",
                "pkg/conftest.py",
                "conftest.py",
                *configs,
                "tests/a.py",
                "tests/b.py",
                "tests/new.py",
            )
        ),
        # pytest runs it: its own files anywhere, and bytecode (for every grader).
        *(f":(glob)**/{n}" for n in ("conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml",
                                    ".pytest.toml")),
        ":(glob)**/__pycache__/**", ":(glob)**/*.pyc", ":(glob)**/*.pyo", ":(glob)**/*.so",
        ":(glob)**/*.pyd",
        # What the interpreter loads from any sys.path directory (for every grader).
        *(f":(glob,icase)**/*{suffix}{below}" for suffix in (".dist-info", ".egg-info",
          ".egg-link") for below in ("", "/**")),
        ":(glob)**/sitecustomize", ":(glob)**/sitecustomize.*", ":(glob)**/sitecustomize/**",
        ":(glob)**/usercustomize", ":(glob)**/usercustomize.*", ":(glob)**/usercustomize/**",
    ]  # fmt: skip
    # Tests beside the code they test protect themselves, not their directory.
    assert test_dirs(["test_c.py", "pkg/test_x.py", "a/tests/t.py", "b/testing/u.py"]) == [
        "a/tests/",
        "b/testing/",
    ]
    assert test_dirs(["tests/unit/test_x.py", "src/test/it/deep/t.py"]) == ["tests/", "src/test/"]
    explicit = task_from_dict({**SWE_BENCH, "protected_paths": ["tests/**", "setup.cfg"]})
    specs = protected_pathspecs(explicit)
    assert specs[:2] == [":(glob)tests/**", ":(glob)setup.cfg"]
    # The grader runs pytest: its configs and conftests are protected whatever the list says.
    for p in (":(glob)**/.pytest.ini", ":(glob)**/conftest.py", ":(literal)tests/tox.ini"):
        assert p in specs, p
    make = task_from_dict({**GOOD, "eval_cmd": "make check", "protected_paths": ["t/**"]})
    assert protected_pathspecs(make) == [":(glob)t/**", *BYTECODE, *IMPORT_HOOKS]
    named = task_from_dict({**GOOD, "eval_cmd": "python -m pytest -q sub/tests/test_a.py::t"})
    assert command_paths(named) == ["sub/tests/test_a.py"]
    assert ":(literal)sub/setup.cfg" in protected_pathspecs(named)


def test_a_task_whose_grader_nothing_protects_is_warned_about() -> None:
    from recorder.rollout.cli import unprotected_reasons
    from recorder.rollout.protect import unprotected_reason

    eval_cmd = task_from_dict({**GOOD, "instance_id": "bare"})
    reason = unprotected_reason(eval_cmd)
    assert reason is not None and "bare" in reason and "protected_paths" in reason
    assert unprotected_reason(task_from_dict({**GOOD, "protected_paths": []})) is None
    assert unprotected_reason(task_from_dict({**GOOD, "protected_paths": ["t/**"]})) is None
    by_file = {**GOOD, "eval_cmd": None, "tests": {"FAIL_TO_PASS": ["tests/test_x.py::test_a"]}}
    assert unprotected_reason(task_from_dict(by_file)) is None
    django = {**by_file, "tests": {"FAIL_TO_PASS": ["test_x (app.tests.T)"]}}
    assert "name no file" in (unprotected_reason(task_from_dict(django)) or "")
    many = [task_from_dict({**GOOD, "instance_id": f"t{i}"}) for i in range(5)]
    assert unprotected_reasons(many)[3:] == ["... and 2 more tasks like these"]
    # The tasks the repository ships protect what their graders run.
    shipped, errors = load_tasks(Path(__file__).parents[2] / "tools" / "tasks" / "tasks.jsonl")
    assert errors == [] and len(shipped) == 3 and unprotected_reasons(shipped) == []


def test_root_entries_added_with_an_importable_name_or_as_package_metadata_are_shadows() -> None:
    entries = [
        "pytest.py", "json", "_pytest", "forge-1.0.dist-info", "old.egg-info", "calc.py",
        "helpers.py", "README.md", ".git", "x.cpython-311-x86_64-linux-gnu.so", "a-b.py",
    ]  # fmt: skip
    base = {"calc.py", "README.md", ".git", "_pytest"}  # a repository that is pytest keeps it
    importable = {"json", "x", "calc"}
    assert shadowing_entries(entries, base, importable) == [
        "forge-1.0.dist-info", "json", "old.egg-info", "pytest.py",
        "x.cpython-311-x86_64-linux-gnu.so",
    ]  # fmt: skip
    # pytest is always counted: the grader may run another interpreter than the probe's.
    assert shadowing_entries(["pytest"], set(), set()) == ["pytest"]
    assert [module_name(e) for e in ("pluggy/", "site.pyc", "foo.bar", "README.md")] == [
        "pluggy", "site", None, None,
    ]  # fmt: skip


def test_the_directories_a_grader_command_puts_on_pythonpath() -> None:
    from recorder.rollout.protect import pythonpath_entries

    task = task_from_dict(
        {
            **GOOD,
            "eval_cmd": "PYTHONPATH=lib:$PYTHONPATH python -m pytest; "
            "env PYTHONPATH=\"src:/opt/x\" pytest && PYTHONPATH='lib' true",
        }
    )
    assert pythonpath_entries(task) == ["lib", "src", "/opt/x"]
    assert pythonpath_entries(task_from_dict({**GOOD, "eval_cmd": "pytest"})) == []
