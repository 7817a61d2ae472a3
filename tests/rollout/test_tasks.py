"""Task files and grading: pure checks, no sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recorder.rollout.evaluate import grade_exit, grade_tests, parse_test_report
from recorder.rollout.sandbox import ExecResult
from recorder.rollout.tasks import TestSpec, load_tasks, task_from_dict

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
