"""Child processes run from this repository, and measurements in a fresh interpreter.

A benchmark that measures peak RSS or a cold start runs each measurement in
its own `python` so one measurement's heap cannot inflate the next; the child
prints one JSON line last, which `measure_in_child` returns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def repo_env(root: Path = REPO) -> dict[str, str]:
    """This environment with the repository (or another checkout, `root`) first on
    `PYTHONPATH` (the package may be installed from another checkout)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return env


def python_module(
    module: str, *args: str, root: Path = REPO, **popen: object
) -> subprocess.Popen[bytes]:
    """`python -m MODULE ARGS` from the repository's root (or another checkout's, `root`)."""
    return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
        [sys.executable, "-m", module, *args], cwd=root, env=repo_env(root), **popen
    )


def measure_in_child(script: str, args: list[str], what: str) -> dict[str, object]:
    """Run `python SCRIPT ARGS`; the JSON object on its last line of output."""
    proc = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, env=repo_env()
    )
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
