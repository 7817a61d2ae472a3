"""Which files the grader takes from the task (base_commit and its setup), not the patch.

A policy that may edit the tests it is graded by learns to edit them (`assert
True` earns the same reward as a fix). So before grading, the eval sandbox
restores these paths as its setup left them (`eval_tree.restore_protected`), then
applies the task's `test_patch`:

- `protected_paths` given: those git globs (`*` stays inside a directory,
  `**` crosses directories), plus, when the grader runs pytest, what pytest
  reads (`pytest_reads`: its own files in every directory, the shared config
  files at the root and above the tests; an audit planted `.pytest.ini` past a
  list that named `pytest.ini`), and for every grader bytecode (`BYTECODE`)
  and what the interpreter loads from any sys.path directory (`IMPORT_HOOKS`:
  package metadata, `sitecustomize`, `usercustomize`);
- otherwise the default: every file a `tests` id names (`path::name`, or a bare
  `*.py` path), and all of its directory when that is a test directory
  (`tests/`, `test/`, `testing/`: pytest puts such a directory first on
  `sys.path`, so a `tests/calc.py` of the patch's would be what `from calc
  import add` finds, the real module left unfixed); the `conftest.py` of its
  directory and of each parent (pytest loads them all: a new one can make
  every test pass), pytest's config files there (`pytest.ini`,
  `pyproject.toml`, `tox.ini`, `setup.cfg`, ...: the nearest one's `addopts =
  -p <module>` loads a plugin from the patch that can pass every test), and
  every file `test_patch` touches (what SWE-bench's harness resets before
  applying it).

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


# The files pytest takes its configuration from, in the directory of the tests it
# runs or the nearest parent that has one (`_pytest.config.findpaths`, pytest 9).
PYTEST_CONFIGS = (
    "pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini",
    "setup.cfg",
)  # fmt: skip


def in_parents(files: list[str], names: tuple[str, ...]) -> list[str]:
    """Each file called one of `names` in these files' directories and their parents."""
    found: dict[str, None] = {}
    for f in files:
        d = posixpath.dirname(f)
        while True:
            for name in names:
                found[posixpath.join(d, name) if d else name] = None
            if not d:
                break
            d = posixpath.dirname(d)
    return list(found)


# Directories that hold tests and nothing a fix changes (their whole tree is protected).
TEST_DIRS = ("tests", "test", "testing")


def test_dirs(files: list[str]) -> list[str]:
    """The test directory (`TEST_DIRS`) each test file is in, however deep (`tests/` for
    `tests/unit/test_x.py`: its `unit/` goes on `sys.path` as well), as `dir/`."""
    found: dict[str, None] = {}
    for f in files:
        d = posixpath.dirname(f)
        while d and posixpath.basename(d) not in TEST_DIRS:
            d = posixpath.dirname(d)
        if d:
            found[d + "/"] = None
    return list(found)


def conftests(files: list[str]) -> list[str]:
    """Each `conftest.py` pytest would load for these files (their directories and parents)."""
    return in_parents(files, ("conftest.py",))


def runs_pytest(task: Task) -> bool:
    """Whether the task's grader runs pytest: its command names it."""
    command = task.tests.cmd if task.tests is not None else task.eval_cmd or task.eval_script
    return re.search(r"\bpytest\b", command or "") is not None


# Files only pytest reads: protected in every directory for a grader that runs pytest
# (a `conftest.py` or an `addopts = -p <module>` beside the tests passes every test).
PYTEST_ONLY = ("conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml")
# Config files a fix may have reasons to edit: protected where pytest looks for them.
PYTEST_SHARED = ("pyproject.toml", "tox.ini", "setup.cfg")
# Compiled Python: a `__pycache__/calc.cpython-311.pyc` of the patch's (unchecked-hash,
# PEP 552) was loaded instead of the buggy `calc.py` it left alone; so was a
# `calc.cpython-311-x86_64-linux-gnu.so` (Python tries extension suffixes before
# `.py` in each directory; a sixth audit, 1.0 on the shipped task). No fix needs one.
BYTECODE = (
    ":(glob)**/__pycache__/**", ":(glob)**/*.pyc", ":(glob)**/*.pyo", ":(glob)**/*.so",
    ":(glob)**/*.pyd",
)  # fmt: skip


# What the interpreter loads before any test from whatever directory is on sys.path
# (the root, `src/`, a `PYTHONPATH` directory, one a setup's `.pth` names): package
# metadata, whose `[pytest11]` entry point is a plugin (matched case-blind, its name
# UTF-8 or not), and the start-up hooks `site` imports. Audits loaded a plugin that
# passed every test through `forge\377.dist-info` at the root, a `.dist-info` in a
# `PYTHONPATH` directory, one added into an `.egg-info` the repository tracks, and a
# `usercustomize.py` at a root a setup's `.pth` names. No fix needs one.
IMPORT_HOOKS = tuple(
    f":(glob,icase)**/*{suffix}{below}" for suffix in (".dist-info", ".egg-info", ".egg-link")
    for below in ("", "/**")
) + tuple(
    f":(glob)**/{hook}{below}" for hook in ("sitecustomize", "usercustomize")
    for below in ("", ".*", "/**")  # a link to a package elsewhere is a bare name
)  # fmt: skip


def pytest_reads(task: Task) -> list[str]:
    """The pathspecs of what pytest takes its configuration and plugins from for this
    task's grader, protected whatever `protected_paths` says; none for other graders."""
    if not runs_pytest(task):
        return []
    files = test_files(task.tests) if task.tests is not None else command_paths(task)
    shared = [*in_parents(files, PYTEST_SHARED), *PYTEST_SHARED]
    return [
        *(f":(glob)**/{name}" for name in PYTEST_ONLY),
        *(f":(literal){p}" for p in dict.fromkeys(shared)),
    ]


