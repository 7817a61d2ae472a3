"""The task's repository inside a sandbox: checkout at `base_commit`, setup, diff, apply.

The agent's repository holds `base_commit` and its ancestors, nothing else: a
task's fix is often a later commit of the same repository (the branch head, a
tag, a stash), and an agent that can `git log --all` would copy it. So the
repository is never cloned: the objects reachable from `base_commit` travel as
one packfile (`git pack-objects --revs`), indexed into a fresh `git init`
repository and checked out detached at the commit. No branch, tag, remote,
remote URL, stash, reflog entry or object of a later commit exists in it; the
pack file and any staging copy are deleted before the agent starts.

A local repository is packed here (once per repository and commit, then
cached) and written into the sandbox, so one code path serves a sandbox on
this machine and one in the cloud. A URL is cloned bare into a staging
directory in the sandbox, packed there the same way, and the staging
directory removed.

The diff is `git diff --binary` of the whole tree (after `git add -A`) against
the full `base_commit` hash resolved at checkout (an agent-made ref named like
a short hash cannot move it): new, deleted and binary files included.
"""

from __future__ import annotations

import asyncio
import posixpath
import re
import shlex
from collections.abc import Sequence

import msgspec

from recorder.rollout.errors import InfraError
from recorder.rollout.protect import shadowing_entries
from recorder.rollout.sandbox import CommandTimeout, ExecResult, Sandbox
from recorder.rollout.tasks import Task

REPO_DIR = "repo"
# `--no-replace-objects`: a `git replace` ref of the agent's must not change what a diff reads.
_GIT = "git --no-replace-objects -c core.fileMode=false -c advice.detachedHead=false"
_PACK = ".tr-base.pack"  # in the sandbox's workdir, deleted once indexed
_STAGING = ".tr-staging.git"  # a URL repository's whole clone, deleted once packed
_packs: dict[tuple[str, str], asyncio.Task[BasePack]] = {}


class BasePack(msgspec.Struct, frozen=True):
    """The objects reachable from one commit, as one self-contained git packfile."""

    commit: str  # the full hash `base_commit` names
    data: bytes


class Checkout(msgspec.Struct, frozen=True):
    path: str  # the repository in the sandbox
    commit: str  # the full hash of `base_commit`: diffs and restores are taken against it
    result: ExecResult


def repo_path(sb: Sandbox) -> str:
    return posixpath.join(sb.workdir, REPO_DIR)


