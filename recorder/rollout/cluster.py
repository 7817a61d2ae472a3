"""Rollouts as Ray tasks: `recorder rollout --ray [ADDRESS]`, `run_group(..., ray=RayOptions())`.

Each rollout is one Ray task that runs the driver's own `run_rollout` on a
node of the cluster, in that node's sandbox (local or E2B): the same function
as on one machine, only where it runs changes. What the task needs travels
with it:

- the repository: a URL as it is (the sandbox clones it); a local repository
  as the packfile of `base_commit`'s history (`workspace.base_pack`: what the
  sandbox gets anyway, nothing newer, so no later fix reaches the node), put
  into Ray's object store once per repository and commit, and unpacked once
  per node into a bare repository under the node directory;
- the agent CLI (local sandboxes): used where `AgentSpec.binary` names it on
  the node, else npm-installed once per node into the node directory (a file
  lock makes a node's other tasks wait for the first one's install);
- the recorder as the nodes reach it (`RayOptions.recorder_url`; by default
  the driver's URL).

The driver names every session before it submits the task
(`RolloutRequest.session_id`), so it can answer for a rollout that never
reports back: a task whose node (or worker process) died is `node_lost`, its
session closed `aborted` by the driver (`driver.abort_rollout`). Cancelling
(Ctrl-C) calls `ray.cancel` on each task: Ray raises SIGINT in the task's
worker, which cancels the rollout there (agent killed, sandboxes removed,
session closed aborted), and the task returns that cancelled result; the
driver waits for every task's cleanup before it raises CancelledError.

With local sandboxes the agents run on the cluster's own network, and a
cluster that answers callers without a token lets any of them join it as a
node of its own and be handed other rollouts' tasks, the admin token
included (so it could close any session with any reward). `run_group_ray`
therefore refuses such a cluster for local sandboxes (`refuse_open_cluster`:
Ray's token authentication, `RAY_AUTH_MODE=token`, must be on). A node keeps
what it installs under a directory no other user can change
(`safe_node_dir`), never one another user could have made first.

Ray is imported by this module's functions only: without `--ray` nothing
imports it.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from recorder.rollout.agent import AgentSpec
from recorder.rollout.driver import (
    RolloutRequest,
    RolloutResult,
    abort_rollout,
    finish_despite_cancel,
    notify,
    placeholder_result,
    run_all,
    run_rollout,
    session_id_for,
)
from recorder.rollout.errors import InfraError
from recorder.rollout.workspace import BasePack, base_pack, tail

log = logging.getLogger("recorder.rollout")
# Where a root node keeps repositories and the agent CLI; another user's node: below
# its home. Never the system's temp dir: any user could make the directory first.
ROOT_NODE_DIR = "/var/lib/trajectory-recorder/node"


class RayOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Where and how rollouts run on a Ray cluster."""

    # "auto", "ray://host:10001", "host:6379"; None: ray.init's default (RAY_ADDRESS, the
    # cluster `ray start` began on this machine, else a new local Ray).
    address: str | None = None
    cpus: float = 1.0  # CPUs each rollout task reserves
    # A custom resource each rollout takes one unit of: start the sandbox nodes with
    # `ray start --resources '{"sandbox": 8}'` and rollouts land there only.
    resource: str | None = None
    recorder_url: str | None = None  # the recorder as the nodes reach it
    # Node-local: unpacked repositories and the installed agent CLI. `{node_id}` in it
    # is the Ray node's id (several nodes on one machine, as in the tests). None: the
    # node's default (`default_node_dir`).
    node_dir: str | None = None


class OpenCluster(RuntimeError):
    """The cluster answers callers without a token: refused for local sandboxes."""


class NodeAnswer(msgspec.Struct, frozen=True):
    """What a rollout task returns: its result, or None if cancelled before it opened."""

    result: RolloutResult | None
    cancelled: bool = False


# --------------------------------------------------------------------------
# The driver's side
# --------------------------------------------------------------------------


def connect(opts: RayOptions) -> Any:
    """The `ray` module, connected to the cluster (once per process).

    `ray.init` sets a SIGTERM handler: connect before installing your own."""
    import ray

    if not ray.is_initialized():
        ray.init(address=opts.address, log_to_driver=False, include_dashboard=False)
    return ray


