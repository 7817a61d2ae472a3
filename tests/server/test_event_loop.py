"""`recorder serve --loop`: which event loop the server runs on."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import pytest
from click.testing import CliRunner

from recorder.server.commands import event_loop_factory, serve
from tests.conftest import missing


def test_asyncio_loop_is_the_default_factory() -> None:
    assert event_loop_factory("asyncio") is None


def test_uvloop_and_auto_pick_uvloop_when_installed() -> None:
    if importlib.util.find_spec("uvloop") is None:
        missing("uvloop is not installed", "pip install uvloop==0.22.1")
    import uvloop

    for kind in ("uvloop", "auto"):
        factory = event_loop_factory(kind)
        assert factory is not None
        loop = factory()
        try:
            assert isinstance(loop, uvloop.Loop)
            assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
        finally:
            loop.close()


def test_auto_falls_back_to_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert event_loop_factory("auto") is None
    with pytest.raises(ImportError):
        event_loop_factory("uvloop")


def test_serve_offers_the_loop_choice() -> None:
    out = CliRunner().invoke(serve, ["--help"]).output
    assert "--loop [auto|asyncio|uvloop]" in out