async def _git_host(repo: str, *args: str, stdin: bytes | None = None) -> bytes:
    proc = await asyncio.create_subprocess_exec(
        "git", "-C", repo, *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate(stdin)
    if proc.returncode != 0:
        raise InfraError(
            "repo_checkout",
            f"git {args[0]} failed in the local repository {repo}: {err.decode()[-500:]}",
        )
    return out


async def _make_pack(repo: str, commit: str) -> BasePack:
    full = (await _git_host(repo, "rev-parse", "--verify", "-q", f"{commit}^{{commit}}")).strip()
    data = await _git_host(repo, "pack-objects", "--revs", "--stdout", "-q", stdin=full + b"\n")
    return BasePack(full.decode(), data)


async def base_pack(repo: str, commit: str) -> BasePack:
    """`commit`'s history of the local repository as a packfile, made once and shared."""
    key = (repo, commit)
    task = _packs.get(key)
    if task is None or (task.done() and task.exception() is not None):
        task = _packs[key] = asyncio.ensure_future(_make_pack(repo, commit))
    return await asyncio.shield(task)


def _index_and_checkout(dest: str, pack: str, commit_word: str) -> str:
    """Shell: a fresh repository at `dest` holding only the pack's objects, HEAD detached at
    the commit (`commit_word`, a quoted shell word; its full hash is printed last), the pack
    file removed."""
    q = shlex.quote
    return (
        f"rm -rf {q(dest)} && {_GIT} init -q {q(dest)} && cd {q(dest)} && "
        f"{_GIT} index-pack --stdin < {q(pack)} > /dev/null && rm -f {q(pack)} && "
        f"{_GIT} checkout -q --detach {commit_word} && "
        f"{_GIT} rev-parse --verify HEAD"
    )


async def checkout(sb: Sandbox, task: Task) -> Checkout:
    """Put the task's repository at `base_commit` in the sandbox, with nothing newer in it."""
    dest = repo_path(sb)
    pack = posixpath.join(sb.workdir, _PACK)
    q = shlex.quote
    if task.is_local_repo:
        made = await base_pack(task.repo, task.base_commit)
        await sb.write_file(pack, made.data)
        cmd = _index_and_checkout(dest, pack, q(made.commit))
    else:
        staging = posixpath.join(sb.workdir, _STAGING)
        resolve = (
            f"{_GIT} -C {q(staging)} rev-parse --verify -q {q(task.base_commit + '^{commit}')}"
        )
        cmd = (
            f"rm -rf {q(staging)} && {_GIT} clone -q --bare{_upload_pack(task.repo)} "
            f"{q(task.repo)} {q(staging)} && "
            f'full=$({resolve}) && echo "$full" | '
            f"{_GIT} -C {q(staging)} pack-objects --revs --stdout -q > {q(pack)} && "
            f"rm -rf {q(staging)} && " + _index_and_checkout(dest, pack, '"$full"')
        )
    result = await sb.exec(cmd, timeout_s=task.setup_timeout_s, cwd=sb.workdir)
    if result.exit_code != 0:
        raise InfraError(
            "repo_checkout",
            f"cannot check out {task.repo} at {task.base_commit}: {tail(result.stderr)}",
        )
    return Checkout(dest, result.stdout.strip().splitlines()[-1], result)


def _upload_pack(url: str) -> str:
    """For a file:// URL: serve it whoever owns it. The repository may be another user's
    (a host mirror read by the sandbox's own user), and git refuses to serve a repository
    of another owner ("dubious ownership"); the local transport drops `-c` settings, so
    the setting goes into the upload-pack command itself."""
    if not url.startswith("file://"):
        return ""
    return " --upload-pack " + shlex.quote("git -c safe.directory=* upload-pack")


async def run_setup(sb: Sandbox, task: Task, repo: str) -> list[ExecResult]:
    """The task's setup commands, in order; a failure is infrastructure (no patch yet)."""
    results = []
    for cmd in task.setup:
        result = await sb.exec(cmd, timeout_s=task.setup_timeout_s, cwd=repo)
        results.append(result)
        if result.exit_code != 0:
            raise InfraError(
                "setup_failed",
                f"setup command {cmd!r} exited {result.exit_code}: "
                f"{_output(result) or '(no output)'}",
            )
    return results


class Baseline(msgspec.Struct, frozen=True):
    """The repository as the checkout and the task's setup left it.

    What setup writes (a `pip install -e .`'s `.egg-info`, a version file, an
    extension module built in place, bytecode) is the task's, not the agent's: the
    agent's diff is taken against `tree` and leaves out what setup created (`made`), and the
    eval sandbox applies it on what its own setup made. Against `base_commit`, setup's
    output was in every diff and the eval (which ran the same setup) refused it; an
    ignored `*.so` that setup built was removed before grading as bytecode. And what
    setup made must stay setup's: an agent that wrote a `[pytest11]` entry point into
    setup's `.egg-info` had its plugin loaded by the grader (1.0, an audit).

    From here on git reads and writes every file's bytes as they are
    (`RAW_ATTRIBUTES`), in both sandboxes: `tree` holds the raw bytes, so a diff of
    a CRLF or `ident` file applies byte for byte where it is graded, and no filter
    of the agent's runs while its diff is taken.
    """

    commit: str  # base_commit's full hash
    tree: str  # every file not ignored after setup, as raw bytes (a git tree's hash)
    root: frozenset[str]  # the entries at the repository's root after setup, ignored ones too
    # What setup created: untracked entries, ignored ones too (a directory whole, as
    # `dir/`). A tracked file setup changed is the repository's still: the agent's
    # change on top of setup's goes into its diff.
    made: tuple[str, ...] = ()
    ignored: frozenset[str] = frozenset()  # ignored files after setup under `snapshot`'s specs


async def snapshot(sb: Sandbox, repo: str, commit: str, ignored_in: Sequence[str] = ()) -> Baseline:
    """The repository's state after setup (`Baseline`), with the ignored files among the
    pathspecs `ignored_in`; the agent's index and refs are untouched."""
    q = shlex.quote
    index = q(posixpath.join(sb.workdir, ".tr-setup.index"))
    # Sections of NUL-terminated entries, each ended by a "/" entry (neither a root
    # name nor a file's path): root names, what setup made, the ignored files.
    end = "printf '/\\0'"
    ignored = (
        f"{_GIT} ls-files -z --others --ignored --exclude-standard -- "
        + " ".join(q(p) for p in ignored_in)
        + " && "
        if ignored_in
        else ""
    )
    # What setup made is listed, then the repository's attributes are set aside and
    # the raw tree is written.
    result = await sb.exec(
        f"{{ find . -mindepth 1 -maxdepth 1 -printf '%P\\0' && {end} && "
        f"{_GIT} ls-files -z --others --directory --no-empty-directory && {end} && "
        f"{ignored}{end}; }} > {index}.out && mkdir -p .git/info && "
        f"printf %s {q(RAW_ATTRIBUTES)} > .git/info/attributes && rm -f {index} && "
        f"GIT_INDEX_FILE={index} {_GIT} read-tree {q(commit)} && "
        f"GIT_INDEX_FILE={index} {_GIT} -c core.fsmonitor=false add -A && "
        f"GIT_INDEX_FILE={index} {_GIT} write-tree && cat {index}.out; "
        f"rc=$?; rm -f {index} {index}.out; exit $rc",
        timeout_s=600,
        cwd=repo,
    )
    if result.exit_code != 0:
        raise InfraError(
            "setup_failed", f"cannot snapshot the tree setup left: {tail(result.stderr)}"
        )
    tree, _, rest = result.stdout.partition("\n")
    sections: list[list[str]] = [[]]
    for entry in rest.split("\0"):
        if entry == "/":
            sections.append([])
        elif entry:
            sections[-1].append(entry)
    names, made, ignored_files = ([*sections, [], [], []])[:3]
    return Baseline(
        commit,
        tree.strip(),
        frozenset(names),
        tuple(dict.fromkeys(made)),
        frozenset(ignored_files),
    )


class BrokenRepository(Exception):
    """The agent's repository can no longer say what changed (its `.git` removed, its
    objects or files made unreadable): the agent destroyed its own work, a policy
    failure."""


async def take_diff(sb: Sandbox, repo: str, base: Baseline) -> bytes:
    """Everything the agent changed since setup (`base.tree`), but what setup made, as a
    binary git diff (read as bytes from a file, so text in any encoding survives).

    Taken with an index of its own, read from `base.tree`: nothing the agent did to its
    index (a force-added ignored file, a lock, garbage) counts. The sandbox's processes
    must be ended first (`Sandbox.end_processes`). Raises BrokenRepository when the
    sandbox answers but the repository cannot be diffed (an `rm -rf .git` had closed
    the rollout as a lost sandbox, which masks its 0); a full disk stays infrastructure.
    """
    out = posixpath.join(sb.workdir, "agent.diff")
    index = posixpath.join(sb.workdir, ".tr-diff.index")
    specs = posixpath.join(sb.workdir, ".tr-diff.pathspecs")
    q = shlex.quote
    try:  # no filter or conversion of the agent's runs (its processes are gone by now)
        await sb.write_file(posixpath.join(repo, ".git", "info", "attributes"), RAW_ATTRIBUTES)
    except OSError as exc:  # `.git` made a file, or unwritable
        raise BrokenRepository(f"cannot write the repository's attributes: {exc}") from exc
    git = f"GIT_INDEX_FILE={q(index)} {_GIT} -c core.fsmonitor=false"
    # What setup made goes back to setup's state in that index (a pathspec naming an
    # ignored file would make `git add` fail, `git reset` takes any).
    keep_setups = ""
    if base.made:
        await sb.write_file(specs, "\0".join(base.made))
        keep_setups = (
            f" && {git} --literal-pathspecs reset -q {q(base.tree)} "
            f"--pathspec-file-nul --pathspec-from-file={q(specs)}"
        )
    # The agent owns .git/config: pin what would change the diff's shape (prefixes,
    # textconv, a relative diff), so its patch always applies where it is graded. A
    # fresh output file: one the agent planted there (a FIFO, a link) goes first.
    cmd = (
        f"rm -f {q(out)} {q(index)} && {git} read-tree {q(base.tree)} && "
        f"{git} add -A{keep_setups} && "
        f"{git} diff --cached --binary --full-index --no-color --no-ext-diff --no-textconv "
        "--no-relative "
        f"--src-prefix=a/ --dst-prefix=b/ {q(base.tree)} > {q(out)}; "
        f"rc=$?; rm -f {q(index)} {q(specs)}; exit $rc"
    )
    try:
        result = await sb.exec(cmd, timeout_s=600, cwd=repo)
    except CommandTimeout as exc:
        raise BrokenRepository(f"git diff did not end: {exc}") from exc
    if result.exit_code != 0:
        failed = f"git diff failed in the agent's sandbox: {tail(result.stderr)}"
        if "No space left on device" in result.stderr:
            raise InfraError("sandbox_gone", failed)
        raise BrokenRepository(failed)
    return await sb.read_file(out)


_PREIMAGE = re.compile(rb"^index ([0-9a-f]{40,64})\.\.", re.M)


async def preimages_in_tree(sb: Sandbox, repo: str, tree: str, patch: bytes) -> bool:
    """Whether every file the patch changes had, where its diff was taken, content the
    tree `tree` holds (the diff's `--full-index` preimage hashes). Then the patch would
    apply on that tree, and a refusal is of the agent's making (its object store
    rewritten), whatever else a run-to-run setup made differently."""
    wanted = {m.decode() for m in _PREIMAGE.findall(patch)} - {"0" * 40, "0" * 64}
    if not wanted:
        return False
    listed = await sb.exec(f"{_GIT} ls-tree -r -z {shlex.quote(tree)}", timeout_s=300, cwd=repo)
    if listed.exit_code != 0:
        return False
    blobs = {
        entry.split(" ", 2)[2].split("\t", 1)[0] for entry in listed.stdout.split("\0") if entry
    }
    return wanted <= blobs


# Written to the eval repository's `.git/info/attributes` (which overrides every
# `.gitattributes`) before the patch goes in: git then reads and writes every file's
# bytes as they are. A patch's own `.gitattributes` naming a test file
# `working-tree-encoding=UTF-7` had made `git add` decode the rewritten test back
# to base_commit's text, so the restore saw no change, while Python ran the bytes.
RAW_ATTRIBUTES = "* -text -eol -ident -filter -working-tree-encoding\n"


async def apply_patch(sb: Sandbox, repo: str, patch: bytes) -> None:
    path = posixpath.join(sb.workdir, "agent.patch")
    await sb.write_file(path, patch)
    attributes = posixpath.join(sb.workdir, repo, ".git", "info", "attributes")
    await sb.write_file(attributes, RAW_ATTRIBUTES)
    result = await sb.exec(
        f"{_GIT} apply --binary --whitespace=nowarn {shlex.quote(path)}", timeout_s=300, cwd=repo
    )
    if result.exit_code != 0:
        raise InfraError(
            "patch_apply", f"the agent's diff does not apply on a clean checkout: {result.stderr}"
        )


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
    git = f"GIT_INDEX_FILE={q(index)} {_GIT}"
    # Ignored files count too: a file the patch also names in a .gitignore of its own
    # is still the patch's (`git add -A` alone would leave it out).
    ignored = (
        f"{git} ls-files -z --others --ignored --exclude-standard -- {specs} "
        f"| xargs -0 -r env GIT_INDEX_FILE={q(index)} {_GIT} --literal-pathspecs add -f --"
    )
    listed = await sb.exec(
        f"rm -f {q(index)} && {git} read-tree {q(base.tree)} && {git} add -A && {ignored} && "
        f"{git} diff --cached --name-status -z --no-renames {q(base.tree)} -- {specs}",
        timeout_s=600,
        cwd=repo,
    )
    if listed.exit_code != 0:
        raise InfraError("eval_crashed", f"cannot list the protected paths: {tail(listed.stderr)}")
    fields = listed.stdout.split("\0")
    changed = [
        (status, path)
        for status, path in zip(fields[0::2], fields[1::2], strict=False)
        # setup's own: git apply adds no file where one exists
        if not (status == "A" and path in base.ignored)
    ]
    added = [path for status, path in changed if status == "A"]
    restored = [path for status, path in changed if status != "A"]
    steps, lists = [], posixpath.join(sb.workdir, ".tr-restore")
    from_file = "--pathspec-file-nul --pathspec-from-file="
    if added:
        await sb.write_file(f"{lists}.added", "\0".join(added))
        steps.append(f"{git} --literal-pathspecs rm -q -f {from_file}{q(lists + '.added')}")
    if restored:
        await sb.write_file(f"{lists}.restored", "\0".join(restored))
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
    return [path for _, path in changed]


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
        f"{_GIT} ls-tree -z --name-only {q(base.commit)}", timeout_s=120, cwd=repo
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


async def apply_test_patch(sb: Sandbox, repo: str, patch: str) -> str | None:
    """Apply the task's `test_patch` on the agent's tree; None, or why it does not apply
    (the agent's patch conflicts with it: the task's reward is 0)."""
    path = posixpath.join(sb.workdir, ".tr-test.patch")
    await sb.write_file(path, patch)
    q = shlex.quote
    result = await sb.exec(
        f"{_GIT} apply --binary --whitespace=nowarn {q(path)}; rc=$?; rm -f {q(path)}; exit $rc",
        timeout_s=300,
        cwd=repo,
    )
    if result.exit_code != 0:
        return f"the task's test_patch does not apply on the agent's patch: {tail(result.stderr, 1000)}"
    return None


def _output(result: ExecResult, limit: int = 1000) -> str:
    """A failed command's stdout and stderr tails (a build tool often errs on stdout)."""
    parts = [(n, t.strip()) for n, t in (("stdout", result.stdout), ("stderr", result.stderr))]
    return "; ".join(f"{name}: {tail(text, limit)}" for name, text in parts if text)


def tail(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]
