"""Fixtures for the rollout tests: a sandbox backend per parameter, E2B's doubles on loopback.

`backend` is parametrised over every sandbox backend, the way `store_url` is
over databases: a test that takes it (or `sandbox`) runs once per backend. The
E2B backend runs the real SDK against `E2BDoubles` (tests/rollout/e2b_doubles.py),
so it needs no cloud key and is never skipped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sandbox_backends import Backend

from recorder.rollout.sandbox import Sandbox, open_sandbox
from tests.conftest import missing, sandbox_reachable_tmp_path

if TYPE_CHECKING:
    from e2b_doubles import E2BDoubles


async def _start_doubles(root: Path) -> E2BDoubles:
    """The doubles, imported on demand: the E2B SDK is an extra (dev and CI install it)."""
    try:
        from e2b_doubles import E2BDoubles
    except ImportError as exc:
        missing(f"the E2B SDK is not installed ({exc})", "pip install -e '.[e2b]'")

    doubles = E2BDoubles(root)
    await doubles.start()
    return doubles


@pytest.fixture(params=["local", "e2b"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """Every sandbox backend in turn; for e2b, the doubles it talks to."""
    (tmp_path / "local").mkdir()
    if request.param == "local":
        yield Backend("local", tmp_path)
        return
    doubles = await _start_doubles(tmp_path / "local")
    try:
        yield Backend("e2b", tmp_path, doubles)
    finally:
        await doubles.close()


@pytest.fixture
async def sandbox(backend: Backend) -> AsyncIterator[Sandbox]:
    """A running sandbox (env TR_SUITE=yes), killed afterwards."""
    async with await open_sandbox(
        backend.spec(env={"TR_SUITE": "yes"}, metadata={"suite": "sandbox"})
    ) as sb:
        yield sb


@pytest.fixture
async def e2b_doubles(tmp_path: Path) -> AsyncIterator[E2BDoubles]:
    """E2B's API and envd doubles alone, for the E2B-only tests."""
    doubles = await _start_doubles(tmp_path)
    try:
        yield doubles
    finally:
        await doubles.close()


@pytest.fixture
def tmp_path(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A temporary directory local sandboxes' own users can reach (tests run as root)."""
    yield from sandbox_reachable_tmp_path(request.node.name)
