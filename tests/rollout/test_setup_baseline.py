"""What the task's setup writes is the task's, and what the agent breaks is the agent's.

Through the real driver, git and local sandboxes (`add` subtracts; FIX repairs it):
- setup's output in the repository (a real setuptools `.egg-info`, a version file it
  stamps, an ignored extension module it builds) had gone into the agent's diff, which
  the eval sandbox (after the same setup) refused: every rollout of such a task, a
  correct fix included, closed as an infrastructure failure. The built extension was
  also removed before grading as bytecode, so its tests failed;
- an agent that broke its own repository (`rm -rf .git`, a rewritten object store)
  turned its reward 0 into an infrastructure abort, which is masked from training.
"""

# ruff: noqa: F811  (recorder, the fixture, is imported by name)
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sandbox_backends import Backend
from task_repos import BUGGY, EXT_SUFFIX, PASS_TO_PASS, base_repo, extension_b64, git
from test_reward_integrity import (  # noqa: F401  (recorder is a fixture)
    FIX,
    GRADERS,
    PLUGIN,
    calc_task,
    graded_by,
    local,
    recorder,
    rollout,
)

from recorder.rollout.driver import RolloutResult
from tests.server.conftest import Harness

if TYPE_CHECKING:
    from e2b_doubles import E2BDoubles

SETUP_PY = (
    'from setuptools import setup\n\nsetup(name="calc", version="0.1", py_modules=["calc"])\n'
)
NATIVE_C = r"""
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef M[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef D = {PyModuleDef_HEAD_INIT, "native", NULL, -1, M};
PyMODINIT_FUNC PyInit_native(void) { return PyModule_Create(&D); }
"""
NATIVE_TEST = "import native\n\n\ndef test_native():\n    assert native.answer() == 42\n"


def calc_repo(src: Path, files: dict[str, str]) -> str:
    """The calc repository with `files` added in a second commit; its hash."""
    base_repo(src)
    for name, text in files.items():
        (src / name).write_text(text)
    git(src, "add", "-A")
    git(src, "commit", "-q", "--allow-empty", "-m", "setup files")
    return git(src, "rev-parse", "HEAD")


async def run(
    recorder: Harness, tmp_path: Path, agent: str, files: dict[str, str], **task: Any
) -> RolloutResult:
    src = tmp_path / "src"
    return await rollout(
        recorder, local(tmp_path), calc_task(str(src), calc_repo(src, files), **task), agent
    )


def diffed(result: RolloutResult) -> list[str]:
    return [line[6:] for line in result.diff.splitlines() if line.startswith("+++ b/")]


@pytest.mark.parametrize("grader", GRADERS)
async def test_an_egg_info_setup_writes_is_not_the_agents(
    recorder: Harness, tmp_path: Path, grader: str
) -> None:
    """`setup.py egg_info` (what `pip install -e .` runs) writes `calc.egg-info/` at the
    root: not in the diff, and kept for the grader (package metadata the patch adds
    there is removed as a shadow; setup's is the task's)."""
    task = graded_by(grader)
    if "eval_cmd" in task:
        task["eval_cmd"] = f"test -f calc.egg-info/PKG-INFO && {task['eval_cmd']}"
    result = await run(
        recorder,
        tmp_path,
        FIX,
        {"setup.py": SETUP_PY},
        setup=["python setup.py -q egg_info"],
        **task,
    )
    assert (result.outcome, result.reward, result.infra_cause) == ("passed", 1.0, None), (
        result.evidence
    )
    assert diffed(result) == ["calc.py"]


async def test_a_file_setup_stamps_is_not_the_agents(recorder: Harness, tmp_path: Path) -> None:
    """Setup rewrites a tracked file (a version stamp): the agent's diff leaves it out, and
    the eval's own setup stamps it again."""
    result = await run(
        recorder,
        tmp_path,
        FIX,
        {"VERSION": "0.0.0\n"},
        setup=["echo 1.2.3 > VERSION", "mkdir -p build && echo generated > build/notes.txt"],
    )
    assert (result.outcome, result.reward, result.infra_cause) == ("passed", 1.0, None), (
        result.evidence
    )
    assert diffed(result) == ["calc.py"]


