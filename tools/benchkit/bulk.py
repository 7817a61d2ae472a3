"""One big body sent to a fresh `recorder serve`: its peak RSS and time to answer.

Each measurement gets its own server process: a heap that already grew for
an earlier body would hide the next one's peak (freed memory stays
resident). The peak is the kernel's own (`VmHWM`, reset through
`/proc/PID/clear_refs` just before the body is sent), so no sampling can
miss it. `src` selects the recorder's source tree, so a benchmark can run
another checkout (the code before a change) in the same run.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import msgspec

from tools.benchkit.bodies import bulk_body
from tools.benchkit.engine import TOKENIZER
from tools.benchkit.memory import status_bytes
from tools.benchkit.procs import REPO
from tools.benchkit.wire import open_session, wait_healthy
from tools.test_engine.launch import free_port

ADMIN = "bulk"


class Measured(msgspec.Struct, frozen=True):
    """What one body cost the server: answer status, seconds to answer (the median of
    `reps` sends), peak RSS gain of the first send, body bytes."""

    kind: str
    status: int
    seconds: float
    reps: int
    peak_bytes: int
    body_bytes: int
    message: str


class BulkServer:
    """`recorder serve` from `src` with `context_length`, in front of `engine_url`."""

    def __init__(self, engine_url: str, context_length: int, src: Path = REPO) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="bulk_")
        self.url = f"http://127.0.0.1:{free_port()}"
        env = {**os.environ, "PYTHONPATH": str(src)}
        args = [
            "--db", f"{self._tmp.name}/r.db", "--engine", engine_url,
            "--tokenizer", str(TOKENIZER), "--chat-template", "chatml-tools",
            "--tool-parser", "qwen25", "--port", self.url.rsplit(":", 1)[1],
            "--admin-token", ADMIN, "--context-length", str(context_length),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "recorder.cli", "serve", *args],
            cwd=src,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def reset_peak(self) -> int:
        """Reset the kernel's peak RSS of the server to its RSS now; that RSS."""
        with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
            f.write("5")
        return status_bytes("VmRSS", self.proc.pid)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self._tmp.cleanup()


async def send(
    http: aiohttp.ClientSession, url: str, route: str, sid: str, raw: bytes
) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {sid}", "content-type": "application/json"}
    async with http.post(url + route, data=raw, headers=headers) as resp:
        return resp.status, await resp.read()


async def measure(
    engine_url: str,
    context_length: int,
    kinds: list[tuple[str, int]],
    src: Path = REPO,
    *,
    concurrent: bool = False,
    reps: int = 1,
) -> list[Measured]:
    """Each (kind, characters) body on its own fresh server (or, `concurrent`, all of
    them at once on one server: one result with the summed body size); the peak is
    the first send's, the time the median of `reps` sends (each from a new session)."""
    results = []
    groups = [kinds] if concurrent else [[k] for k in kinds]
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for group in groups:
            server = BulkServer(engine_url, context_length, src)
            try:
                await wait_healthy(http, server.url, server.proc.poll, "the recorder")
                bodies = [bulk_body(kind, n) for kind, n in group]
                times, peak = [], 0
                for rep in range(reps):
                    sids = [await open_session(http, server.url, ADMIN) for _ in bodies]
                    base = server.reset_peak()
                    start = time.perf_counter()
                    answers = await asyncio.gather(
                        *(
                            send(http, server.url, r, s, raw)
                            for (r, raw), s in zip(bodies, sids, strict=True)
                        )
                    )
                    times.append(time.perf_counter() - start)
                    if rep == 0:
                        peak = status_bytes("VmHWM", server.proc.pid) - base
            finally:
                server.close()
            status, text = answers[0]
            results.append(
                Measured(
                    kind=" + ".join(k for k, _ in group),
                    status=status,
                    seconds=statistics.median(times),
                    reps=reps,
                    peak_bytes=peak,
                    body_bytes=sum(len(raw) for _, raw in bodies),
                    message=text.decode(errors="replace")[:300],
                )
            )
    return results
