"""Rollout driver overhead: `python -m tools.bench_rollout [--rollouts 32] [--concurrency 8]`.

Runs the shipped tasks (tools/tasks) through `run_group` on the local sandbox
with the real Claude Code CLI, against `recorder serve` and the scripted task
engine (both subprocesses, as in production). Per rollout, the driver's
overhead is the time spent in neither the agent (which includes the engine)
nor the evaluation: total - agent - eval, i.e. sandbox boot, checkout, CLI
probe, diff, events and close over HTTP, and cleanup. Target: under 5% of the
rollout's wall time.

Peer column, measured in the same run: a bare pipeline doing the same work
with plain subprocesses (git clone, the same CLI and env, git diff, a fresh
clone, git apply, the grader) and no recorder events, sandbox abstraction or
session bookkeeping. Its "overhead" is the same total - agent - eval.

Afterwards it counts leaks: sandbox directories left under the bench's root
and processes whose working directory is still inside it (target: 0).

`--ray-nodes N` adds a column, same run, same requests: the rollouts as Ray
tasks (`run_group(..., ray=...)`) on a Ray cluster of N nodes on this machine
(`ray.cluster_utils.Cluster`, concurrency/N CPUs each; its start-up is not
counted). Its extra row, "dispatch", is per rollout the time the driver saw
(submitted to result) minus the rollout's own total on its node: Ray's
scheduling, the request and result through the object store, the node's setup.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import click

from recorder.rollout.agent import AgentSpec, agent_command, local_binary, parse_agent_result
from recorder.rollout.cli import own_recorder
from recorder.rollout.driver import RolloutRequest, RolloutResult, run_group
from recorder.rollout.evaluate import grader_command
from recorder.rollout.sandbox import SandboxSpec
from recorder.rollout.sandbox.local import default_root
from recorder.rollout.tasks import Task, load_tasks
from tools.benchkit.procs import python_module
from tools.benchkit.ray_auth import use_token_auth
from tools.benchkit.stats import median
from tools.benchkit.table import console, rich_table
from tools.tasks.build import build_all
from tools.tasks.engine import CHAT_TEMPLATE, CONTEXT_LENGTH, TOKENIZER_DIR
from tools.test_engine.launch import free_port


def _start_engine(log: IO[bytes]) -> tuple[subprocess.Popen[bytes], str]:
    """The shipped tasks' scripted engine (tools.tasks.engine), as a subprocess."""
    port = free_port()
    proc = python_module(
        "tools.tasks.engine", "--port", str(port), stdout=log, stderr=subprocess.STDOUT
    )
    return proc, f"http://127.0.0.1:{port}"


# --------------------------------------------------------------------------
# The bare peer: the same work with plain subprocesses
# --------------------------------------------------------------------------


