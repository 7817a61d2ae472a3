"""What the agent changed: the tree setup left, the agent's diff against it, applying it.

After setup each sandbox records the repository's state (`Baseline`); the agent's
diff is taken against that tree, leaving out what setup created, and the eval
sandbox applies it on what its own setup made. The diff is `git diff --binary`
of the whole tree: new, deleted and binary files included.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Sequence

import msgspec

from recorder.rollout.errors import InfraError
from recorder.rollout.sandbox import CommandTimeout, Sandbox
from recorder.rollout.workspace import GIT, tail


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
        f"{GIT} ls-files -z --others --ignored --exclude-standard -- "
        + " ".join(q(p) for p in ignored_in)
        + " && "
        if ignored_in
        else ""
    )
    # What setup made is listed, then the repository's attributes are set aside and
    # the raw tree is written.
    result = await sb.exec(
        f"{{ find . -mindepth 1 -maxdepth 1 -printf '%P\\0' && {end} && "
        f"{GIT} ls-files -z --others --directory --no-empty-directory && {end} && "
        f"{ignored}{end}; }} > {index}.out && mkdir -p .git/info && "
        f"printf %s {q(RAW_ATTRIBUTES)} > .git/info/attributes && rm -f {index} && "
        f"GIT_INDEX_FILE={index} {GIT} read-tree {q(commit)} && "
        f"GIT_INDEX_FILE={index} {GIT} -c core.fsmonitor=false add -A && "
        f"GIT_INDEX_FILE={index} {GIT} write-tree && cat {index}.out; "
        f"rc=$?; rm -f {index} {index}.out; exit $rc",
        timeout_s=600,
        cwd=repo,
    )
    if result.exit_code != 0:
        raise InfraError(
            "setup_failed", f"cannot snapshot the tree setup left: {tail(result.stderr)}"
        )
    tree, _, rest = result.stdout.partition("\n")
    names, made, ignored_files = ([*_sections(rest), [], [], []])[:3]
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

    failure = "repository_broken"  # the grade's `failure`


class DiskFull(BrokenRepository):
    """The sandbox filled a disk of its own (`Sandbox.filled_its_own_disk`): no diff could
    be written. A policy failure; on a disk it shares it stays infrastructure."""

    failure = "disk_full"


async def take_diff(sb: Sandbox, repo: str, base: Baseline) -> bytes:
    """Everything the agent changed since setup (`base.tree`), but what setup made, as a
    binary git diff (read as bytes from a file, so text in any encoding survives).

    Taken with an index of its own, read from `base.tree`: nothing the agent did to its
    index (a force-added ignored file, a lock, garbage) counts. The sandbox's processes
    must be ended first (`Sandbox.end_processes`). Raises BrokenRepository when the
    sandbox answers but the repository cannot be diffed (an `rm -rf .git` had closed
    the rollout as a lost sandbox, which masks its 0), DiskFull when the sandbox filled
    a disk of its own; a full disk the sandbox shares stays infrastructure.
    """
    out = posixpath.join(sb.workdir, "agent.diff")
    index = posixpath.join(sb.workdir, ".tr-diff.index")
    specs = posixpath.join(sb.workdir, ".tr-diff.pathspecs")
    q = shlex.quote
    try:  # no filter or conversion of the agent's runs (its processes are gone by now)
        await sb.write_file(posixpath.join(repo, ".git", "info", "attributes"), RAW_ATTRIBUTES)
    except OSError as exc:  # `.git` made a file, or unwritable
        raise await _unwritable(sb, f"cannot write the repository's attributes: {exc}") from exc
    git = f"GIT_INDEX_FILE={q(index)} {GIT} -c core.fsmonitor=false"
    # What setup made goes back to setup's state in that index (a pathspec naming an
    # ignored file would make `git add` fail, `git reset` takes any).
    keep_setups = ""
    if base.made:
        try:
            await sb.write_file(specs, "\0".join(base.made))
        except OSError as exc:  # the agent's disk out of inodes: an audit's masked 0
            raise await _unwritable(sb, f"cannot write the diff's pathspecs: {exc}") from exc
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
        raise await _unwritable(
            sb, f"git diff failed in the agent's sandbox: {tail(result.stderr)}"
        )
    return await sb.read_file(out)


async def _unwritable(sb: Sandbox, why: str) -> Exception:
    """What a failed step of `take_diff` is: a full disk the sandbox filled itself (0), a
    full disk it shares (infrastructure), or a repository the agent broke (0)."""
    if "No space left on device" not in why:
        return BrokenRepository(why)
    if await sb.filled_its_own_disk():
        return DiskFull(f"the sandbox filled its own disk: {why}")
    return InfraError("sandbox_gone", why)


_PREIMAGE = re.compile(rb"^index ([0-9a-f]{40,64})\.\.", re.M)


async def preimages_in_tree(sb: Sandbox, repo: str, tree: str, patch: bytes) -> bool:
    """Whether every file the patch changes had, where its diff was taken, content the
    tree `tree` holds (the diff's `--full-index` preimage hashes). Then the patch would
    apply on that tree, and a refusal is of the agent's making (its object store
    rewritten), whatever else a run-to-run setup made differently."""
    wanted = {m.decode() for m in _PREIMAGE.findall(patch)} - {"0" * 40, "0" * 64}
    if not wanted:
        return False
    listed = await sb.exec(f"{GIT} ls-tree -r -z {shlex.quote(tree)}", timeout_s=300, cwd=repo)
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


class ForgedDiff(Exception):
    """The agent's diff changed what setup made, which `take_diff` never puts in a diff:
    the diff was made elsewhere than there (the agent's sandbox is the agent's: a
    process left behind swapped the diff file, or, on E2B, its own `git`)."""

    def __init__(self, entries: list[str]) -> None:
        super().__init__(
            f"the agent's diff changed what setup made, which no diff taken by the driver "
            f"holds: {'; '.join(entries[:20])}"
        )
        self.entries = entries


# What setup made in the agent's sandbox, as the eval sandbox holds it before and after
# `git apply` (every file and directory below each path: type, mode, inode, path, a
# link's target), compared byte for byte in the sandbox. `git apply` writes a file it
# changes anew (another inode) and chmods in place; a process setup left that appends
# to its log changes neither. A first version parsed the paths out of the diff: an
# audit got past it with git's old `rename old` header, a header whose two names
# differ, and a listing longer than a command's kept output. The paths go to `find` as
# `./path` (a setup's `-logs/` was read as an option) and any error but a missing path
# fails the comparison.
_STATE = (
    'xargs -0 -r sh -c \'exec find "$@" -printf "%y %m %i %p -> %l\\0"\' sh < {at}.made '
    "2> {at}.{when}.err | LC_ALL=C sort -z > {at}.{when} && "
    "! grep -v 'No such file or directory$' {at}.{when}.err"
)


async def apply_patch(sb: Sandbox, repo: str, patch: bytes, agents: Baseline) -> None:
    """Apply the agent's diff on the eval sandbox's tree.

    Raises ForgedDiff when it changed what setup made in the agent's sandbox
    (`agents.made`), which no diff the driver takes holds: such a diff had an entry
    point written into setup's `.egg-info` load a plugin into the grader's pytest.
    InfraError("patch_apply") when git refuses it, "eval_crashed" when the state of
    what setup made cannot be read.
    """
    at = posixpath.join(sb.workdir, ".tr-apply")
    path = posixpath.join(sb.workdir, "agent.patch")
    await sb.write_file(path, patch)
    # Again, though `snapshot` wrote it: the guarantee belongs where the patch goes in.
    attributes = posixpath.join(sb.workdir, repo, ".git", "info", "attributes")
    await sb.write_file(attributes, RAW_ATTRIBUTES)
    q = shlex.quote
    if agents.made:  # else nothing to watch: two sandbox commands saved per eval
        await sb.write_file(f"{at}.made", "".join(f"./{m}\0" for m in agents.made))
        await _state_step(sb, repo, _STATE.format(at=q(at), when="before"))
    result = await sb.exec(
        f"{GIT} apply --binary --whitespace=nowarn {q(path)}", timeout_s=300, cwd=repo
    )
    if result.exit_code != 0:
        raise InfraError(
            "patch_apply", f"the agent's diff does not apply on a clean checkout: {result.stderr}"
        )
    if not agents.made:
        return
    a = q(at)
    after = _STATE.format(at=a, when="after")
    changed = await _state_step(
        sb, repo, f"{after} && LC_ALL=C comm -z -3 {a}.before {a}.after | head -z -n 64"
    )
    await sb.exec(f"rm -f {a}.*", timeout_s=60)
    if changed:
        raise ForgedDiff([entry.strip() for entry in changed.split("\0") if entry.strip()])


async def _state_step(sb: Sandbox, repo: str, cmd: str) -> str:
    done = await sb.exec(cmd, timeout_s=600, cwd=repo)
    if done.exit_code != 0:
        raise InfraError(
            "eval_crashed",
            f"cannot read what setup made: {tail(done.stdout + done.stderr, 1000)}",
        )
    return done.stdout


def _sections(out: str) -> list[list[str]]:
    """NUL-terminated entries in sections, each ended by a "/" entry (no path's name)."""
    sections: list[list[str]] = [[]]
    for entry in out.split("\0"):
        if entry == "/":
            sections.append([])
        elif entry:
            sections[-1].append(entry)
    return sections[:-1]


async def apply_test_patch(sb: Sandbox, repo: str, patch: str) -> str | None:
    """Apply the task's `test_patch` on the agent's tree; None, or why it does not apply
    (the agent's patch conflicts with it: the task's reward is 0)."""
    path = posixpath.join(sb.workdir, ".tr-test.patch")
    await sb.write_file(path, patch)
    q = shlex.quote
    result = await sb.exec(
        f"{GIT} apply --binary --whitespace=nowarn {q(path)}; rc=$?; rm -f {q(path)}; exit $rc",
        timeout_s=300,
        cwd=repo,
    )
    if result.exit_code != 0:
        return f"the task's test_patch does not apply on the agent's patch: {tail(result.stderr, 1000)}"
    return None
