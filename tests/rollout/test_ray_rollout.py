"""Rollouts on a real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`).

Three nodes of one CPU each (a raylet, an object store and workers apiece; the
module shares them, they take ~20 s to start on two cores). Every node is this
machine, so "the node's sandbox" is a local sandbox under a shared root, and
the node directory is `{node_id}`-templated: each node has its own, and the
agent CLI is genuinely missing on each until it installs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from rollout_harness import chat_tokenizer, leftovers, policy_recorder, shipped_tasks
from sandbox_backends import Backend
from test_rollout_cli import cli, env, sessions, task_engine  # noqa: F401  (a fixture)

from recorder.log import events as ev
from recorder.rollout.agent import AgentSpec
from recorder.rollout.driver import RolloutRequest, RolloutResult, run_group
from recorder.rollout.sandbox import SandboxSpec
from recorder.rollout.sandbox.local import marked_pids
from tests.conftest import claude_code_binary, missing
from tools.test_engine.launch import REPO_ROOT

NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
FIX = "sed -i '0,/return a - b/s//return a + b/' calc.py"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head and two worker nodes; their workers import this worktree's code."""
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError as exc:
        missing(f"Ray is not installed ({exc})", "pip install -e '.[ray]' (tools/setup.sh)")
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), saved]))
    c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    try:
        for _ in range(2):
            c.add_node(**NODE)
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


# A cluster as Ray starts one by default, without token authentication, in a child
# process (this one's Ray authenticates: tests/conftest.py); it stops when stdin closes.
OPEN_CLUSTER = f"""
import sys
from ray.cluster_utils import Cluster
c = Cluster(initialize_head=True, head_node_args={{**{NODE!r}, "include_dashboard": False}})
print(c.address, flush=True)
sys.stdin.readline()
c.shutdown()
"""


def without_token() -> dict[str, str]:
    """The test environment, as a process that has no Ray token sees it."""
    e = {k: v for k, v in env().items() if not k.startswith("RAY_AUTH_")}
    return {**e, "RAY_AUTH_MODE": "disabled"}


@pytest.fixture
def open_cluster() -> Iterator[str]:
    """The address of a one-node cluster that answers callers without a token."""
    proc = subprocess.Popen(
        [sys.executable, "-c", OPEN_CLUSTER], env=without_token(), text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        address = proc.stdout.readline().strip()
        assert address, "the open cluster did not start"
        yield address
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)


def join_as_node(address: str) -> tuple[bool, str]:
    """Whether a raylet started with no token joins `address` offering the rollouts'
    resource (what a sandbox's agent could do on its node), and its output."""
    with tempfile.TemporaryDirectory(prefix="tr-rogue-") as temp_dir:  # short: socket paths
        return _join(address, temp_dir)


