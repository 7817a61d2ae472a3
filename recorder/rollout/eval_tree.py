"""The eval sandbox's tree made the grader's before it runs: the protected paths as
setup left them, no stale bytecode, nothing of the patch's shadowing an import
of the grader's at the repository's root (`protect.py` says what and why)."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Sequence

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
# nor PYTHON* variables on its path): the directories of the repository that the grader's
# Python searches with their entries, every top-level module that interpreter can import,
# and every one it tries to import and cannot while pytest starts (in an empty
# directory: nothing of the repository runs). A name tried in vain is as good a shadow
# as an importable one: Python 3.11's `copy` tries `org.python.core` (Jython's), and an
# `org/` the patch added at the root, or in a `PYTHONPATH` directory or one a setup's
# `.pth` names (a second and third audit), ran inside pytest before it read its options.
# Searched: the root, the probe's own sys.path (site-packages `.pth` lines), what a `.pth`
# in the user's site-packages names (the probe runs without the user site), the sandbox's
# `PYTHONPATH` and the directories given as arguments (those the grader's command sets).
_PATH_PROBE = """
import json, os, sys
class Missed:
    names = set()
    def find_spec(self, name, path=None, target=None):
        self.names.add(name.partition(".")[0])
sys.meta_path.append(Missed())
import contextlib, pkgutil, site, tempfile
root = os.path.realpath(".")
searched = [".", *sys.path, *sys.argv[1:], *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
user = site.getusersitepackages()
try:
    for pth in sorted(os.listdir(user)):
        if pth.endswith(".pth"):
            with open(os.path.join(user, pth)) as f:
                searched += [os.path.join(user, line.strip()) for line in f
                             if line.strip() and not line.startswith(("#", "import"))]
except OSError:
    pass
# A name that is not UTF-8 names no module (and its escapes are no JSON text).
def readable(name):
    return not any("\\udc80" <= c <= "\\udcff" for c in name)
dirs = {}
for d in searched:
    real = os.path.realpath(d) if d else ""
    if real and os.path.isdir(real) and (real == root or real.startswith(root + os.sep)):
        rel = os.path.relpath(real, root)
        rel = "" if rel == "." else rel
        if rel not in dirs and readable(rel):
            dirs[rel] = [e for e in os.listdir(real) if readable(e)]
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
print(json.dumps({"dirs": dirs, "modules": sorted(modules | Missed.names)}))
"""


async def remove_path_shadows(
    sb: Sandbox, repo: str, base: Baseline, pythonpath: Sequence[str] = ()
) -> list[str]:
    """Remove what the patch added to a directory of the repository that the grader's
    Python searches (the root, `src/` through a setup's `.pth`, a `PYTHONPATH` directory:
    `pythonpath`, those the grader's command sets) that would shadow the grader's imports
    (`protect.shadowing_entries`); returns those paths. What base_commit or setup put
    there stays (a `pip install -e .`'s `.egg-info`). Nothing when no Python runs in the
    sandbox (no Python grader to shadow)."""
    q = shlex.quote
    args = " ".join(q(p) for p in pythonpath)
    probe = (
        f"python -I -c {q(_PATH_PROBE)} {args} 2>/dev/null || python3 -I -c {q(_PATH_PROBE)} {args}"
    )
    found = await sb.exec(probe, timeout_s=120, cwd=repo)
    if found.exit_code != 0:
        return []
    listing = msgspec.json.decode(found.stdout.strip().splitlines()[-1])
    modules = set(listing["modules"])
    shadows: list[str] = []
    for rel, entries in sorted(listing["dirs"].items()):
        own = await _own_entries(sb, repo, base, rel)
        shadows += [posixpath.join(rel, e) for e in shadowing_entries(entries, own, modules)]
    if shadows:
        done = await sb.exec(
            f"rm -rf -- {' '.join(q(e) for e in shadows)}", timeout_s=120, cwd=repo
        )
        if done.exit_code != 0:
            raise InfraError("eval_crashed", f"cannot remove {shadows}: {tail(done.stderr)}")
    return shadows


async def _own_entries(sb: Sandbox, repo: str, base: Baseline, rel: str) -> set[str]:
    """The entries of the repository's directory `rel` at base_commit or after setup."""
    where = f"-- {shlex.quote(rel + '/')}" if rel else ""
    listed = await sb.exec(
        f"{GIT} ls-tree -z --name-only {shlex.quote(base.commit)} {where}", timeout_s=120, cwd=repo
    )
    if listed.exit_code != 0:
        raise InfraError(
            "eval_crashed", f"cannot list base_commit's {rel or 'root'}: {tail(listed.stderr)}"
        )
    own = {posixpath.basename(p) for p in listed.stdout.split("\0") if p}
    if not rel:
        return own | base.root
    prefix = rel + "/"
    return own | {m[len(prefix) :].split("/", 1)[0] for m in base.made if m.startswith(prefix)}
