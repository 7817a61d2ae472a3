"""The eval sandbox's tree made the grader's before it runs: the protected paths as
setup left them, no stale bytecode, nothing of the patch's shadowing an import
of the grader's at the repository's root (`protect.py` says what and why)."""

from __future__ import annotations

import posixpath
import shlex

import msgspec

from recorder.rollout.diff import Baseline
from recorder.rollout.errors import InfraError
from recorder.rollout.protect import shadowing_entries
from recorder.rollout.sandbox import Sandbox
from recorder.rollout.workspace import GIT, tail


async def restore_protected(
    sb: Sandbox, repo: str, base: Baseline, pathspecs: list[str]
) -> list[str]:
    """Put the protected paths back as setup left them (`base.tree`; files the patch added
    there are removed); returns the paths the patch had changed (the attempt, for the
    evidence). `base.ignored` must list the ignored files under `pathspecs` before the
    patch: they are setup's (an extension module built in place), not the patch's.

    Works on an index of its own read from `base.tree` (raw bytes, like the tree), and
    takes path lists from files: thousands of files a patch added under `tests/` had
    made one command line too long (an abort, which masked the policy's 0)."""
    if not pathspecs:
        return []
    q = shlex.quote
    specs = " ".join(q(p) for p in pathspecs)
    index = posixpath.join(sb.workdir, ".tr-restore.index")
    git = f"GIT_INDEX_FILE={q(index)} {GIT}"
    # Ignored files count too: a file the patch also names in a .gitignore of its own
    # is still the patch's (`git add -A` alone would leave it out).
    ignored = (
        f"{git} ls-files -z --others --ignored --exclude-standard -- {specs} "
        f"| xargs -0 -r env GIT_INDEX_FILE={q(index)} {GIT} --literal-pathspecs add -f --"
    )
    lists = posixpath.join(sb.workdir, ".tr-restore")
    listed = await sb.exec(
        f"rm -f {q(index)} && {git} read-tree {q(base.tree)} && {git} add -A && {ignored} && "
        f"{git} diff --cached --name-status -z --no-renames {q(base.tree)} -- {specs} "
        f"> {q(lists + '.status')}",
        timeout_s=600,
        cwd=repo,
    )
    if listed.exit_code != 0:
        raise InfraError("eval_crashed", f"cannot list the protected paths: {tail(listed.stderr)}")
    # Read as bytes: a path that is not UTF-8 (a patch's `forge\377.dist-info`) must name
    # the same file when it goes back to git.
    fields = (await sb.read_file(lists + ".status")).split(b"\0")
    setups = {p.encode() for p in base.ignored}
    changed = [
        (status, path)
        for status, path in zip(fields[0::2], fields[1::2], strict=False)
        # setup's own: git apply adds no file where one exists
        if not (status == b"A" and path in setups)
    ]
    added = [path for status, path in changed if status == b"A"]
    restored = [path for status, path in changed if status != b"A"]
    steps = []
    from_file = "--pathspec-file-nul --pathspec-from-file="
    if added:
        await sb.write_file(f"{lists}.added", b"\0".join(added))
        steps.append(f"{git} --literal-pathspecs rm -q -f {from_file}{q(lists + '.added')}")
    if restored:
        await sb.write_file(f"{lists}.restored", b"\0".join(restored))
        steps.append(
            f"{git} --literal-pathspecs checkout -q {q(base.tree)} "
            f"{from_file}{q(lists + '.restored')}"
        )
    if steps:
        done = await sb.exec(" && ".join(steps), timeout_s=600, cwd=repo)
        if done.exit_code != 0:
            raise InfraError(
                "eval_crashed", f"cannot restore the protected paths: {tail(done.stderr)}"
            )
    return [path.decode(errors="replace") for _, path in changed]


async def remove_bytecode(sb: Sandbox, repo: str) -> None:
    """Remove the bytecode cache (`__pycache__/*.pyc`) before grading. Setup's cache is
    stale once the patch changes a module within the same second and at the same size
    (Python checks only mtime and size): a correct fix graded 0 under a setup that ran
    `compileall`. Python writes the cache again; a sourceless module (a `.pyc` outside
    `__pycache__`) is not cache, and stays."""
    done = await sb.exec(
        "find . -path ./.git -prune -o -type f -path '*/__pycache__/*' "
        "\\( -name '*.pyc' -o -name '*.pyo' \\) "
        "-exec rm -f -- {} +",
        timeout_s=600,
        cwd=repo,
    )
    if done.exit_code != 0:
        raise InfraError("eval_crashed", f"cannot remove bytecode: {tail(done.stderr)}")


# Run in the eval sandbox by the grader's interpreter (isolated: neither the repository
# nor PYTHON* variables on its path): the entries of the repository's root, every
# top-level module that interpreter can import, and every one it tries to import and
# cannot while pytest starts (in an empty directory: nothing of the repository runs).
# A name tried in vain is as good a shadow as an importable one: Python 3.11's `copy`
# tries `org.python.core` (Jython's), and a root `org/` the patch added then ran
# inside pytest before it read its options.
_ROOT_PROBE = """
import json, os, sys
class Missed:
    names = set()
    def find_spec(self, name, path=None, target=None):
        self.names.add(name.partition(".")[0])
sys.meta_path.append(Missed())
import contextlib, pkgutil, tempfile
# A name that is not UTF-8 names no module (and its escapes are no JSON text).
entries = [e for e in os.listdir(".") if not any("\\udc80" <= c <= "\\udcff" for c in e)]
modules = set(getattr(sys, "stdlib_module_names", ())) | set(sys.builtin_module_names)
modules |= {m.name for m in pkgutil.iter_modules()}
with tempfile.TemporaryDirectory() as empty, open(os.devnull, "w") as null:
    os.chdir(empty)
    with contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        try:
            import pytest
            pytest.main(["-q", "-p", "no:cacheprovider", "--collect-only", empty])
        except BaseException:
            pass
print(json.dumps({"entries": entries, "modules": sorted(modules | Missed.names)}))
"""


async def remove_root_shadows(sb: Sandbox, repo: str, base: Baseline) -> list[str]:
    """Remove what the patch added at the repository's root that would shadow the grader's
    imports (`protect.shadowing_entries`); returns those entries. What base_commit or
    setup put there stays (a `pip install -e .`'s `.egg-info`). Nothing when no Python
    runs in the sandbox (no Python grader to shadow)."""
    q = shlex.quote
    probe = f"python -I -c {q(_ROOT_PROBE)} 2>/dev/null || python3 -I -c {q(_ROOT_PROBE)}"
    found = await sb.exec(probe, timeout_s=120, cwd=repo)
    if found.exit_code != 0:
        return []
    listing = msgspec.json.decode(found.stdout.strip().splitlines()[-1])
    listed = await sb.exec(
        f"{GIT} ls-tree -z --name-only {q(base.commit)}", timeout_s=120, cwd=repo
    )
    if listed.exit_code != 0:
        raise InfraError("eval_crashed", f"cannot list base_commit's root: {tail(listed.stderr)}")
    shadows = shadowing_entries(
        listing["entries"], set(listed.stdout.split("\0")) | base.root, set(listing["modules"])
    )
    if shadows:
        done = await sb.exec(
            f"rm -rf -- {' '.join(q(e) for e in shadows)}", timeout_s=120, cwd=repo
        )
        if done.exit_code != 0:
            raise InfraError("eval_crashed", f"cannot remove {shadows}: {tail(done.stderr)}")
    return shadows
