"""The rollout driver runs on other machines than the recorder: it talks HTTP only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import recorder.rollout
from tests.layers import imported_modules

FORBIDDEN = ("recorder.server", "recorder.log.store")
ROOT = Path(recorder.rollout.__file__).parent


def test_nothing_under_rollout_imports_the_server_or_the_store() -> None:
    files = sorted(ROOT.rglob("*.py"))
    assert len(files) >= 8
    bad = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in files
        for name in imported_modules(path)
        if name.startswith(FORBIDDEN) or name in ("recorder", "replay")
    }
    assert not bad, bad


def test_importing_the_driver_loads_no_server_module() -> None:
    code = (
        "import sys, recorder.rollout.driver, recorder.rollout.cli\n"
        "print([m for m in sys.modules if m.startswith('recorder.server')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
