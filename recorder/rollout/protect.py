"""Which files the grader takes from `base_commit` rather than from the agent's patch.

A policy that may edit the tests it is graded by learns to edit them (`assert
True` earns the same reward as a fix). So before grading, the eval sandbox
restores these paths from `base_commit` (`workspace.restore_protected`), then
applies the task's `test_patch`:

- `protected_paths` given: exactly those git globs (`*` stays inside a
  directory, `**` crosses directories; `[]` protects nothing);
- otherwise the default: every file a `tests` id names (`path::name`, or a bare
  `*.py` path), the `conftest.py` of its directory and of each parent (pytest
  loads them all: a new one can make every test pass), and every file
  `test_patch` touches (what SWE-bench's harness resets before applying it).

Test ids that name no file (Django's `test_x (app.tests.T)`) protect nothing
by themselves: give `protected_paths` or a `test_patch` for such tasks.
Pure functions, no I/O; the results are git pathspecs.
"""

from __future__ import annotations

import posixpath
import re

from recorder.rollout.tasks import Task, TestSpec

_PATCH_PATH = re.compile(r"^(?:--- a/|\+\+\+ b/|rename from |rename to |copy from |copy to )(.+)$")


def patch_paths(patch: str) -> list[str]:
    """The paths a unified git diff reads or writes, in order, without duplicates."""
    found: dict[str, None] = {}
    for line in patch.splitlines():
        m = _PATCH_PATH.match(line)
        if m:
            found[m.group(1).split("\t")[0].rstrip()] = None
    return list(found)


def test_files(spec: TestSpec) -> list[str]:
    """The files the test ids name (`tests/test_x.py::test_a[1]` -> `tests/test_x.py`)."""
    found: dict[str, None] = {}
    for test_id in spec.all:
        path = test_id.split("::", 1)[0]
        if path and not re.search(r"\s", path) and ("::" in test_id or path.endswith(".py")):
            found[posixpath.normpath(path)] = None
    return list(found)


def conftests(files: list[str]) -> list[str]:
    """Each `conftest.py` pytest would load for these files (their directories and parents)."""
    found: dict[str, None] = {}
    for f in files:
        d = posixpath.dirname(f)
        while True:
            found[posixpath.join(d, "conftest.py") if d else "conftest.py"] = None
            if not d:
                break
            d = posixpath.dirname(d)
    return list(found)


def protected_pathspecs(task: Task) -> list[str]:
    """The git pathspecs of the protected files of `task` (see the module docstring)."""
    if task.protected_paths is not None:
        return [f":(glob){p}" for p in task.protected_paths]
    files = test_files(task.tests) if task.tests is not None else []
    paths = [*files, *conftests(files), *patch_paths(task.test_patch or "")]
    return [f":(literal){p}" for p in dict.fromkeys(paths)]
