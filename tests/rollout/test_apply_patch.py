"""What the eval lets a diff do (`diff.apply_patch`), on a real local sandbox and git: a
diff that changes what setup made is refused however its headers name the paths, and a
diff the driver took applies. The agent's sandbox is the agent's (on E2B a process left
behind, or its own `git`, can hand the driver any diff), so these diffs are written by
hand, as such an agent would."""

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


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a sandbox user of its own needs root")


@pytest.fixture
async def calc_sandbox(tmp_path: Path) -> AsyncIterator[tuple[Sandbox, str, Baseline]]:
    """A sandbox whose repository setup left `calc.egg-info/`, and its baseline."""
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path)})) as sb:
        repo, base = await _setup(sb)
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


@needs_root
@pytest.mark.parametrize(
    "patch",
    [ENTRY, RENAME_OLD, MOVE, DELETE, CROWD + ENTRY + CROWD.replace("n0", "m0")],
    ids=["entry-point", "rename-old", "move", "delete", "crowd"],
)
async def test_a_diff_that_changes_what_setup_made_is_refused(
    calc_sandbox: tuple[Sandbox, str, Baseline], patch: str
) -> None:
    sb, repo, base = calc_sandbox
    with pytest.raises(ForgedDiff, match=r"calc\.egg-info"):
        await apply_patch(sb, repo, patch.encode(), base)


async def _setup(sb: Sandbox, extra: str = "") -> tuple[str, Baseline]:
    made = await sb.exec(f"{MAKE} > ../head && {extra or ':'} && cat ../head", timeout_s=120)
    assert made.exit_code == 0, made.stderr
    repo = posixpath.join(sb.workdir, "repo")
    return repo, await snapshot(sb, repo, made.stdout.split()[-1])


@needs_root
async def test_a_path_setup_made_that_reads_as_an_option_is_still_checked(tmp_path: Path) -> None:
    """A setup's `-logs/` went to `find` first and was read as an option: the listing
    failed silently, both states were empty, and setup's `.egg-info` took the patch's
    entry point."""
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path)})) as sb:
        repo, base = await _setup(sb, "mkdir -- -logs && echo x > -logs/setup.log")
        assert base.made[:1] == ("-logs/",)
        with pytest.raises(ForgedDiff, match=r"calc\.egg-info"):
            await apply_patch(sb, repo, ENTRY.encode(), base)


@needs_root
async def test_a_process_setup_left_writing_its_log_is_no_forged_diff(tmp_path: Path) -> None:
    """A process setup left behind (a server, a database) appends to a log in what setup
    made while the patch goes in: that is no change of the diff's (a correct fix had
    been graded 0 as forged, 4 runs in 5)."""
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path)})) as sb:
        repo, base = await _setup(sb, "echo up > calc.egg-info/daemon.log")
        writer = await sb.start(
            "while :; do echo beat >> calc.egg-info/daemon.log; sleep 0.002; done", cwd="repo"
        )
        fix = (
            "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n"
            "@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"
        )
        for _ in range(3):
            await apply_patch(sb, repo, fix.encode(), base)
            await sb.exec("git checkout -q -- calc.py", cwd="repo")
        await writer.kill()


@needs_root
async def test_a_diff_the_driver_took_applies(
    calc_sandbox: tuple[Sandbox, str, Baseline], tmp_path: Path
) -> None:
    """The agent's own diff (a fix, a new module) applies on the same setup in another
    sandbox; its change to what setup made is not in it, and setup's files stay."""
    sb, repo, base = calc_sandbox
    agent = (
        "sed -i 's/a - b/a + b/' calc.py && printf 'X = 1\\n' > extra.py && "
        "echo changed >> calc.egg-info/PKG-INFO"  # setup's: not in the diff
    )
    assert (await sb.exec(agent, cwd=repo)).exit_code == 0
    await sb.end_processes()
    patch = await take_diff(sb, repo, base)
    assert b"PKG-INFO" not in patch
    async with await open_sandbox(SandboxSpec(options={"root": str(tmp_path)})) as ev:
        eval_repo, _ = await _setup(ev)
        await apply_patch(ev, eval_repo, patch, base)
        left = await ev.exec("ls -A; cat calc.py calc.egg-info/PKG-INFO", cwd=eval_repo)
        assert "return a + b" in left.stdout and "extra.py" in left.stdout
        assert "changed" not in left.stdout