async def run_group_ray(
    reqs: Sequence[RolloutRequest],
    opts: RayOptions,
    *,
    concurrency: int | None = None,
    on_start: Callable[[int], None] | None = None,
    on_result: Callable[[int, RolloutResult], None] | None = None,
) -> list[RolloutResult]:
    """`driver.run_group` on a Ray cluster: at most `concurrency` tasks submitted at once,
    results in `reqs` order, each reported to `on_result` as it finishes."""
    ray = connect(opts)
    refuse_open_cluster(ray, [r.sandbox.backend for r in reqs])
    reqs = [for_nodes(msgspec.structs.replace(r, session_id=session_id_for(r))) for r in reqs]
    packs = await _ship_repositories(ray, reqs)
    remote = ray.remote(_node_rollout).options(
        num_cpus=opts.cpus,
        resources={opts.resource: 1} if opts.resource else None,
        max_retries=0,  # a rerun would reuse the session id; a lost node is node_lost
    )
    encoded_opts = msgspec.msgpack.encode(opts)
    gate = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(i: int, req: RolloutRequest) -> RolloutResult | None:
        if gate is not None:
            await gate.acquire()
        try:
            notify(on_start, i)
            pack = packs.get((req.task.repo, req.task.base_commit))
            if isinstance(pack, InfraError):  # its repository cannot be packed: its own failure
                result = placeholder_result(req, None, pack.cause, pack.message)
                notify(on_result, i, result)
                return result
            ref = remote.remote(msgspec.msgpack.encode(req), pack, encoded_opts)
            done = asyncio.wrap_future(ref.future())
            try:
                await asyncio.wait([done])  # its outcome, error or not, is _answer's
            except asyncio.CancelledError:
                ray.cancel(ref)
                await finish_despite_cancel([done])
                answer = await _answer(req, done)
                if answer is not None:
                    notify(on_result, i, answer)
                raise
            try:
                result = await _answer(req, done)
                assert result is not None, "only a cancelled task has no result"
            except Exception:  # the last guard: one rollout never fails its group
                log.error("rollout of %s: no answer", req.task.instance_id, exc_info=True)
                result = placeholder_result(req, None, "driver_error", traceback.format_exc())
            notify(on_result, i, result)
            return result
        finally:
            if gate is not None:
                gate.release()

    return [r for r in await run_all([one(i, r) for i, r in enumerate(reqs)]) if r is not None]


# Run in a fresh interpreter with no token: does the cluster's GCS answer it?
_STRANGER_PROBE = """
import sys
from ray._raylet import GcsClient
from ray.exceptions import AuthenticationError
try:
    GcsClient(address=sys.argv[1])
except AuthenticationError:
    print("closed")
else:
    print("open")
"""
_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
_closed_clusters: set[str] = set()


def refuse_open_cluster(ray: Any, backends: Sequence[str]) -> None:
    """Raise OpenCluster if local sandboxes would run on a cluster that answers strangers.

    A local sandbox's agent shares its node's network with Ray. Without token
    authentication it can start a raylet of its own that joins the cluster and
    offers the rollouts' resource; Ray then hands it other rollouts, each with the
    recorder's admin token, and takes back whatever result it makes up. E2B
    sandboxes run elsewhere, and are not checked. One probe per cluster and process.
    """
    if "local" not in backends:
        return
    try:
        address = ray.get_runtime_context().gcs_address
    except Exception as exc:  # e.g. a ray:// client connection
        raise OpenCluster(
            f"cannot check the Ray cluster's authentication ({type(exc).__name__}: {exc}); "
            "connect --ray to its GCS address (HOST:6379), not a ray:// client address"
        ) from exc
    if address in _closed_clusters:
        return
    if _stranger_answer(address) == "open":
        raise OpenCluster(
            f"the Ray cluster at {address} answers callers without a token. A local "
            "sandbox's agent on one of its nodes could join it as a node of its own and be "
            "handed other rollouts, the recorder's admin token with them. Start the cluster "
            "with token authentication: `export RAY_AUTH_MODE=token`, `ray get-auth-token "
            "--generate` (~/.ray/auth_token), the same token on every node and for this "
            "driver (that file, or RAY_AUTH_TOKEN_PATH), then `ray start`; or use --sandbox e2b"
        )
    _closed_clusters.add(address)


