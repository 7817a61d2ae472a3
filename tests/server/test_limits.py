"""`recorder serve` and file descriptors / frozen engines (issue 24, item 6).

At a soft open-files limit of 1024 a busy recorder could not accept new agent
connections while asyncio logged a traceback for every failed accept; a
frozen engine held its turns for the old 10 s health-check timeout.
"""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from recorder.server import free_port
from tests.conftest import missing
from tests.server.conftest import FIXTURE_TOKENIZER
from tools.test_engine.scripted import ScriptedEngine

REPO = Path(__file__).resolve().parents[2]

# Uses up its open-files limit, then connects to its own server: every accept() of
# that connection fails with EMFILE, and asyncio retries it once a second.
EXHAUSTED_ACCEPT = textwrap.dedent(
    """
    import asyncio, logging, resource, socket, sys
    from recorder.server.limits import install_accept_throttle

    logging.basicConfig(stream=sys.stderr, level=logging.INFO)

    async def main():
        throttle = install_accept_throttle(asyncio.get_running_loop())
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))
        held = []
        try:
            while True:
                held.append(open("/dev/null"))
        except OSError:
            held.pop().close()  # room for the client's socket, none for the accept
        client = socket.create_connection(("127.0.0.1", port))
        for _ in range(300):
            if throttle.held_back >= 2:
                break
            await asyncio.sleep(0.1)
        print("held back", throttle.held_back, flush=True)
        client.close()
        server.close()

    asyncio.run(main())
    """
)


def test_accept_out_of_files_is_logged_once_per_interval_without_traceback() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", EXHAUSTED_ACCEPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    held_back = int(done.stdout.split()[-1])
    assert held_back >= 2  # asyncio reported the failed accept at least three times
    assert done.stderr.count("cannot accept new connections") == 1, done.stderr
    assert "Too many open files" in done.stderr
    assert "Traceback" not in done.stderr


async def test_other_loop_errors_still_reach_the_default_handler(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from recorder.server.limits import AcceptErrorThrottle

    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    now = [0.0]
    throttle = AcceptErrorThrottle(interval_s=10, clock=lambda: now[0])
    loop.set_exception_handler(throttle)
    try:
        with caplog.at_level("ERROR"):
            accept = {
                "message": "socket.accept() out of system resource",
                "exception": OSError(24, "Too many open files"),
            }
            for _ in range(1000):
                loop.call_exception_handler(accept)
            now[0] = 10.0
            loop.call_exception_handler(accept)
            loop.call_exception_handler({"message": "Task exception was never retrieved"})
    finally:
        loop.set_exception_handler(previous)
    reports = [r for r in caplog.records if "cannot accept" in r.getMessage()]
    assert len(reports) == 2
    assert "999 more such errors" in reports[1].getMessage()
    assert all(r.exc_info is None for r in reports)
    assert any(r.name == "asyncio" and "never retrieved" in r.getMessage() for r in caplog.records)


def _soft_nofile(pid: int) -> tuple[str, str]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return soft, hard
    raise AssertionError("no open-files line in /proc/<pid>/limits")


async def test_serve_raises_its_open_files_limit_and_drops_a_frozen_engine(
    tokenizer: Any, tmp_path: Path
) -> None:
    """A low soft limit at launch is raised to the hard one; an engine whose /health
    never answers is marked down by checks bounded by --engine-health-timeout."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        missing(f"hard open-files limit {hard}: nothing to raise", "raise it with `ulimit -Hn`")
    closed_checks: list[int] = []

    async def frozen(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # reads the request, never answers, until the client gives up
        closed_checks.append(1)
        writer.close()

    frozen_server = await asyncio.start_server(frozen, "127.0.0.1", 0)
    frozen_url = f"http://127.0.0.1:{frozen_server.sockets[0].getsockname()[1]}"
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    async with ScriptedEngine(tokenizer, context_length=4096) as engine:
        proc = subprocess.Popen(
            ["bash", "-c", 'ulimit -Sn 256 && exec "$@"', "bash",  # a low soft limit at launch
             sys.executable, "-m", "recorder.cli", "serve", "--db", str(tmp_path / "r.db"),
             "--engine", engine.url, "--engine", frozen_url, "--context-length", "4096",
             "--model-name", "m", "--tokenizer", str(FIXTURE_TOKENIZER),
             "--chat-template", "chatml-tools", "--tool-parser", "qwen25",
             "--port", str(port), "--engine-health-interval", "0.2",
             "--engine-health-timeout", "0.5"],
            env={**os.environ, "PYTHONPATH": str(REPO), "TR_ADMIN_TOKEN": "tok"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            down: list[str] = []
            async with aiohttp.ClientSession() as http:
                for _ in range(600):
                    if proc.poll() is not None:
                        break
                    try:
                        async with http.get(base + "/health") as resp:
                            down = (await resp.json())["engines_down"]
                    except aiohttp.ClientError:
                        pass
                    if down == [frozen_url] and len(closed_checks) >= 2:
                        break
                    await asyncio.sleep(0.05)
            assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
            soft_now, hard_now = _soft_nofile(proc.pid)
            assert soft_now == hard_now != "256"
            assert down == [frozen_url]
            assert len(closed_checks) >= 2  # each check gave up on the frozen engine
        finally:
            proc.terminate()
            output = proc.communicate(timeout=30)[0].decode()
            frozen_server.close()
    assert "open-files limit raised from 256" in output
