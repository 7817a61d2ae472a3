"""`recorder serve --workers N`: N server processes on one port, one CPU core each.

One Python process runs its turns on one core (the GIL), so a recorder that
is one process caps a deployment at one core. With `--workers N` the command
forks N workers after checking its arguments; each runs the whole server
(its own event loop, engine client, store connections and session cache) and
listens on the same port with SO_REUSEPORT, so the kernel spreads new
connections across them. A session's turns may then reach different workers:
they are replicas on one store, which is what Postgres's per-session locks
make correct (README, "Deployment: replicas on one Postgres"). SQLite has one
writer per file, so workers need Postgres.

The parent only supervises: SIGTERM / SIGINT are passed on to every worker
(each stops gracefully, flushing its log); if a worker dies on its own the
others are stopped too and the command fails, so a supervisor (systemd, k8s)
restarts the whole unit rather than run at a fraction of its capacity.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

import sqlalchemy as sa

log = logging.getLogger("recorder.server")


def check_workers(workers: int, db_url: str, port: int) -> str | None:
    """Why `--workers` cannot be used with this store and port, or None."""
    from recorder.log.store import normalize_url

    if workers < 1:
        return "--workers must be at least 1"
    if workers == 1:
        return None
    if sa.make_url(normalize_url(db_url)).get_backend_name() == "sqlite":
        return (
            f"--workers {workers} needs a Postgres --db (postgresql+asyncpg://...): SQLite has "
            "one writer per file, so one worker serves it. Run one worker per SQLite file, "
            "or move the log to Postgres"
        )
    if port == 0:
        return "--workers needs a fixed --port: the workers share it"
    return None


def run_workers(workers: int, serve_one: Callable[[], int]) -> int:
    """Fork `workers` processes that each return `serve_one()`; wait for all of them.

    Returns 0 when every worker stopped cleanly after a signal, else the first
    failing worker's exit status.
    """
    children: list[int] = []
    stopping = False

    def forward(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for pid in children:
            _signal(pid, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for index in range(workers):
            pid = os.fork()
            if pid == 0:  # the worker: default signal handling, then the server
                for s, handler in previous.items():
                    signal.signal(s, handler)
                status = 1
                try:
                    status = serve_one()
                except SystemExit as exc:
                    status = exc.code if isinstance(exc.code, int) else 1
                except BaseException:
                    log.exception("worker %d failed", index)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(status)
            children.append(pid)
        log.info("%d workers on one port: pids %s", workers, " ".join(map(str, children)))
        return _wait(children, lambda: stopping)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wait(children: list[int], stopping: Callable[[], bool]) -> int:
    """Reap the workers; the first one to fail unasked stops the rest."""
    status = 0
    failing = False
    live = set(children)
    while live:
        try:
            pid, raw = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        live.discard(pid)
        code = os.waitstatus_to_exitcode(raw)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
        if not stopping() and not failing and live:
            log.error("worker %d exited (status %d): stopping the other workers", pid, code)
            failing = True
            status = status or 1
            for other in live:
                _signal(other, signal.SIGTERM)
    return status


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it already exited
        os.kill(pid, signum)