def _stranger_answer(address: str) -> str:
    """ "open" or "closed": how the GCS at `address` answers a client with no token."""
    env = {k: v for k, v in os.environ.items() if k not in _AUTH_VARIABLES and k != "HOME"}
    with tempfile.TemporaryDirectory(prefix="tr-ray-probe-") as home:  # no ~/.ray/auth_token
        done = subprocess.run(
            [sys.executable, "-c", _STRANGER_PROBE, address],
            env={**env, "HOME": home, "RAY_AUTH_MODE": "disabled"},
            cwd=home, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    answer = done.stdout.strip().splitlines()[-1:] or [""]
    if done.returncode != 0 or answer[0] not in ("open", "closed"):
        raise OpenCluster(
            f"cannot check the Ray cluster at {address} for token authentication: the probe "
            f"exited {done.returncode}: {tail(done.stderr.strip(), 800)}"
        )
    return answer[0]


def for_nodes(req: RolloutRequest) -> RolloutRequest:
    """What the driver's environment gives a rollout, put into its request: the nodes
    have their own environment (an E2B key the driver has would be missing there)."""
    spec = req.sandbox
    key = os.environ.get("E2B_API_KEY")
    if spec.backend == "e2b" and key and "api_key" not in spec.options:
        spec = msgspec.structs.replace(spec, options={**spec.options, "api_key": key})
        return msgspec.structs.replace(req, sandbox=spec)
    return req


async def _ship_repositories(ray: Any, reqs: Sequence[RolloutRequest]) -> dict[Any, Any]:
    """Each local repository's `base_commit` history, in the object store once (or the
    InfraError that says why it cannot be packed: those rollouts fail `repo_checkout`)."""
    refs: dict[tuple[str, str], Any] = {}
    for req in reqs:
        key = (req.task.repo, req.task.base_commit)
        if req.task.is_local_repo and key not in refs:
            try:
                pack = await base_pack(*key)
            except InfraError as exc:
                refs[key] = exc
                continue
            refs[key] = ray.put(msgspec.msgpack.encode(pack))
    return refs


async def _answer(req: RolloutRequest, done: asyncio.Future[bytes]) -> RolloutResult | None:
    """The task's result; a lost node's rollout closed `aborted` here; None for a task
    cancelled before it opened its session."""
    from ray.exceptions import RayTaskError, TaskCancelledError

    try:
        answer = msgspec.msgpack.decode(done.result(), type=NodeAnswer)
    except TaskCancelledError:
        # Cancelled before its rollout began: if the session exists after all (the
        # interrupt came in between), it is closed like a lost one.
        result = await abort_rollout(req, "cancelled", "the rollout was stopped")
        return result if result.session_id is not None else None
    except RayTaskError as exc:  # the task's own code raised: a bug, not the node
        return await abort_rollout(req, "driver_error", str(exc))
    except Exception as exc:  # NodeDiedError, WorkerCrashedError, ObjectLostError, ...
        return await abort_rollout(req, "node_lost", f"{type(exc).__name__}: {exc}")
    return answer.result


# --------------------------------------------------------------------------
# The node's side: one Ray task
# --------------------------------------------------------------------------


def _node_rollout(req_data: bytes, pack_data: bytes | None, opts_data: bytes) -> bytes:
    """The Ray task: run the rollout on this node; SIGINT (`ray.cancel`) cancels it."""
    req = msgspec.msgpack.decode(req_data, type=RolloutRequest)
    opts = msgspec.msgpack.decode(opts_data, type=RayOptions)
    pack = None if pack_data is None else msgspec.msgpack.decode(pack_data, type=BasePack)

    async def main() -> NodeAnswer:
        work = asyncio.ensure_future(_on_node(req, pack, opts))
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, work.cancel)
        return await work

    return msgspec.msgpack.encode(asyncio.run(main()))


async def _on_node(req: RolloutRequest, pack: BasePack | None, opts: RayOptions) -> NodeAnswer:
    node = node_identity()
    req = msgspec.structs.replace(
        req, node=node, recorder_url=opts.recorder_url or req.recorder_url
    )
    try:
        root = await asyncio.to_thread(
            safe_node_dir,
            (opts.node_dir or default_node_dir()).replace("{node_id}", node["node_id"]),
        )
        if pack is not None:
            repo = await asyncio.to_thread(node_repository, root, pack)
            task = msgspec.structs.replace(req.task, repo=repo, base_commit=pack.commit)
            req = msgspec.structs.replace(req, task=task)
        if req.sandbox.backend == "local":
            agent, how = await asyncio.to_thread(node_agent, req.agent, root)
            req = msgspec.structs.replace(req, agent=agent, node={**node, "agent": how})
    except InfraError as exc:  # before the session opened: nothing to close
        return NodeAnswer(placeholder_result(req, None, exc.cause, exc.message))
    cancelled: list[RolloutResult] = []
    try:
        return NodeAnswer(await run_rollout(req, on_cancelled=cancelled.append))
    except asyncio.CancelledError:
        return NodeAnswer(cancelled[0] if cancelled else None, cancelled=True)


def node_identity() -> dict[str, str]:
    """This Ray node: its id, host name and IP (recorded with each sandbox)."""
    import ray

    context = ray.get_runtime_context()
    return {
        "node_id": context.get_node_id(),
        "hostname": socket.gethostname(),
        "node_ip": ray.util.get_node_ip_address(),
    }


