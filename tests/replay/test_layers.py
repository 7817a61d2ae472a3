"""The layering DESIGN.md promises, enforced: the reducer is pure, replay is offline.

- The reducer's modules import nothing that reads a clock, draws randomness or
  does I/O, so the same log always gives the same bytes.
- Importing the replay CLI loads neither the live server nor the engine
  client (or aiohttp): reclassifying a log needs no serving stack.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PURE = ["turns", "chains", "segments", "reducer", "placeholders", "samples", "packed"]
IMPURE = {"time", "random", "datetime", "os", "uuid", "asyncio", "socket", "secrets"}


@pytest.mark.parametrize("module", PURE)
def test_reducer_modules_import_no_clock_randomness_or_io(module: str) -> None:
    tree = ast.parse((REPO / "replay" / f"{module}.py").read_text())
    imported = {
        name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        )
    }
    assert not imported & IMPURE, f"replay/{module}.py imports {sorted(imported & IMPURE)}"
    text = (REPO / "replay" / f"{module}.py").read_text()
    assert "recorder.server" not in text and "recorder.model.engine" not in text


def test_replay_cli_loads_no_server_or_engine() -> None:
    code = (
        "import sys, replay.cli, replay.reclassify, replay.reducer\n"
        "bad = [m for m in ('recorder.server', 'recorder.model.engine', 'aiohttp') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ""


def test_samples_and_reducer_load_no_storage_stack() -> None:
    """Trainer hooks read `replay.samples` inside Ray workers: no SQLAlchemy, no store."""
    code = (
        "import sys, replay.samples, replay.reducer, replay.placeholders\n"
        "bad = [m for m in ('sqlalchemy', 'recorder.log.store', 'aiohttp') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ""
