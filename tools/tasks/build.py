"""Build the shipped task repositories: `python -m tools.tasks.build [--check]`.

Each `src/<name>/` becomes `build/<name>/`, a git repository with one commit
made with fixed identities and dates, so its hash is the same everywhere and
`tasks.jsonl` can name it. An existing build at the right commit is kept.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
BUILD = HERE / "build"
TASKS = HERE / "tasks.jsonl"

_FIXED = {
    "GIT_AUTHOR_NAME": "trajectory-recorder",
    "GIT_AUTHOR_EMAIL": "tasks@trajectory-recorder.invalid",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_COMMITTER_NAME": "trajectory-recorder",
    "GIT_COMMITTER_EMAIL": "tasks@trajectory-recorder.invalid",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, **_FIXED}
    out = subprocess.run(
        ["git", "-C", str(repo), *args], env=env, check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


def _head(repo: Path) -> str | None:
    if not (repo / ".git").exists():
        return None
    try:
        return _git(repo, "rev-parse", "HEAD")
    except subprocess.CalledProcessError:
        return None


def build_repo(name: str) -> str:
    """Build (or keep) `build/<name>`; returns its commit."""
    src, dest = SRC / name, BUILD / name
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path in dest.rglob("*"):
        if path.is_file():
            path.chmod(0o644)
    _git(dest, "init", "-q", "-b", "main")
    _git(dest, "add", "-A")
    _git(dest, "-c", "commit.gpgsign=false", "commit", "-q", "-m", f"{name}: initial import")
    return _git(dest, "rev-parse", "HEAD")


def expected_commits() -> dict[str, str]:
    """repo directory name -> the commit tasks.jsonl names for it."""
    wanted: dict[str, str] = {}
    for line in TASKS.read_text().splitlines():
        if line.strip():
            task = msgspec.json.decode(line)
            wanted[Path(task["repo"]).name] = task["base_commit"]
    return wanted


def build_all() -> Path:
    """Build every repository tasks.jsonl names; returns the tasks file. Raises
    RuntimeError if a build's commit differs from the one tasks.jsonl names."""
    for name, commit in expected_commits().items():
        if _head(BUILD / name) == commit:
            continue
        got = build_repo(name)
        if got != commit:
            raise RuntimeError(
                f"tools/tasks/build/{name} built at {got}, but tasks.jsonl names {commit}: "
                "update tasks.jsonl after editing tools/tasks/src"
            )
    return TASKS


def main() -> None:
    if "--print" in sys.argv:  # after editing src/: print the new commits for tasks.jsonl
        for name in sorted(p.name for p in SRC.iterdir()):
            print(name, build_repo(name))
        return
    print(build_all())


if __name__ == "__main__":
    main()
