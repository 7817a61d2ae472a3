"""`recorder rollout`: run every task of a JSONL file N times through the driver.

    recorder rollout --tasks tasks.jsonl --engine URL [--recorder URL | --db runs.db]
        --sandbox local|e2b --samples-per-task 4 --concurrency 8 --out samples.jsonl

Without `--recorder` it starts its own `recorder serve` on `--db` as a
subprocess (a random admin token, a free loopback port) and stops it at the
end; it dies with this CLI even on `kill -9` (a parent-death signal). Each
finished rollout is appended to `--out` at once (one JSON object a line: the
task, the outcome and the samples), so an interrupted run keeps what it
finished. Ctrl-C (or SIGTERM) stops cleanly: agents are killed, sandboxes
removed and open sessions closed `aborted`; those rollouts are written to
`--out` too (infra cause `cancelled`), so it agrees with `replay export`.

With `--ray [ADDRESS]` each rollout is a task on that Ray cluster
(recorder/rollout/cluster.py), in the sandbox of the node it lands on: the same
progress, `--out`, summary and Ctrl-C cleanup; a rollout whose node dies is
infra cause `node_lost`. Without it Ray is not imported.

Sandboxes get none of this process's environment beyond the basics
(sandbox/environment.py); `--sandbox-env KEY=VALUE` and `--agent-env
KEY=VALUE` pass the rest on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import logging
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import aiohttp
import click
import msgspec
from click.core import ParameterSource

from recorder.admin_token import AdminTokenError, read_token_file
from recorder.rollout.agent import AgentSpec, local_binary
from recorder.rollout.driver import RolloutRequest, RolloutResult, run_group
from recorder.rollout.protect import unprotected_reason
from recorder.rollout.sandbox import SandboxSpec
from recorder.rollout.sandbox.environment import parse_assignments
from recorder.rollout.sandbox.users import is_root
from recorder.rollout.tasks import Task, load_tasks

if TYPE_CHECKING:
    from recorder.rollout.cluster import RayOptions

log = logging.getLogger("recorder.rollout")


class OutputLine(msgspec.Struct, kw_only=True):
    """One line of `--out`: a finished rollout."""

    instance_id: str
    group_index: int
    sample_index: int
    result: RolloutResult


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: the rollouts were stopped and cleaned up."""


@dataclass
class Tally:
    """Counts for the progress bar and the summary."""

    total: int
    running: int = 0
    results: list[RolloutResult] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    @property
    def infra(self) -> int:
        return sum(r.outcome == "infra_error" for r in self.results)

    @property
    def mean_reward(self) -> float:
        return statistics.fmean(r.reward for r in self.results) if self.results else 0.0

    @property
    def tokens(self) -> int:
        return sum(trained_tokens(r) for r in self.results)

    def line(self) -> str:
        failed = sum(r.outcome == "failed" for r in self.results)
        return (
            f"done {len(self.results)}/{self.total}  failed {failed}  infra {self.infra}  "
            f"running {self.running}  mean reward {self.mean_reward:.3f}  "
            f"trained tokens {self.tokens}"
        )


def trained_tokens(result: RolloutResult) -> int:
    return sum(sum(s.loss_mask) for s in result.samples)


def build_requests(
    tasks: Sequence[Task], samples_per_task: int, base: RolloutRequest
) -> list[RolloutRequest]:
    """Task i is GRPO group i; its samples are 0..N-1."""
    return [
        msgspec.structs.replace(base, task=task, group_index=g, sample_index=s)
        for g, task in enumerate(tasks)
        for s in range(samples_per_task)
    ]


