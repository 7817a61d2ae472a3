"""What the eval lets a diff do (`diff.apply_patch`), on a real local sandbox and git: a
diff that changes what setup made is refused however its headers name the paths, and
the package metadata it adds anywhere is removed. The agent's sandbox is the agent's
(on E2B a process left behind, or its own `git`, can hand the driver any diff), so
these diffs are written by hand, as such an agent would."""

from __future__ import annotations

import os
import posixpath
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from recorder.rollout.diff import Baseline, ForgedDiff, apply_patch, snapshot, take_diff
from recorder.rollout.sandbox import Sandbox, SandboxSpec, open_sandbox

SETUP_PY = 'from setuptools import setup\\nsetup(name="calc", version="0.1", py_modules=["calc"])'
MAKE = (
    "git init -q repo && cd repo && printf 'def add(a, b):\\n    return a - b\\n' > calc.py && "
    f"printf '{SETUP_PY}\\n' > setup.py && git add -A && "
    "git -c user.name=t -c user.email=t@t commit -qm base && "
    "python3 setup.py -q egg_info 2>/dev/null && git rev-parse HEAD"
)


@pytest.fixture
async def sandbox(tmp_path: Path) -> AsyncIterator[tuple[Sandbox, str, Baseline]]:
    """A sandbox whose repository setup left `calc.egg-info/`, and its baseline."""
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path)})) as sb:
        made = await sb.exec(MAKE, timeout_s=120)
        assert made.exit_code == 0, made.stderr
        repo = posixpath.join(sb.workdir, "repo")
        base = await snapshot(sb, repo, made.stdout.split()[-1])
        assert "calc.egg-info/" in base.made
        yield sb, repo, base


def _new_file(path: str, text: str) -> str:
    lines = text.splitlines()
    body = "".join(f"+{line}\n" for line in lines)
    return (
        f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
        f"@@ -0,0 +1,{len(lines)} @@\n{body}"
    )


ENTRY = _new_file("calc.egg-info/entry_points.txt", "[pytest11]\nforge = forge")
# git's old rename header words, which a reader of `rename from` lines misses
RENAME_OLD = (
    "diff --git a/calc.egg-info/top_level.txt b/moved.txt\nsimilarity index 100%\n"
    "rename old calc.egg-info/top_level.txt\nrename new moved.txt\n"
)
# the header's two names differ and no rename line says so: applied as a move
MOVE = (
    "diff --git a/calc.egg-info/top_level.txt b/other.txt\n--- a/calc.egg-info/top_level.txt\n"
    "+++ b/other.txt\n@@ -1 +1 @@\n-calc\n+forged\n"
)
DELETE = (
    "diff --git a/calc.egg-info/top_level.txt b/calc.egg-info/top_level.txt\n"
    "deleted file mode 100644\n--- a/calc.egg-info/top_level.txt\n+++ /dev/null\n"
    "@@ -1 +0,0 @@\n-calc\n"
)
# one changed path among many long ones (a listing of them passed an output cap)
CROWD = "".join(_new_file(f"n{i:04d}_{'x' * 200}.txt", "x") for i in range(300))


@pytest.mark.skipif(os.geteuid() != 0, reason="a sandbox user of its own needs root")
@pytest.mark.parametrize(
    "patch",
    [ENTRY, RENAME_OLD, MOVE, DELETE, CROWD + ENTRY + CROWD.replace("n0", "m0")],
    ids=["entry-point", "rename-old", "move", "delete", "crowd"],
)
async def test_a_diff_that_changes_what_setup_made_is_refused(
    sandbox: tuple[Sandbox, str, Baseline], patch: str
) -> None:
    sb, repo, base = sandbox
    with pytest.raises(ForgedDiff, match=r"calc\.egg-info"):
        await apply_patch(sb, repo, patch.encode(), base)


@pytest.mark.skipif(os.geteuid() != 0, reason="a sandbox user of its own needs root")
async def test_a_diff_the_driver_took_applies_and_package_metadata_it_adds_is_removed(
    sandbox: tuple[Sandbox, str, Baseline], tmp_path: Path
) -> None:
    """The agent's own diff (fix, new module, metadata in a subdirectory and at the root
    under a name that is not UTF-8) applies on the same setup in another sandbox; the
    metadata is removed there and named, what setup made is untouched."""
    sb, repo, base = sandbox
    agent = (
        "sed -i 's/a - b/a + b/' calc.py && printf 'X = 1\\n' > extra.py && "
        "mkdir -p lib/forge.dist-info \"$(printf 'x\\377.DIST-INFO')\" && "
        "echo '[pytest11]' > lib/forge.dist-info/entry_points.txt && "
        "echo '[pytest11]' > \"$(printf 'x\\377.DIST-INFO')/entry_points.txt\" && "
        "echo changed >> calc.egg-info/PKG-INFO"  # setup's: not in the diff
    )
    assert (await sb.exec(agent, cwd=repo)).exit_code == 0
    await sb.end_processes()
    patch = await take_diff(sb, repo, base)
    assert b"PKG-INFO" not in patch
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path)})) as ev:
        made = await ev.exec(MAKE, timeout_s=120)
        eval_repo = posixpath.join(ev.workdir, "repo")
        await snapshot(ev, eval_repo, made.stdout.split()[-1])
        removed = await apply_patch(ev, eval_repo, patch, base)
        assert sorted(removed) == ["lib/forge.dist-info", "x\ufffd.DIST-INFO"]
        left = await ev.exec(
            "ls -A; cat calc.py; ls lib; cat calc.egg-info/PKG-INFO", cwd=eval_repo
        )
        assert "return a + b" in left.stdout and "extra.py" in left.stdout
        assert "DIST-INFO" not in left.stdout and "forge.dist-info" not in left.stdout
        assert "changed" not in left.stdout