def _join(address: str, temp_dir: str) -> tuple[bool, str]:
    proc = subprocess.Popen(
        ["ray", "start", "--address", address, "--num-cpus", "1", "--resources",
         '{"sandbox": 8}', "--temp-dir", temp_dir, "--block", "--disable-usage-stats"],
        env=without_token(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Ray runtime started" in line:
                return True, "".join(lines)
        return False, "".join(lines)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)


@pytest.mark.ray
def test_local_sandboxes_refuse_a_cluster_that_answers_callers_without_a_token(
    tmp_path: Path,
    task_engine: str,  # noqa: F811
    open_cluster: str,
    cluster: Any,
) -> None:
    # The attack: with no token, a raylet joins the open cluster as a node offering the
    # rollouts' resource (Ray would hand it rollouts, admin token included); the
    # authenticated cluster turns the same raylet away.
    joined, out = join_as_node(open_cluster)
    assert joined, out[-2000:]
    joined, out = join_as_node(cluster.address)
    assert not joined and "AuthenticationError" in out, out[-2000:]
    # So local sandboxes are not run on the open cluster: nothing starts, and the
    # error says how to turn authentication on.
    (tmp_path / "sbx").mkdir()
    cmd = cli(tmp_path, task_engine, "--samples-per-task", "1", "--ray", open_cluster)
    done = subprocess.run(cmd, env=without_token(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "answers callers without a token" in done.stderr
    assert "RAY_AUTH_MODE=token" in done.stderr
    assert asyncio.run(sessions(tmp_path / "runs.db")) == {}
    assert list((tmp_path / "sbx").iterdir()) == []


@pytest.mark.ray
def test_an_authenticated_cluster_is_probed_once(cluster: Any) -> None:
    import ray

    from recorder.rollout import cluster as c

    c.connect(c.RayOptions(address=cluster.address))
    address = ray.get_runtime_context().gcs_address
    c._closed_clusters.discard(address)
    c.refuse_open_cluster(ray, ["e2b"])  # agents elsewhere: not probed
    assert address not in c._closed_clusters
    c.refuse_open_cluster(ray, ["e2b", "local"])
    assert address in c._closed_clusters


def nodes_of(logs: dict[str, list[object]]) -> dict[str, list[dict[str, str]]]:
    """Each session's nodes, as its sandbox_created events record them."""
    return {
        sid: [
            e.detail["node"]
            for e in events
            if isinstance(e, ev.SandboxEvent) and e.kind == "sandbox_created"
        ]
        for sid, events in logs.items()
    }


def outcomes(lines: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What must agree between a local and a Ray run (session ids and paths differ)."""
    return sorted(
        (
            x["instance_id"],
            x["group_index"],
            x["sample_index"],
            x["result"]["outcome"],
            x["result"]["reward"],
            x["result"]["infra_cause"],
            x["result"]["evidence"].get("passed"),
            len(x["result"]["samples"]),
            all(sum(s["loss_mask"]) > 0 for s in x["result"]["samples"]),
        )
        for x in lines
    )


@pytest.mark.ray
@pytest.mark.claude
def test_shipped_tasks_spread_over_the_nodes_and_equal_a_local_run(
    tmp_path: Path,
    task_engine: str,  # noqa: F811
    cluster: Any,
) -> None:
    binary = claude_code_binary()
    runs = {}
    for name, extra in {
        "local": ["--agent-binary", binary],
        # Missing on every node: each installs it once, into its own node directory.
        "ray": [
            "--ray", cluster.address, "--agent-binary", str(tmp_path / "nowhere" / "claude"),
            "--ray-node-dir", str(tmp_path / "nodes" / "{node_id}"),
        ],
    }.items():  # fmt: skip
        work = tmp_path / name
        (work / "sbx").mkdir(parents=True)
        cmd = cli(work, task_engine, "--samples-per-task", "2", "--concurrency", "3", *extra)
        cmd += ["--temperature", "0.5", "--turn-budget", "20", "--wall-budget", "300"]
        done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "rollout summary" in done.stdout
        runs[name] = [json.loads(x) for x in (work / "samples.jsonl").read_text().splitlines()]
        assert list((work / "sbx").iterdir()) == []
    assert outcomes(runs["ray"]) == outcomes(runs["local"])
    assert {x["result"]["outcome"] for x in runs["ray"]} == {"passed"}
    logs = asyncio.run(sessions(tmp_path / "ray" / "runs.db"))
    assert sorted(logs) == sorted(x["result"]["session_id"] for x in runs["ray"])
    placed = nodes_of(logs)
    # Both sandboxes of a rollout (agent, eval) are on its node; 6 rollouts, 3 nodes
    # of one CPU each, 3 at once: every node ran some.
    assert all(len(n) == 2 and n[0] == n[1] for n in placed.values()), placed
    used = {n[0]["node_id"] for n in placed.values()}
    assert used == {n.node_id for n in [cluster.head_node, *cluster.worker_nodes]}
    assert all(n[0]["hostname"] and n[0]["node_ip"] for n in placed.values())
    # The agent CLI: installed once on each node, found there by its later rollouts.
    installs = [n[0]["agent"] for n in placed.values()]
    assert sorted(installs) == ["cached"] * 3 + ["installed"] * 3, installs
    assert sorted(p.name for p in (tmp_path / "nodes").iterdir()) == sorted(used)


@pytest.mark.ray
def test_ctrl_c_cleans_up_on_every_node(
    tmp_path: Path,
    task_engine: str,  # noqa: F811
    cluster: Any,
) -> None:
    root = tmp_path / "sbx"
    root.mkdir()
    cmd = cli(tmp_path, task_engine, "--samples-per-task", "2", "--ray", cluster.address)
    cmd += ["--agent-command", "sleep 600"]  # 6 rollouts: 3 running, 3 queued in Ray
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while len([p for p in root.iterdir() if (p / "prompt.txt").exists()]) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, out.decode()[-3000:]
    logs = asyncio.run(sessions(tmp_path / "runs.db"))
    assert len(logs) == 3  # the queued ones never opened a session
    for events in logs.values():
        (closed,) = [e for e in events if isinstance(e, ev.SessionClosed)]
        assert closed.status == "aborted" and closed.reason.startswith("cancelled")
    placed = nodes_of(logs)
    assert len({n[0]["node_id"] for n in placed.values()}) == 3  # one on each node
    ids = [
        str(e.detail["sandbox_id"])
        for events in logs.values()
        for e in events
        if isinstance(e, ev.SandboxEvent) and e.kind == "sandbox_created"
    ]
    assert [pid for i in ids for pid in marked_pids(i)] == []
    assert list(root.iterdir()) == []
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sorted(x["result"]["session_id"] for x in lines) == sorted(logs)
    for line in lines:
        result = line["result"]
        assert (result["outcome"], result["infra_cause"]) == ("infra_error", "cancelled")
        assert all(s["status"] == "aborted" and not any(s["loss_mask"]) for s in result["samples"])


@pytest.mark.ray
async def test_a_lost_node_fails_only_its_own_rollouts(
    tmp_path: Path, sqlite_url: str, cluster: Any
) -> None:
    """Three rollouts, one per node, each agent waiting for a go file; the node of one is
    removed mid-agent: that rollout is node_lost (closed aborted), the others pass."""
    from recorder.rollout.cluster import RayOptions

    h = await policy_recorder(chat_tokenizer(), sqlite_url)
    try:
        go = tmp_path / "go"
        task = shipped_tasks()["wordcount-trailing-newline"]
        fix = "sed -i 's/len(text.split(\"\\\\n\"))/len(text.splitlines())/' wc.py"
        agent = AgentSpec(command=f"while [ ! -e {go} ]; do sleep 0.2; done; {fix}")
        root = tmp_path / "sbx"
        root.mkdir()
        reqs = [
            RolloutRequest(
                task=task, sample_index=i, group_index=0, recorder_url=h.url,
                admin_token=h.config.admin_token, agent=agent,
                sandbox=SandboxSpec(options={"root": str(root)}),
                session_id=f"ro-lost-node-s{i}-{os.getpid()}",
            )
            for i in range(3)
        ]  # fmt: skip
        opts = RayOptions(address=cluster.address, node_dir=str(tmp_path / "nodes/{node_id}"))
        group = asyncio.ensure_future(run_group(reqs, ray=opts))
        started = await until_agents_started(h, [r.session_id or "" for r in reqs], group)
        workers = {n.node_id: n for n in cluster.worker_nodes}
        doomed = next(sid for sid, node in started.items() if node in workers)
        cluster.remove_node(workers[started[doomed]], allow_graceful=False)
        await asyncio.sleep(1)
        go.touch()
        results: list[RolloutResult] = await asyncio.wait_for(group, 300)
        by_sid = {r.session_id: r for r in results}
        assert (by_sid[doomed].outcome, by_sid[doomed].infra_cause) == ("infra_error", "node_lost")
        others = [r for sid, r in by_sid.items() if sid != doomed]
        assert [(r.outcome, r.reward) for r in others] == [("passed", 1.0)] * 2
        (closed,) = await h.payloads(doomed, ev.SessionClosed)
        assert closed.status == "aborted" and closed.reason.startswith("node_lost")
        failed = (await h.payloads(doomed, ev.SandboxEvent))[-1]
        assert (failed.kind, failed.detail["cause"]) == ("failed", "node_lost")
        assert all(not any(s.loss_mask) for s in by_sid[doomed].samples)
        for r in others:
            (closed,) = await h.payloads(r.session_id or "", ev.SessionClosed)
            assert closed.status == "completed"
        # What the dead node could not clean up is its alone (its agent ended on `go`).
        survivors = [r.session_id for r in others]
        ids = [str(e.detail["sandbox_id"]) for s in survivors for e in await created(h, s)]
        assert [x for x in leftovers(root, ids) if x in ids] == []
    finally:
        await h.close()
        cluster.add_node(**NODE)  # the next test gets three nodes again


@pytest.mark.ray
async def test_each_backend_runs_in_the_node_sandbox(
    backend: Backend, tmp_path: Path, sqlite_url: str, cluster: Any
) -> None:
    """Local sandboxes and E2B (the real SDK, against its doubles) under Ray: a local
    repository (its pack through the object store) and a git URL, each graded; a commit
    that is not there fails its own rollout only. The requests name a dead recorder: the
    nodes use the one RayOptions names for them."""
    from recorder.rollout.cluster import RayOptions

    h = await policy_recorder(chat_tokenizer(), sqlite_url)
    try:
        task = shipped_tasks()["calc-add"]
        check = "set -e\ngrep -q 'return a + b' calc.py\n"
        local = msgspec.structs.replace(task, tests=None, eval_script=check)
        url = msgspec.structs.replace(local, repo=f"file://{task.repo}", instance_id="calc-url")
        broken = msgspec.structs.replace(local, base_commit="0" * 40, instance_id="no-commit")
        reqs = [
            RolloutRequest(
                task=t, sample_index=i, recorder_url="http://127.0.0.1:9",
                admin_token=h.config.admin_token, sandbox=backend.spec(),
                agent=AgentSpec(command=FIX),
            )
            for i, t in enumerate([local, url, local, broken])
        ]  # fmt: skip
        opts = RayOptions(
            address=cluster.address,
            node_dir=str(tmp_path / "nodes/{node_id}"),
            recorder_url=h.url,
        )
        *results, unpacked = await run_group(reqs, ray=opts)
        assert [(r.outcome, r.reward) for r in results] == [("passed", 1.0)] * 3, results
        assert (unpacked.outcome, unpacked.infra_cause) == ("infra_error", "repo_checkout")
        for r in results:
            made = [e.detail for e in await created(h, r.session_id)]
            assert [(c["role"], c["backend"]) for c in made] == [
                ("agent", backend.name),
                ("eval", backend.name),
            ]
            assert made[0]["node"]["node_id"] == made[1]["node"]["node_id"]
        if backend.doubles is not None:
            await backend.doubles.settled()
            assert backend.doubles.live() == []
        else:
            assert list((tmp_path / "local").iterdir()) == []
    finally:
        await h.close()


async def created(h: Any, sid: str | None) -> list[ev.SandboxEvent]:
    return [e for e in await h.payloads(sid, ev.SandboxEvent) if e.kind == "sandbox_created"]


async def until_agents_started(
    h: Any, sids: list[str], group: asyncio.Future[Any]
) -> dict[str, str]:
    """Wait until every rollout's agent runs; each session's node id."""
    deadline = time.monotonic() + 180
    while True:
        assert not group.done(), group.result()
        assert time.monotonic() < deadline, "the agents did not all start"
        nodes = {}
        for sid in sids:
            events = await h.payloads(sid, ev.SandboxEvent)
            if any(e.kind == "agent_started" for e in events):
                nodes[sid] = next(e.detail["node"]["node_id"] for e in events)
        if len(nodes) == len(sids):
            return nodes
        await asyncio.sleep(0.3)


def test_without_ray_nothing_imports_it() -> None:
    """The CLI and the driver's local path never import Ray (its import alone takes
    seconds and hundreds of MB)."""
    script = (
        "import asyncio, sys\n"
        "import recorder.cli, recorder.rollout.cli, recorder.rollout.driver as d\n"
        "from click.testing import CliRunner\n"
        "CliRunner().invoke(recorder.cli.main, ['rollout', '--help'])\n"
        "assert asyncio.run(d.run_group([])) == []\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    # And the same script does see it when asked for (the check can fail).
    done = subprocess.run(
        [sys.executable, "-c", script.replace("import asyncio, sys", "import asyncio, sys, ray")],
        env=env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "'ray'" in done.stdout, done.stderr


def test_results_decode_as_the_driver_sends_them() -> None:
    """The node's answer round-trips through msgpack with its samples intact."""
    from recorder.rollout.cluster import NodeAnswer
    from replay.placeholders import minimal_sample

    result = RolloutResult(
        session_id="s", outcome="passed", reward=1.0,
        samples=[minimal_sample(0, session_id="s", rollout_id="s", reason="x", metadata={})],
    )  # fmt: skip
    for answer in (NodeAnswer(result), NodeAnswer(None, cancelled=True)):
        data = msgspec.msgpack.encode(answer)
        assert msgspec.msgpack.decode(data, type=NodeAnswer) == answer


def test_a_remote_cluster_with_a_loopback_recorder_is_a_start_warning() -> None:
    from recorder.rollout.cli import start_warnings

    def ray_warnings(**kw: Any) -> list[str]:
        return [
            w for w in start_warnings("local", options={"user": "driver"}, **kw) if "--ray" in w
        ]

    (warning,) = ray_warnings(recorder_url=None, agent_base_url=None, ray_address="10.0.0.7:6379")
    assert "127.0.0.1" in warning and "--ray-recorder-url" in warning
    (warning,) = ray_warnings(
        recorder_url="http://localhost:8080", agent_base_url=None, ray_address="auto"
    )
    assert "localhost:8080" in warning
    lb = "http://lb.internal:8080"
    assert ray_warnings(recorder_url=lb, agent_base_url=None, ray_address="auto") == []
    assert (
        ray_warnings(
            recorder_url="http://127.0.0.1:8000",
            agent_base_url=None,
            ray_address="auto",
            node_recorder_url=lb,
        )
        == []
    )
    # A Ray started here (bare --ray) runs on this machine: loopback is fine.
    assert ray_warnings(recorder_url=None, agent_base_url=None, ray_address="local") == []
    assert ray_warnings(recorder_url=None, agent_base_url=None) == []
