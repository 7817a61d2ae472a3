"""The task's repository inside a sandbox: checkout at `base_commit`, then setup.

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

What the agent changed after that is `diff.py`'s; what the grader's tree must
hold before it runs, `eval_tree.py`'s.
"""

from __future__ import annotations

import asyncio
import posixpath
import shlex

import msgspec

from recorder.rollout.errors import InfraError
from recorder.rollout.sandbox import ExecResult, Sandbox
from recorder.rollout.tasks import Task

REPO_DIR = "repo"
# `--no-replace-objects`: a `git replace` ref of the agent's must not change what a diff reads.
GIT = "git --no-replace-objects -c core.fileMode=false -c advice.detachedHead=false"
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
        f"rm -rf {q(dest)} && {GIT} init -q {q(dest)} && cd {q(dest)} && "
        f"{GIT} index-pack --stdin < {q(pack)} > /dev/null && rm -f {q(pack)} && "
        f"{GIT} checkout -q --detach {commit_word} && "
        f"{GIT} rev-parse --verify HEAD"
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
        resolve = f"{GIT} -C {q(staging)} rev-parse --verify -q {q(task.base_commit + '^{commit}')}"
        cmd = (
            f"rm -rf {q(staging)} && {GIT} clone -q --bare{_upload_pack(task.repo)} "
            f"{q(task.repo)} {q(staging)} && "
            f'full=$({resolve}) && echo "$full" | '
            f"{GIT} -C {q(staging)} pack-objects --revs --stdout -q > {q(pack)} && "
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


def _output(result: ExecResult, limit: int = 1000) -> str:
    """A failed command's stdout and stderr tails (a build tool often errs on stdout)."""
    parts = [(n, t.strip()) for n, t in (("stdout", result.stdout), ("stderr", result.stderr))]
    return "; ".join(f"{name}: {tail(text, limit)}" for name, text in parts if text)


def tail(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]