def default_node_dir() -> str:
    """`ROOT_NODE_DIR` on a node running as root, else below the node user's home."""
    if os.geteuid() == 0:
        return ROOT_NODE_DIR
    return os.path.join(os.path.expanduser("~"), ".cache", "trajectory-recorder", "node")


def safe_node_dir(path: str) -> Path:
    """`path`, made if missing, once no other user can change what is in it.

    A node runs what it finds there (the agent CLI) and clones the repositories it
    holds into sandboxes, so the directory and every directory above it must be owned
    by root or this user and be writable by no one else. The one exception is a
    sticky parent such as /tmp: others may add to it, not replace what is ours.
    """
    try:
        Path(path).mkdir(mode=0o755, parents=True, exist_ok=True)
        root = Path(path).resolve()  # a link another user planted leads to their directory
        unsafe = _unsafe_component(root)
    except OSError as exc:
        raise InfraError("sandbox_boot", f"cannot make the node directory {path}: {exc}") from exc
    if unsafe is not None:
        raise InfraError(
            "sandbox_boot",
            f"the node directory {root} is not safe to run from: {unsafe}; give --ray-node-dir "
            "a directory below ones only root (or the node's user) may write",
        )
    return root


def _unsafe_component(root: Path) -> str | None:
    """What lets another user change `root` (a resolved path), or None."""
    me = os.geteuid()
    for part in (root, *root.parents):
        st = part.stat()
        if st.st_uid not in (0, me):
            return f"{part} is owned by uid {st.st_uid}"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and (
            part == root or not st.st_mode & stat.S_ISVTX
        ):
            return f"{part} is writable by {'every user' if st.st_mode & stat.S_IWOTH else 'its group'}"
    return None


def node_repository(root: Path, pack: BasePack) -> str:
    """A bare repository on this node holding `pack` (made once per node and commit)."""
    repos = root / "repos"
    dest = repos / pack.commit
    if (dest / "HEAD").exists():
        return str(dest)
    repos.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=repos))
    try:
        _git(["init", "-q", "--bare", str(staging)])
        _git(["-C", str(staging), "index-pack", "--stdin"], stdin=pack.data)
        # A ref, so nothing prunes the objects; the staging directory becomes the
        # repository in one rename (a node's other tasks see all of it or none).
        _git(["-C", str(staging), "update-ref", "refs/tr/base", pack.commit])
        try:
            staging.rename(dest)
        except OSError:
            if not (dest / "HEAD").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(dest)


def _git(args: list[str], stdin: bytes | None = None) -> None:
    done = subprocess.run(["git", *args], input=stdin, capture_output=True, check=False)
    if done.returncode != 0:
        raise InfraError(
            "repo_checkout", f"git {args[-2]} on the node failed: {done.stderr.decode()[-500:]}"
        )


def node_agent(spec: AgentSpec, root: Path) -> tuple[AgentSpec, str]:
    """`spec` with a CLI that exists on this node: `spec.binary` if it does ("present"),
    else `package@version` npm-installed once per node under `root` ("installed" by
    this task, "cached" by an earlier one)."""
    if "{agent}" not in spec.command or not spec.install:
        return spec, "present"  # another agent; or the sandbox's own (ensure_agent checks)
    if spec.binary is not None and os.access(spec.binary, os.X_OK):
        return spec, "present"
    name = os.path.basename(spec.binary or "claude")
    if spec.binary is None and shutil.which(name):
        return spec, "present"
    agents = root / "agents"
    agents.mkdir(parents=True, exist_ok=True)
    prefix = agents / f"{spec.package.replace('/', '+')}@{spec.version}"
    binary = prefix / "node_modules" / ".bin" / name
    how = "cached"
    with open(agents / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other tasks wait for this install
        if not os.access(binary, os.X_OK):
            _npm_install(prefix, f"{spec.package}@{spec.version}")
            how = "installed"
    return msgspec.structs.replace(spec, binary=str(binary)), how


def _npm_install(prefix: Path, package: str) -> None:
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=prefix.parent))
    try:
        done = subprocess.run(
            ["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefer-offline",
             "--prefix", str(staging), package],
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise InfraError(
                "agent_install",
                f"npm install {package} on the node exited {done.returncode}: "
                f"{tail((done.stderr + done.stdout).strip(), 800)}; install node/npm on the "
                "Ray nodes, or give --agent-binary a path that exists on every node",
            )
        (staging / ".tr-installed").write_text(package + "\n")
        shutil.rmtree(prefix, ignore_errors=True)
        staging.rename(prefix)
        prefix.chmod(0o755)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InfraError("agent_install", f"npm install {package} on the node: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