_PATHLIKE = re.compile(r"^[\w.][\w./:\[\]-]*$")


def command_paths(task: Task) -> list[str]:
    """The relative paths an `eval_cmd` or `eval_script` names (`tests/test_x.py::t`,
    `tests/`, `tests`), as files whose directories pytest would search."""
    found: dict[str, None] = {}
    for word in re.split(r"[\s;|&()<>'\"]+", f"{task.eval_cmd or ''} {task.eval_script or ''}"):
        path = word.split("::", 1)[0]
        if not _PATHLIKE.match(path) or path.startswith(".."):
            continue
        if "/" in path or path.endswith(".py"):
            found[posixpath.normpath(path) if not path.endswith("/") else path] = None
        elif path in TEST_DIRS:
            found[path + "/"] = None
    return list(found)


def protected_pathspecs(task: Task) -> list[str]:
    """The git pathspecs of the protected files of `task` (see the module docstring)."""
    return list(
        dict.fromkeys([*_task_pathspecs(task), *pytest_reads(task), *BYTECODE, *IMPORT_HOOKS])
    )


def _task_pathspecs(task: Task) -> list[str]:
    """What the task's own protection covers: its list, or the default from its tests."""
    if task.protected_paths is not None:
        return [f":(glob){p}" for p in task.protected_paths]
    files = test_files(task.tests) if task.tests is not None else []
    paths = [
        *files,
        *test_dirs(files),
        *conftests(files),
        *in_parents(files, PYTEST_CONFIGS),
        *patch_paths(task.test_patch or ""),
    ]
    return [f":(literal){p}" for p in dict.fromkeys(paths)]


def unprotected_reason(task: Task) -> str | None:
    """Why nothing the grader of `task` runs is protected by default, or None.

    The default follows the files `tests` ids name and `test_patch`; an
    `eval_cmd` or `eval_script` task, or ids that name no file, leave it empty,
    and the agent can then rewrite the tests it is graded by.
    """
    if task.protected_paths is not None or _task_pathspecs(task):
        return None
    grader = "its tests' ids name no file" if task.tests is not None else "it has no `tests`"
    return (
        f"task {task.instance_id}: nothing the grader runs is protected ({grader}, and no "
        "test_patch), so the agent can rewrite the tests that grade it; give it "
        'protected_paths (e.g. ["tests/**"]), or protected_paths: [] to say that is intended'
    )


# -- what the patch adds at the repository's root -----------------------------------------
#
# `python -m pytest` (and `python -c`) run from the repository put its root first on
# sys.path, before the interpreter's own site-packages. So a patch that adds `pytest.py` or
# `pytest/` there replaces the test runner itself, and a `*.dist-info` there registers
# entry points: a `pytest11` one is a plugin pytest loads before any test, which can pass
# them all. None of that is a fix: such additions are removed before grading, as protected
# paths are restored. A root entry the repository has at base_commit or after its setup is
# its own and stays (a repository may be the very package that is also installed; a
# `pip install -e .` in setup writes its `.egg-info` there).

# Package metadata whose entry points the import system reads from any sys.path entry.
PACKAGE_METADATA = (".dist-info", ".egg-info", ".egg-link")
# Counted as importable whatever the probe in the eval sandbox finds (a grader may run
# another interpreter, e.g. a virtualenv's, than the one on PATH).
RUNNER_MODULES = frozenset(
    {"pytest", "_pytest", "pluggy", "iniconfig", "py", "packaging", "unittest", "nose", "nose2"}
)
_MODULE_FILE = re.compile(
    r"^([A-Za-z_][A-Za-z0-9_]*)(?:\.py[cw]?|\.[A-Za-z0-9_-]*\.so|\.so|\.pyd)?$"
)


def module_name(entry: str) -> str | None:
    """The top-level module a root entry imports as (`pytest.py`, `pytest`, `x.cpython-311-
    x86_64-linux-gnu.so`), or None for a name that cannot be imported."""
    m = _MODULE_FILE.match(entry.rstrip("/"))
    return m.group(1) if m else None


_PYTHONPATH = re.compile(r"\bPYTHONPATH=(\"[^\"]*\"|'[^']*'|[^\s;&|)]*)")


def pythonpath_entries(task: Task) -> list[str]:
    """The directories the grader's command puts on `PYTHONPATH` (`PYTHONPATH=lib:$X
    pytest`), relative to the repository or absolute; variables left out."""
    command = task.tests.cmd if task.tests is not None else ""
    text = f"{command}\n{task.eval_cmd or ''}\n{task.eval_script or ''}"
    found: dict[str, None] = {}
    for m in _PYTHONPATH.finditer(text):
        for entry in m.group(1).strip("\"'").split(":"):
            if entry and "$" not in entry:
                found[entry] = None
    return list(found)


def shadowing_entries(
    root_entries: list[str], base_entries: set[str], importable: set[str]
) -> list[str]:
    """The root entries (names, not paths) the patch added that shadow the grader's imports:
    package metadata, or a module named like one the grader's interpreter imports or tries
    to (`importable`: what it can import, and what pytest's start-up asks for in vain,
    such as the stdlib's optional `org.python.core`)."""
    modules = importable | RUNNER_MODULES
    found = []
    for entry in root_entries:
        if entry in base_entries:
            continue
        name = module_name(entry)
        # The import system matches metadata directories case-blind (`FORGE.DIST-INFO`).
        if entry.lower().endswith(PACKAGE_METADATA) or (name is not None and name in modules):
            found.append(entry)
    return sorted(found)