async def test_a_fix_to_a_file_setup_also_changed_is_kept(
    recorder: Harness, tmp_path: Path
) -> None:
    """Setup edits the very module the fix is in (a compatibility patch, say): the fix is
    the agent's change on top of setup's, and goes into the diff; only what setup
    created (untracked) is left out."""
    result = await run(
        recorder, tmp_path, FIX, {}, setup=["printf '\\n# patched by setup\\n' >> calc.py"]
    )
    assert (result.outcome, result.reward, result.infra_cause) == ("passed", 1.0, None), (
        result.evidence
    )
    assert diffed(result) == ["calc.py"] and "patched by setup" not in result.diff


async def test_an_extension_module_setup_builds_stays_for_the_grader(
    recorder: Harness, tmp_path: Path
) -> None:
    """Setup puts an ignored `native*.so` the tests import in place (here unpacked from
    the repository: the sandbox's user cannot read this interpreter's headers to build
    it): it is the task's, not a fix the patch shipped as bytecode, so it stays."""
    files = {
        "native.b64": extension_b64(NATIVE_C, tmp_path),
        ".gitignore": "*.so\n",
        "tests/test_native.py": NATIVE_TEST,
    }
    unpack = f"base64 -d native.b64 > native{EXT_SUFFIX}"
    passing = [*PASS_TO_PASS, "tests/test_native.py::test_native"]
    result = await run(
        recorder,
        tmp_path,
        FIX,
        files,
        setup=[unpack],
        tests={"FAIL_TO_PASS": ["tests/test_calc.py::test_add"], "PASS_TO_PASS": passing},
    )
    assert (result.outcome, result.reward, result.infra_cause) == ("passed", 1.0, None), (
        result.evidence
    )


async def test_removing_the_repositorys_git_is_a_policy_failure(
    recorder: Harness, tmp_path: Path
) -> None:
    """`rm -rf .git` left nothing to diff: the rollout had closed as a lost sandbox (an
    infrastructure abort, masked), so a policy could escape its 0 that way."""
    result = await run(recorder, tmp_path, f"{FIX} && rm -rf .git", {})
    assert (result.outcome, result.reward, result.infra_cause) == ("failed", 0.0, None)
    assert result.evidence["failure"] == "repository_broken"


# Unpack the object store and rewrite the blob of calc.py at base_commit: the diff of the
# fixed calc.py is then taken against text that is not base_commit's, and does not apply.
TAMPER = (
    "blob=$(git rev-parse HEAD:calc.py) && mv .git/objects/pack/pack-*.pack ../p.pack && "
    "rm -f .git/objects/pack/pack-* && git unpack-objects -q < ../p.pack && rm ../p.pack && "
    'obj=.git/objects/$(echo $blob | cut -c1-2)/$(echo $blob | cut -c3-) && rm -f "$obj" && '
    "python3 -c 'import sys, zlib; sys.stdout.buffer.write(zlib.compress(b\"blob 8\\0garbage\\n\"))'"
    ' > "$obj"'
)


async def test_a_diff_the_agent_made_unappliable_is_a_policy_failure(
    recorder: Harness, tmp_path: Path
) -> None:
    """The agent rewrote its object store: its diff does not apply where it is graded,
    which had closed the rollout as an infrastructure failure (masked). The eval's setup
    made the very tree the diff was taken against, so the refusal is the agent's."""
    result = await run(recorder, tmp_path, f"{FIX} && {TAMPER}", {})
    assert "-garbage" in result.diff  # the attack took effect
    assert (result.outcome, result.reward, result.infra_cause) == ("failed", 0.0, None)
    assert result.evidence["failure"] == "patch_apply"


# An eighth audit, through the real driver: what setup made must stay setup's ...
ENTRY_POINT = f"{PLUGIN} && printf '[pytest11]\\nforge = forge\\n' > calc.egg-info/entry_points.txt"


