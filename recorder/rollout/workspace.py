"""The task's repository inside a sandbox: checkout at `base_commit`, setup, diff, apply.

A local repository travels as a `git bundle` written into the sandbox (made
once per repository and commit, then cached), so the same code path serves a
sandbox on this machine and one in the cloud; a URL is cloned in the sandbox.
The diff is `git diff --binary` of the whole tree (after `git add -A`) against
`base_commit`: new, deleted and binary files included.
"""

from __future__ import annotations

import asyncio
import posixpath
import shlex

from recorder.rollout.errors import InfraError
from recorder.rollout.sandbox import ExecResult, Sandbox
from recorder.rollout.tasks import Task

REPO_DIR = "repo"
_GIT = "git -c core.fileMode=false -c advice.detachedHead=false"
_bundles: dict[tuple[str, str], asyncio.Task[bytes]] = {}


def repo_path(sb: Sandbox) -> str:
    return posixpath.join(sb.workdir, REPO_DIR)


async def _make_bundle(repo: str, commit: str) -> bytes:
    proc = await asyncio.create_subprocess_exec(
        "git", "-C", repo, "bundle", "create", "-", "--all",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise InfraError(
            "repo_checkout", f"cannot bundle the local repository {repo}: {err.decode()[-500:]}"
        )
    return out


async def bundle(repo: str, commit: str) -> bytes:
    """The local repository as a git bundle, made once per (repo, commit) and shared."""
    key = (repo, commit)
    task = _bundles.get(key)
    if task is None or (task.done() and task.exception() is not None):
        task = _bundles[key] = asyncio.ensure_future(_make_bundle(repo, commit))
    return await asyncio.shield(task)


async def checkout(sb: Sandbox, task: Task) -> tuple[str, ExecResult]:
    """Put the task's repository at `base_commit` in the sandbox: (its path there, the run)."""
    dest = repo_path(sb)
    if task.is_local_repo:
        source = posixpath.join(sb.workdir, "repo.bundle")
        await sb.write_file(source, await bundle(task.repo, task.base_commit))
    else:
        source = task.repo
    cmd = (
        f"{_GIT} clone -q --no-checkout {shlex.quote(source)} {shlex.quote(dest)} && "
        f"cd {shlex.quote(dest)} && {_GIT} checkout -q {shlex.quote(task.base_commit)}"
    )
    result = await sb.exec(cmd, timeout_s=task.setup_timeout_s, cwd=sb.workdir)
    if result.exit_code != 0:
        raise InfraError(
            "repo_checkout",
            f"cannot check out {task.repo} at {task.base_commit}: {tail(result.stderr)}",
        )
    return dest, result


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


async def take_diff(sb: Sandbox, repo: str, base_commit: str) -> bytes:
    """Everything the agent changed since `base_commit`, as a binary git diff (read as
    bytes from a file, so text in any encoding survives)."""
    out = posixpath.join(sb.workdir, "agent.diff")
    cmd = (
        f"{_GIT} add -A && {_GIT} diff --cached --binary --no-color --no-ext-diff "
        f"{shlex.quote(base_commit)} > {shlex.quote(out)}"
    )
    result = await sb.exec(cmd, timeout_s=300, cwd=repo)
    if result.exit_code != 0:
        raise InfraError("sandbox_gone", f"git diff failed in the agent's sandbox: {result.stderr}")
    return await sb.read_file(out)


async def apply_patch(sb: Sandbox, repo: str, patch: bytes) -> None:
    path = posixpath.join(sb.workdir, "agent.patch")
    await sb.write_file(path, patch)
    result = await sb.exec(
        f"{_GIT} apply --binary --whitespace=nowarn {shlex.quote(path)}", timeout_s=300, cwd=repo
    )
    if result.exit_code != 0:
        raise InfraError(
            "patch_apply", f"the agent's diff does not apply on a clean checkout: {result.stderr}"
        )


def _output(result: ExecResult, limit: int = 1000) -> str:
    """A failed command's stdout and stderr tails (a build tool often errs on stdout)."""
    parts = [(n, t.strip()) for n, t in (("stdout", result.stdout), ("stderr", result.stderr))]
    return "; ".join(f"{name}: {tail(text, limit)}" for name, text in parts if text)


def tail(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]