async def _sh(cmd: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_shell(
        cmd, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode(errors="replace")


async def bare_rollout(
    task: Task, recorder: str, token: str, binary: str, root: Path
) -> dict[str, float]:
    import aiohttp

    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(dir=root))
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.post(recorder + "/sessions", json={}) as resp:
            sid = (await resp.json())["session_id"]
        clone = f"git clone -q {shlex.quote(task.repo)} repo && cd repo && git checkout -q {task.base_commit}"
        await _sh(clone, work)
        (work / "prompt.txt").write_text(task.problem_statement)
        (work / "home").mkdir()
        env = {
            **os.environ,
            "HOME": str(work / "home"),
            "ANTHROPIC_BASE_URL": recorder,
            "ANTHROPIC_AUTH_TOKEN": sid,
            "ANTHROPIC_API_KEY": sid,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "IS_SANDBOX": "1",
        }
        cmd = agent_command(
            AgentSpec(), binary=binary, prompt_file=str(work / "prompt.txt"), max_turns=None
        )
        t_agent = time.perf_counter()
        _, out = await _sh(cmd, work / "repo", env)
        agent_s = time.perf_counter() - t_agent
        if parse_agent_result(out).get("subtype") != "success":
            raise RuntimeError(f"the bare pipeline's agent failed: {out[-2000:]}")
        await _sh(
            f"git add -A && git diff --cached --binary {task.base_commit} > ../d.patch",
            work / "repo",
        )
        t_eval = time.perf_counter()
        await _sh(f"git clone -q {shlex.quote(task.repo)} eval && cd eval && git checkout -q "
                  f"{task.base_commit} && git apply ../d.patch", work)  # fmt: skip
        if task.eval_script:
            (work / "eval.sh").write_text(task.eval_script)
        await _sh(grader_command(task, str(work)), work / "eval")
        eval_s = time.perf_counter() - t_eval
        async with http.post(recorder + f"/sessions/{sid}/close", json={"reward": 1.0}) as resp:
            await resp.read()
    await _sh(f"rm -rf {shlex.quote(str(work))}", root)
    total = time.perf_counter() - t0
    return {"total_s": total, "agent_s": agent_s, "eval_s": eval_s}


# --------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------


def overhead(t: dict[str, float]) -> float:
    return t["total_s"] - t.get("agent_s", 0.0) - t.get("eval_s", 0.0)


def leaks(root: Path) -> tuple[int, int]:
    """(directories left under root, processes whose cwd is inside root)."""
    dirs = len(list(root.iterdir()))
    procs = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.readlink(f"/proc/{entry.name}/cwd").startswith(str(root)):
                    procs += 1
            except OSError:
                continue
    return dirs, procs


class Timed:
    """`run_group` callbacks: when each rollout was started and when its result came."""

    def __init__(self) -> None:
        self.started: dict[int, float] = {}
        self.seen: dict[int, float] = {}

    def start(self, i: int) -> None:
        self.started[i] = time.perf_counter()

    def result(self, i: int, _: RolloutResult) -> None:
        self.seen[i] = time.perf_counter() - self.started[i]

    def dispatch(self, results: list[RolloutResult]) -> list[float]:
        """Per rollout: driver-seen time minus the rollout's own total."""
        return [self.seen[i] - r.timings["total_s"] for i, r in enumerate(results)]


async def timed_group(
    reqs: list[RolloutRequest], concurrency: int, ray: Any = None
) -> tuple[list[RolloutResult], float, list[float]]:
    timed = Timed()
    t = time.perf_counter()
    results = await run_group(
        reqs, concurrency=concurrency, on_start=timed.start, on_result=timed.result, ray=ray
    )
    return results, time.perf_counter() - t, timed.dispatch(results)


def start_cluster(nodes: int, concurrency: int) -> Any:
    """A Ray cluster of `nodes` nodes on this machine; its workers import this checkout."""
    use_token_auth(os.environ)  # local sandboxes: `run_group` refuses an open cluster
    from ray.cluster_utils import Cluster

    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])
    )
    cpus = -(-concurrency // nodes)
    node = {"num_cpus": cpus, "object_store_memory": 100 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    for _ in range(nodes - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    return cluster


async def bench(rollouts: int, concurrency: int, skip_bare: bool, ray_nodes: int = 0) -> None:
    binary = local_binary()
    if binary is None:
        raise click.ClickException("Claude Code CLI missing: bash tools/setup.sh")
    tasks, errors = load_tasks(build_all())
    assert not errors, errors
    scratch = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    # A root driver's sandboxes run as users of their own, and only below directories
    # no other user may write (so not in /tmp): let them into one of their own.
    root = Path(tempfile.mkdtemp(prefix="bench-rollout-", dir=default_root()))
    root.chmod(0o711)
    # Started first, in the main thread (Ray sets signal handlers), and not timed.
    cluster = start_cluster(ray_nodes, concurrency) if ray_nodes else None
    engine_log = open(scratch / "engine.log", "wb")  # noqa: SIM115  (closed below)
    engine, engine_url = _start_engine(engine_log)
    serve_args = ["--tokenizer", str(TOKENIZER_DIR), "--chat-template", str(CHAT_TEMPLATE),
                  "--tool-parser", "qwen25", "--context-length", str(CONTEXT_LENGTH)]  # fmt: skip
    try:
        await asyncio.sleep(3)  # the engine loads its tokenizer
        log = open(scratch / "serve.log", "wb")  # noqa: SIM115
        async with own_recorder(str(scratch / "runs.db"), [engine_url], serve_args, log) as (
            url,
            token,
        ):
            reqs = [
                RolloutRequest(
                    task=tasks[i % len(tasks)],
                    sample_index=i // len(tasks),
                    group_index=i % len(tasks),
                    recorder_url=url,
                    admin_token=token,
                    sandbox=SandboxSpec(options={"root": str(root)}),
                    agent=AgentSpec(binary=binary),
                )
                for i in range(rollouts)
            ]
            results, wall, dispatch = await timed_group(reqs, concurrency)
            on_ray: tuple[list[RolloutResult], float, list[float]] | None = None
            if cluster is not None:
                from recorder.rollout.cluster import RayOptions

                on_ray = await timed_group(reqs, concurrency, RayOptions(address=cluster.address))
            bare: list[dict[str, float]] = []
            bare_wall = float("nan")
            if not skip_bare:
                gate = asyncio.Semaphore(concurrency)

                async def one(task: Task) -> dict[str, float]:
                    async with gate:
                        return await bare_rollout(task, url, token, binary, root)

                t = time.perf_counter()
                bare = list(await asyncio.gather(*(one(r.task) for r in reqs)))
                bare_wall = time.perf_counter() - t
        report(results, wall, dispatch, on_ray, bare, bare_wall, leaks(root), concurrency)
    finally:
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.shutdown()
        engine.terminate()
        await asyncio.to_thread(engine.wait)
        engine_log.close()
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def report(
    results: list[RolloutResult],
    wall: float,
    dispatch: list[float],
    on_ray: tuple[list[RolloutResult], float, list[float]] | None,
    bare: list[dict[str, float]],
    bare_wall: float,
    leaked: tuple[int, int],
    concurrency: int,
) -> None:
    timings = [r.timings for r in results]
    ray_results, ray_wall, ray_dispatch = on_ray or ([], float("nan"), [])
    ray_timings = [r.timings for r in ray_results]
    outcomes = statistics.multimode(r.outcome for r in [*results, *ray_results])
    rows: list[tuple[str, ...]] = []

    def row(name: str, ours: Any, on: Any = "", peer: Any = "") -> None:
        rows.append((name, str(ours), *([str(on)] if on_ray else []), str(peer)))

    def med(ts: list[dict[str, float]], key: str) -> str:
        return f"{median([t.get(key, 0.0) for t in ts]):.3f}" if ts else "-"

    row("rollouts passed", sum(r.outcome == "passed" for r in results),
        sum(r.outcome == "passed" for r in ray_results), len(bare) or "-")  # fmt: skip
    row("wall time, all rollouts (s)", f"{wall:.1f}", f"{ray_wall:.1f}", f"{bare_wall:.1f}")
    row("rollout total (s)", med(timings, "total_s"), med(ray_timings, "total_s"),
        f"{median([b['total_s'] for b in bare]):.3f}")  # fmt: skip
    row("  agent incl. engine (s)", med(timings, "agent_s"), med(ray_timings, "agent_s"),
        f"{median([b['agent_s'] for b in bare]):.3f}")  # fmt: skip
    row("  eval (s)", med(timings, "eval_s"), med(ray_timings, "eval_s"),
        f"{median([b['eval_s'] for b in bare]):.3f}")  # fmt: skip
    ours = [overhead(t) for t in timings]
    theirs = [overhead(t) for t in ray_timings]
    peers = [overhead(b) for b in bare]
    row("  driver overhead (s)", f"{median(ours):.3f}",
        f"{median(theirs):.3f}" if theirs else "-", f"{median(peers):.3f}")  # fmt: skip
    share = [overhead(t) / t["total_s"] for t in timings]
    ray_share = [overhead(t) / t["total_s"] for t in ray_timings]
    peer_share = [overhead(b) / b["total_s"] for b in bare]
    row("  overhead share of rollout wall (target < 5%)", f"{100 * median(share):.2f}%",
        f"{100 * median(ray_share):.2f}%" if ray_share else "-",
        f"{100 * median(peer_share):.2f}%")  # fmt: skip
    for part in ("boot_s", "checkout_s", "install_s", "diff_s", "recorder_s", "cleanup_s"):
        row(f"    of which {part[:-2]} (s)", med(timings, part), med(ray_timings, part))
    row("dispatch: driver-seen - rollout total (s)", f"{median(dispatch):.3f}",
        f"{median(ray_dispatch):.3f}" if ray_dispatch else "-")  # fmt: skip
    row("  slowest dispatch (s)", f"{max(dispatch):.3f}",
        f"{max(ray_dispatch):.3f}" if ray_dispatch else "-")  # fmt: skip
    row("leaked sandbox directories", leaked[0])
    row("leaked processes", leaked[1])
    title = f"{len(results)} rollouts, concurrency {concurrency} (medians)"
    columns = ("metric", "driver", *(["driver on Ray"] if on_ray else []), "bare peer")
    console().print(rich_table(title, columns, rows, left=1))
    if outcomes != ["passed"]:
        everything = [*results, *ray_results]
        click.echo(f"not every rollout passed: {[r.infra_cause or r.outcome for r in everything]}")


@click.command()
@click.option("--rollouts", type=int, default=32, show_default=True)
@click.option("--concurrency", type=int, default=8, show_default=True)
@click.option("--skip-bare", is_flag=True, help="Skip the bare peer column.")
@click.option("--ray-nodes", type=int, default=0, help="Add a column: on a Ray cluster of N nodes.")
def main(rollouts: int, concurrency: int, skip_bare: bool, ray_nodes: int) -> None:
    """Measure the rollout driver's overhead per rollout and count leaks."""
    asyncio.run(bench(rollouts, concurrency, skip_bare, ray_nodes))


if __name__ == "__main__":
    main()