@pytest.mark.parametrize("ignore", ["", "*.egg-info/\n"], ids=["tracked", "ignored"])
async def test_a_plugin_entry_point_written_into_setups_egg_info_earns_nothing(
    recorder: Harness, tmp_path: Path, ignore: str
) -> None:
    """Setup's `.egg-info` was kept as the repository's own, so an entry point the agent
    wrote there loaded its plugin into the grader's pytest (1.0, calc.py unfixed)."""
    force = " && git add -f calc.egg-info/entry_points.txt" if ignore else ""
    files = {"setup.py": SETUP_PY, **({".gitignore": ignore} if ignore else {})}
    result = await run(
        recorder, tmp_path, ENTRY_POINT + force, files, setup=["python setup.py -q egg_info"]
    )
    assert (result.outcome, result.reward, result.infra_cause) == ("failed", 0.0, None), (
        result.evidence
    )
    assert "entry_points" not in result.diff


# The same entry point, in a diff the agent made itself (`git diff` leaves out what setup
# made), swapped for the driver's diff file by a process left behind without the
# sandbox's marks, while the driver's `git diff` deflates a 50 MB new binary file (~1 s).
FORGE = (
    f"{ENTRY_POINT} && git add -f forge.py calc.egg-info/entry_points.txt && "
    "git diff --cached --binary HEAD -- forge.py calc.egg-info/entry_points.txt > ../forged && "
    "git rm -q --cached forge.py calc.egg-info/entry_points.txt && "
    "rm forge.py calc.egg-info/entry_points.txt && "
    "head -c 50000000 /dev/urandom > big.bin && "
    "(env -i /usr/bin/setsid /bin/sh -c ': > ../lurking; "
    "while [ ! -e ../agent.diff ]; do /bin/sleep 0.01; done; "
    "/bin/rm -f ../agent.diff; /bin/cp ../forged ../agent.diff' "
    "</dev/null >/dev/null 2>&1 &) && "
    # out of the command's process group before the command ends (and its group is killed)
    "while [ ! -e ../lurking ]; do sleep 0.01; done"
)


async def test_a_diff_swapped_by_a_process_left_behind_earns_nothing(
    recorder: Harness, tmp_path: Path, e2b_doubles: E2BDoubles
) -> None:
    """On E2B a process the agent left behind lives on (the driver ends only the commands
    it started), and the agent's VM is its own (with sudo, its `git` too): the diff read
    from it is the agent's word. A diff swapped there for one that writes an entry point
    into setup's `.egg-info` earned 1.0 with calc.py unfixed. A diff the driver takes
    never holds what setup made, so one that does is refused before it is applied."""
    src = tmp_path / "src"
    task = calc_task(
        str(src), calc_repo(src, {"setup.py": SETUP_PY}), setup=["python setup.py -q egg_info"]
    )
    result = await rollout(recorder, Backend("e2b", tmp_path, e2b_doubles), task, FORGE)
    assert "entry_points" in result.diff and "big.bin" not in result.diff  # swapped
    assert (result.outcome, result.reward, result.infra_cause) == ("failed", 0.0, None), (
        result.evidence
    )
    assert result.evidence["failure"] == "diff_forged"
    assert "calc.egg-info/entry_points.txt" in result.evidence["output_tail"]


NOFIX = "echo '# looked, changed nothing' >> calc.py"


@pytest.mark.parametrize(
    "agent",
    [
        "echo x > junk.txt && chmod 000 junk.txt",
        "touch .git/index.lock",
        "echo junk > .git/index",
        "git config filter.x.clean false && git config filter.x.required true && "
        "echo '* filter=x' > .gitattributes",
        "mkdir sub && git init -q sub",
        "mkdir ../agent.diff",
        "mkdir -p tests/zz && cd tests/zz && seq -f 'file_number_%06g.txt' 7000 | xargs touch",
        "echo x >> stamp.txt",
    ],
    ids=["unreadable", "index-lock", "index", "filter", "nested-repo", "diff-dir", "7000-files",
         "setup-stamp"],
)  # fmt: skip
async def test_what_the_agent_does_to_its_repository_is_never_an_abort(
    recorder: Harness, tmp_path: Path, agent: str
) -> None:
    """Each had closed a failing rollout as an infrastructure failure (masked): the diff
    failed (`sandbox_gone`), the restore's command line was too long (`driver_error`),
    or setup's own output in the diff did not apply (`patch_apply`)."""
    result = await run(
        recorder, tmp_path, f"{NOFIX} && {agent}", {}, setup=["date +%s%N > stamp.txt"]
    )
    assert (result.outcome, result.reward, result.infra_cause) == ("failed", 0.0, None), (
        result.evidence
    )


