"""Start a test engine beside a test: in a background thread or a subprocess."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from .core import EngineCore, EngineServer

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadedEngine:
    """Runs an engine in its own event loop on a daemon thread.

    `make_core` is called inside that loop (asyncio objects bind to it).
    Use `call(fn, *args)` to run a control (e.g. `core.pause`) in that loop.
    """

    def __init__(self, make_core: Callable[[], EngineCore], *, port: int = 0) -> None:
        self._make_core = make_core
        self._port = port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.core: EngineCore | None = None
        self._server: EngineServer | None = None

    def start(self) -> str:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=120)

    async def _start(self) -> str:
        self.core = self._make_core()
        self._server = EngineServer(self.core, port=self._port)
        return await self._server.start()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        return self._server.url

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        done: Future[Any] = Future()

        def run() -> None:
            try:
                done.set_result(fn(*args))
            except BaseException as exc:
                done.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return done.result(timeout=60)

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(), self._loop).result(timeout=60)
            self._server = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> ThreadedEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_subprocess(
    args: list[str], *, port: int | None = None, timeout_s: float = 180
) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m tools.test_engine ARGS --port N`; returns (process, url) once /health is 200."""
    port = port or free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.test_engine", *args, "--port", str(port)],
        cwd=REPO_ROOT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, timeout_s=timeout_s, what=f"test engine {args}")
    return proc, url


def wait_until_healthy(
    proc: subprocess.Popen[bytes], url: str, *, timeout_s: float = 180, what: str = "engine"
) -> None:
    """Return once `url`/health answers 200; RuntimeError (`proc` terminated) if it
    exits or takes longer than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"{what} did not become healthy within {timeout_s}s")
