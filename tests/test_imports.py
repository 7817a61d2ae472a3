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


# The layers, bottom up (DESIGN.md "Where things live"): a module may import its
# own layer and the layers below it, never one above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("recorder.redact", "recorder.admin_token"),  # leaves every layer shares
    ("recorder.log",),  # event schema, ids, stores
    ("recorder.dialects",),  # wire formats and the turn model they translate into
    ("recorder.model",),  # tokenizer, templates, token chains, parsers, engine client
    ("replay",),  # the pure reducer, rules, samples; offline commands
    ("recorder.server",),  # the live recorder (closes sessions through replay)
    ("recorder.rollout",),  # the driver: an HTTP client of the server
    ("recorder.integrations",),  # trainer hooks on top of the driver
    ("recorder.cli", "recorder"),  # the command line, the package itself
)


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the longest prefix naming `module`'s layer (None: not ours)."""
    best: tuple[int, int] | None = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[0]
            ):
                best = (len(prefix), index)
    return None if best is None else best[1]


def upward_imports(files: list[Path]) -> list[str]:
    """`file: imported module` for each import of a layer above the file's own."""
    from tests.layers import imported_modules

    bad = []
    for path in files:
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        own = layer_of(module)
        assert own is not None, f"{module} is in no layer: add it to LAYERS"
        for name in sorted(imported_modules(path)):
            theirs = layer_of(name)
            if theirs is not None and theirs > own:
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    return bad


def test_no_module_imports_a_layer_above_its_own() -> None:
    files = sorted(p for package in ("recorder", "replay") for p in (ROOT / package).rglob("*.py"))
    assert len(files) > 80
    assert upward_imports(files) == []


def test_the_layer_check_catches_an_upward_import(tmp_path: Path) -> None:
    """Fed a store module that imports the server, the check reports it."""
    bad = ROOT / "recorder" / "log" / "store" / "_upward_probe.py"
    bad.write_text("from recorder.server.app import RecorderServer\nimport recorder.model.tokens\n")
    try:
        assert upward_imports([bad]) == [
            "recorder/log/store/_upward_probe.py: recorder.model.tokens",
            "recorder/log/store/_upward_probe.py: recorder.server.app",
        ]
    finally:
        bad.unlink()