@pytest.mark.parametrize(
    ("files", "setup"),
    [
        ({}, ["python -m compileall -q ."]),
        ({".gitignore": "__pycache__/\n"}, ["python -m compileall -q ."]),
        ({".gitattributes": "*.py text eol=crlf\n"}, []),
        ({".gitattributes": "calc.py ident\n", "calc.py": "# $Id$\n" + BUGGY}, []),
    ],
    ids=["compileall", "compileall-ignored", "crlf", "ident"],
)
async def test_a_correct_fix_earns_its_reward_whatever_setup_and_attributes_do(
    recorder: Harness, tmp_path: Path, files: dict[str, str], setup: list[str]
) -> None:
    """Setup's bytecode of the buggy module (same size and second as the fix) ran instead
    of the fix; a diff of a CRLF or `ident` file did not apply where it was graded."""
    result = await run(recorder, tmp_path, FIX, files, setup=setup)
    assert (result.outcome, result.reward, result.infra_cause) == ("passed", 1.0, None), (
        result.evidence
    )


# A third round over the fixes above.
MOVE_TO_PKG = (
    "printf 'def add(a, b):\\n    return a + b\\n' > pkg/impl.py && "
    "printf 'from pkg.impl import add\\n\\n\\ndef sub(a, b):\\n    return a - b\\n' > calc.py"
)
SOURCELESS = (
    "cp gen.txt gen.py && python -c \"import py_compile; py_compile.compile('gen.py', "
    "cfile='gen.pyc')\" && rm gen.py"
)
GEN_TEST = "import gen\n\n\ndef test_gen():\n    assert gen.ANSWER == 42\n"


@pytest.mark.parametrize(
    ("agent", "files", "setup", "tests"),
    [
        (FIX, {".gitignore": "calc.py\n"}, [], None),
        (MOVE_TO_PKG, {}, ["mkdir -p pkg"], None),
        (
            FIX,
            {"gen.txt": "ANSWER = 42\n", "tests/test_gen.py": GEN_TEST},
            [SOURCELESS],
            [*PASS_TO_PASS, "tests/test_gen.py::test_gen"],
        ),
        (
            f"{FIX} && n=$(printf 'garbage\\n' | git hash-object -w --stdin) && "
            "git replace -f $(git rev-parse HEAD:calc.py) $n",
            {},
            ["date +%s%N > stamp.txt"],
            None,
        ),
    ],
    ids=["tracked-and-ignored", "dir-setup-made-empty", "sourceless-module", "replace-ref"],
)
async def test_a_correct_fix_is_graded_as_a_fix(
    recorder: Harness,
    tmp_path: Path,
    agent: str,
    files: dict[str, str],
    setup: list[str],
    tests: list[str] | None,
) -> None:
    """A tracked file its `.gitignore` names dropped out of the setup tree (and the fix
    with it); an empty directory setup made swallowed the files the fix put there; a
    sourceless module setup compiled was removed as cache; a `git replace` ref made the
    diff of a fix unappliable."""
    spec = {"FAIL_TO_PASS": ["tests/test_calc.py::test_add"], "PASS_TO_PASS": tests}
    result = await run(
        recorder, tmp_path, agent, files, setup=setup, **({"tests": spec} if tests else {})
    )
    assert (result.outcome, result.reward, result.infra_cause) == ("passed", 1.0, None), (
        result.evidence
    )


async def test_an_unappliable_diff_under_a_run_to_run_setup_is_a_policy_failure(
    recorder: Harness, tmp_path: Path
) -> None:
    """Setup writes a timestamp, so the two sandboxes' setup trees differ; the rewritten
    object store still made the diff refuse to apply, and that had been masked as an
    infrastructure failure. The files the patch changes were the same in both."""
    result = await run(
        recorder, tmp_path, f"{FIX} && {TAMPER}", {}, setup=["date +%s%N > stamp.txt"]
    )
    assert "-garbage" in result.diff
    assert (result.outcome, result.reward, result.infra_cause) == ("failed", 0.0, None)
    assert result.evidence["failure"] == "patch_apply"
