"""The hooks run in trainer workers on other machines: HTTP only, and never import slime."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import recorder.integrations
from tests.layers import imported_modules

ROOT = Path(recorder.integrations.__file__).parent
FORBIDDEN = ("recorder.server", "recorder.log.store")


def test_no_hook_imports_the_server_the_store_or_slime() -> None:
    files = sorted(ROOT.glob("*.py"))
    assert {p.name for p in files} >= {"common.py", "slime.py", "verl.py", "verl_outputs.py"}
    bad = {
        f"{path.name}: {name}"
        for path in files
        for name in imported_modules(path)
        if name.startswith(FORBIDDEN) or name.split(".")[0] == "slime"
    }
    assert not bad, bad


def test_importing_the_slime_hook_loads_no_server_module_and_no_verl() -> None:
    code = (
        "import sys, recorder.integrations.slime, recorder.integrations.verl_outputs\n"
        "print([m for m in sys.modules if m.startswith(('recorder.server', 'verl', 'torch'))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