# --------------------------------------------------------------------------
# Its own recorder, as a subprocess
# --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def own_recorder(
    db: str, engines: Sequence[str], serve_args: Sequence[str], log_file: IO[bytes]
) -> AsyncIterator[tuple[str, str]]:
    """`recorder serve` on a free port; yields (url, admin token); SIGTERM at the end."""
    port, token = _free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "recorder.cli", "serve", "--db", db, "--port", str(port)]
    for engine in engines:
        cmd += ["--engine", engine]
    cmd += list(serve_args)
    env = {**os.environ, "TR_ADMIN_TOKEN": token}  # not on the command line (ps shows it)
    # Its own session: a terminal's Ctrl-C must reach only this CLI, which closes the
    # sessions through the recorder first and stops it last. A parent-death signal ties
    # it to this process: `kill -9` of the CLI must not leave it serving (and holding
    # the database) forever.
    proc = subprocess.Popen(
        cmd,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent(os.getpid()),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_healthy(proc, url, timeout_s=120)
        yield url, token
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 60)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> Any:
    """A preexec_fn: SIGTERM the child when the thread that started it dies (Linux).

    The child checks its parent afterwards: if the parent died before the prctl,
    the signal would never come, so it exits at once. Elsewhere: no-op.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


async def _wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise click.ClickException(
                    f"recorder serve exited with code {proc.returncode}; see its log"
                )
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with http.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise click.ClickException(f"recorder serve did not answer {url}/health in {timeout_s:g}s")


# --------------------------------------------------------------------------
# Running and reporting
# --------------------------------------------------------------------------


async def run_all(
    reqs: list[RolloutRequest],
    concurrency: int,
    out: IO[bytes],
    tally: Tally,
    show: bool,
    ray: RayOptions | None = None,
) -> Tally:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("rollouts"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        disable=not show,
        transient=False,
    )
    bar = progress.add_task(tally.line(), total=len(reqs))

    def started(i: int) -> None:
        tally.running += 1
        progress.update(bar, description=tally.line())

    def finished(i: int, result: RolloutResult) -> None:
        tally.running -= 1
        tally.results.append(result)
        req = reqs[i]
        line = OutputLine(
            instance_id=req.task.instance_id,
            group_index=req.group_index,
            sample_index=req.sample_index,
            result=result,
        )
        out.write(msgspec.json.encode(line) + b"\n")
        out.flush()
        progress.update(bar, advance=1, description=tally.line())

    with progress:
        await run_group(
            reqs, concurrency=concurrency, on_start=started, on_result=finished, ray=ray
        )
    return tally


def is_loopback_url(url: str) -> bool:
    """Does `url` name this machine only (localhost, 127.0.0.0/8, ::1)?"""
    from urllib.parse import urlsplit

    host = (urlsplit(url).hostname or "").strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unprotected_reasons(tasks: list[Task], most: int = 3) -> list[str]:
    """A warning per task whose tests the agent could rewrite (`unprotected_reason`),
    the first `most` of them and a count of the rest."""
    reasons = [r for r in map(unprotected_reason, tasks) if r is not None]
    if len(reasons) > most:
        reasons[most:] = [f"... and {len(reasons) - most} more tasks like these"]
    return reasons


def start_warnings(
    backend: str,
    recorder_url: str | None,
    agent_base_url: str | None,
    options: dict[str, str],
    ray_address: str | None = None,
    node_recorder_url: str | None = None,
) -> list[str]:
    """What the user should know before the run starts (each a sentence with its fix)."""
    warnings = []
    seen_by_nodes = node_recorder_url or recorder_url
    if ray_address not in (None, "local") and (
        seen_by_nodes is None or is_loopback_url(seen_by_nodes)
    ):
        warnings.append(
            f"--ray {ray_address}: the nodes would reach the recorder at "
            f"{seen_by_nodes or 'http://127.0.0.1 (its own recorder)'}, a loopback address: "
            "only nodes on this machine can; give --recorder (or --ray-recorder-url) a URL "
            "every node reaches, e.g. the load balancer of the recorder replicas"
        )
    if backend == "e2b":
        seen_by_agent = agent_base_url or recorder_url
        if seen_by_agent is None or is_loopback_url(seen_by_agent):
            seen_by_agent = seen_by_agent or "http://127.0.0.1 (its own recorder)"
            warnings.append(
                f"--sandbox e2b: the agent would reach the recorder at {seen_by_agent}, a "
                "loopback address of this machine that an E2B sandbox in the cloud cannot "
                "reach (every rollout would fail agent_failed); give --agent-base-url a "
                "public URL of the recorder"
            )
    elif options.get("user", "auto") != "driver" and not is_root():
        warnings.append(
            "local sandboxes run as this user, not as unprivileged users of their own "
            "(that takes root): an agent can read what this user can, e.g. the recorder's "
            "admin token file, and forge its reward; run as root, or use --sandbox e2b"
        )
    return warnings


def summary(tally: Tally, interrupted: bool) -> Any:
    from rich.table import Table

    results = tally.results
    table = Table(title="rollout summary" + (" (interrupted)" if interrupted else ""))
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("rollouts finished", f"{len(results)} of {tally.total}")
    outcomes = Counter(r.outcome for r in results)
    for outcome in ("passed", "failed", "infra_error"):
        table.add_row(f"  {outcome}", str(outcomes.get(outcome, 0)))
    for cause, n in sorted(Counter(r.infra_cause for r in results if r.infra_cause).items()):
        table.add_row(f"    infra: {cause}", str(n))
    rewards = Counter(r.reward for r in results)
    table.add_row(
        "reward distribution", "  ".join(f"{v:g}: {n}" for v, n in sorted(rewards.items())) or "-"
    )
    table.add_row("mean reward", f"{tally.mean_reward:.3f}")
    if results:
        table.add_row("turns / rollout (mean)", f"{statistics.fmean(r.turns for r in results):.1f}")
        tokens = [trained_tokens(r) for r in results]
        table.add_row("trained tokens / rollout (mean)", f"{statistics.fmean(tokens):.0f}")
        table.add_row("samples", str(sum(len(r.samples) for r in results)))
    table.add_row("wall time", f"{time.perf_counter() - tally.started:.1f} s")
    return table


def private_append(path: str | Path) -> IO[bytes]:
    """`path` opened to append, readable by its owner only (made 0600, or made so).

    `--out` holds every rollout's session id, reward and diff, and the recorder's log
    names every session id, an agent's bearer key: world-readable, they let a local
    sandbox's agent run turns in its siblings' sessions or copy a passing diff (an
    audit did both)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


