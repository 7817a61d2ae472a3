"""Every module of the project imports on its own, first, in a fresh interpreter.

An import cycle only breaks when the cycle is entered from the wrong end
(`import recorder.dialects` before `recorder.server` failed while the server,
which always came first, worked). One subprocess imports each module with the
project's modules forgotten before each, so every module is the entry point once.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import importlib, sys, traceback
names = sys.argv[1:]
failed = []
for name in names:
    for loaded in [m for m in sys.modules if m.split(".")[0] in ("recorder", "replay")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in ("recorder", "replay"):
            failed.append(f"{name}: {exc}")
        # else: an optional third-party package of a heavy tier (sglang, verl)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
print("\n".join(failed))
"""


def _modules() -> list[str]:
    names = []
    for package in ("recorder", "replay"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__main__":
                continue
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_module_imports_first() -> None:
    names = _modules()
    assert "recorder.dialects" in names and "replay.reducer" in names
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *names],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", done.stdout