def ray_options(o: dict[str, Any]) -> RayOptions | None:
    """The --ray* options (None without --ray: Ray is then never imported)."""
    if o["ray_address"] is None:
        return None
    from recorder.rollout.cluster import RayOptions

    return RayOptions(
        address=o["ray_address"] or None,
        cpus=o["ray_cpus"],
        resource=o["ray_resource"],
        recorder_url=o["ray_recorder_url"],
        node_dir=o["ray_node_dir"] or None,
    )


def admin_token(o: dict[str, Any]) -> str | None:
    """The --recorder's token: refused from the command line for local sandboxes.

    Every user of the machine may read a process's command line
    (`/proc/<pid>/cmdline`), a local sandbox's own user included: with the
    driver's token it could close its own session with any reward.
    """
    source = click.get_current_context().get_parameter_source("admin_token")
    if o["admin_token"] and source is ParameterSource.COMMANDLINE and o["sandbox"] == "local":
        raise click.ClickException(
            "--admin-token on the command line shows in this process's command line, which "
            "every local sandbox can read (and close its own session with any reward): set "
            "TR_ADMIN_TOKEN or pass --admin-token-file"
        )
    if o["admin_token_file"] is not None:
        try:
            return read_token_file(o["admin_token_file"])
        except AdminTokenError as exc:
            raise click.ClickException(str(exc)) from None
    return o["admin_token"]  # type: ignore[no-any-return]


@click.command("rollout")
@click.option("--tasks", "tasks_file", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--repo-mirrors",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Local clones for `owner/name` repos (DIR/owner__name or DIR/owner/name).",
)
@click.option("--engine", "engines", multiple=True, help="SGLang URL (for its own recorder).")
@click.option("--recorder", "recorder_url", help="A running recorder (else one starts on --db).")
@click.option("--db", default="runs.db", show_default=True, help="Event log of its own recorder.")
@click.option(
    "--admin-token",
    envvar="TR_ADMIN_TOKEN",
    help="The --recorder's admin token; from TR_ADMIN_TOKEN or --admin-token-file with "
    "local sandboxes: on the command line it shows in the process list they can read.",
)
@click.option(
    "--admin-token-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A 0600 file holding the --recorder's admin token (default: the file a recorder "
    "on this machine wrote).",
)
@click.option("--agent-base-url", help="The recorder as the sandbox reaches it (e2b: public).")
@click.option("--sandbox", type=click.Choice(["local", "e2b"]), default="local", show_default=True)
@click.option("--e2b-template", default=None, help="E2B template (needs node/npm and git).")
@click.option(
    "--sandbox-env",
    "sandbox_env",
    multiple=True,
    metavar="KEY=VALUE",
    help="A variable every sandbox command gets (nothing else of this environment does).",
)
@click.option(
    "--agent-env",
    "agent_env",
    multiple=True,
    metavar="KEY=VALUE",
    help="A variable the agent's command gets, on top of the recorder's.",
)
@click.option(
    "--sandbox-option",
    "sandbox_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="Backend option (local: root=DIR, max_processes=N; e2b: api_url=..., domain=...).",
)
@click.option("--samples-per-task", type=int, default=4, show_default=True)
@click.option("--concurrency", type=int, default=8, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default="samples.jsonl", show_default=True)
@click.option("--wall-budget", type=float, default=1800.0, show_default=True, help="s / rollout")
@click.option("--turn-budget", type=int, default=None, help="Engine calls per rollout.")
@click.option("--temperature", type=float, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--top-k", type=int, default=None)
@click.option("--max-new-tokens", type=int, default=None)
@click.option("--agent-command", default=None, help="Agent command template (see AgentSpec).")
@click.option("--agent-binary", default=None, help="The agent CLI inside the sandbox.")
@click.option(
    "--compact-at",
    type=click.FloatRange(0.0, 1.0, min_open=False),
    default=0.8,
    show_default=True,
    help="Claude Code compacts at this share of the recorder's context length (0: leave it).",
)
@click.option("--tokenizer", default=None, help="Own recorder: tokenizer (recorder serve).")
@click.option("--chat-template", default=None, help="Own recorder: chat template.")
@click.option("--tool-parser", default=None, help="Own recorder: tool-call parser.")
@click.option("--reasoning-parser", default=None, help="Own recorder: reasoning parser.")
@click.option("--context-length", type=int, default=None, help="Own recorder: context length.")
@click.option("--no-progress", is_flag=True, help="No progress bar (logs only).")
@click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[ADDRESS]",
    help="Run each rollout as a task on this Ray cluster (bare: ray.init's default: "
    "RAY_ADDRESS, else the cluster `ray start` began on this machine, else a new local one).",
)
@click.option("--ray-cpus", type=float, default=1.0, show_default=True, help="CPUs / rollout.")
@click.option("--ray-resource", default=None, help="Custom resource each rollout takes 1 of.")
@click.option("--ray-recorder-url", default=None, help="The recorder as Ray nodes reach it.")
@click.option(
    "--ray-node-dir",
    default=None,
    help="Node-local dir for repositories and the agent CLI ({node_id}: the Ray node's id; "
    "default /var/lib/trajectory-recorder/node on a root node, else ~/.cache/...). Only root "
    "or the node's user may write it and every directory above it.",
)
def rollout(**o: Any) -> None:
    """Run agent rollouts of a task file through the recorder; write their samples."""
    tasks, errors = load_tasks(o["tasks_file"], mirrors=o["repo_mirrors"])
    for err in errors:
        click.echo(click.style("skipping ", fg="yellow") + f"{o['tasks_file']}: {err}", err=True)
    if not tasks:
        raise click.ClickException(f"no valid task in {o['tasks_file']}")
    for reason in unprotected_reasons(tasks):
        click.echo(click.style("warning: ", fg="yellow") + reason, err=True)
    if o["recorder_url"] is None and not o["engines"]:
        raise click.ClickException("give --recorder URL, or --engine URL to start a recorder")
    o["admin_token"] = admin_token(o)
    if o["recorder_url"] is None and o["tokenizer"] is None:
        raise click.ClickException("its own recorder needs --tokenizer (as recorder serve does)")
    sampling = {
        k: o[k] for k in ("temperature", "top_p", "top_k", "max_new_tokens") if o[k] is not None
    }
    try:
        sandbox_env = parse_assignments(o["sandbox_env"], option="--sandbox-env")
        agent_env = parse_assignments(o["agent_env"], option="--agent-env")
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    agent = AgentSpec(
        **({"command": o["agent_command"]} if o["agent_command"] else {}),
        binary=o["agent_binary"] or (local_binary() if o["sandbox"] == "local" else None),
        compact_at=o["compact_at"] or None,
        env=agent_env,
    )
    options = dict(opt.split("=", 1) for opt in o["sandbox_options"] if "=" in opt)
    if len(options) != len(o["sandbox_options"]):
        raise click.ClickException("--sandbox-option takes KEY=VALUE")
    sandbox = SandboxSpec(
        backend=o["sandbox"], template=o["e2b_template"], options=options, env=sandbox_env
    )
    ray = ray_options(o)
    for warning in start_warnings(
        o["sandbox"],
        o["recorder_url"],
        o["agent_base_url"],
        options,
        ray_address=None if ray is None else (ray.address or "local"),
        node_recorder_url=o["ray_recorder_url"],
    ):
        click.echo(click.style("warning: ", fg="yellow") + warning, err=True)
    interrupted = False
    tally: Tally | None = None

    async def main() -> Tally:
        serve_args = [
            arg
            for name in ("tokenizer", "chat_template", "tool_parser", "reasoning_parser")
            if o[name]
            for arg in (f"--{name.replace('_', '-')}", o[name])
        ]
        if o["context_length"]:
            serve_args += ["--context-length", str(o["context_length"])]
        with private_append(o["out"]) as out, contextlib.ExitStack() as stack:
            if o["recorder_url"]:
                url, token = o["recorder_url"], o["admin_token"]
                return await _run(url, token, out)
            log_path = Path(o["db"]).with_suffix(".serve.log")
            log_file = stack.enter_context(private_append(log_path))
            click.echo(f"starting recorder serve on {o['db']} (log: {log_path})", err=True)
            async with own_recorder(o["db"], o["engines"], serve_args, log_file) as (url, token):
                return await _run(url, token, out)

    async def _run(url: str, token: str | None, out: IO[bytes]) -> Tally:
        nonlocal tally
        base = RolloutRequest(
            task=tasks[0],
            recorder_url=url,
            agent_base_url=o["agent_base_url"],
            admin_token=token,
            sampling=sampling,
            sandbox=sandbox,
            agent=agent,
            wall_budget_s=o["wall_budget"],
            turn_budget=o["turn_budget"],
        )
        reqs = build_requests(tasks, o["samples_per_task"], base)
        tally = Tally(total=len(reqs))
        if ray is not None:
            from recorder.rollout.cluster import OpenCluster, connect, refuse_open_cluster

            ray_module = connect(ray)  # before the signal handlers: ray.init sets a SIGTERM one
            try:
                refuse_open_cluster(ray_module, [sandbox.backend])
            except OpenCluster as exc:
                raise click.ClickException(str(exc)) from exc
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        work = asyncio.ensure_future(
            run_all(reqs, o["concurrency"], out, tally, not o["no_progress"], ray)
        )
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not work.done():
            click.echo("stopping: killing agents, removing sandboxes, closing sessions", err=True)
            work.cancel()  # run_group waits for every rollout's cleanup
            await asyncio.wait({work})
            raise Interrupted
        return work.result()

    try:
        tally = asyncio.run(main())
    except (Interrupted, KeyboardInterrupt):
        interrupted = True
        click.echo(
            "interrupted: agents killed, sandboxes removed, sessions closed aborted", err=True
        )
    from rich.console import Console

    if tally is not None:
        Console(stderr=False).print(summary(tally, interrupted))
    click.echo(f"samples: {os.path.abspath(o['out'])}")
    if interrupted:
        sys.exit(130)
