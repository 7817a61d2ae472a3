"""One rollout as one awaitable call: task -> sandbox -> agent -> diff -> eval -> reward -> samples.

`run_rollout(RolloutRequest) -> RolloutResult` takes and returns plain,
serialisable msgspec Structs, so a trainer's workers (Ray actors in slime and
verl) can run it anywhere that reaches the recorder over HTTP. The story of
one rollout, each step also appended to the session's log as a SandboxEvent
(`replay show` prints it):

    open session (sampling forced, turn cap)   sandbox_created (agent)
    repo checked out at base_commit, setup     agent_started ... agent_finished
    diff_taken, agent sandbox killed           sandbox_created (eval): a FRESH one
    patch applied, protected paths restored,   close with reward and evidence
    test_patch applied, grader run: eval_result

The agent's sandbox is dead before the eval sandbox exists (nothing it left
running can touch the grading). The diff is taken against the tree the task's
setup left (`diff.Baseline`: what setup writes is not the agent's), and
the eval sandbox, after its own setup, restores the task's protected paths to
that state and applies its `test_patch` (`recorder.rollout.protect`).

`run_rollout` never raises (except CancelledError, after cleanup): a policy
failure is reward 0, an infrastructure failure (`errors.InfraError`) closes
the session `aborted`, whose samples are the reducer's same-shape
placeholders. `run_group` runs a GRPO group with per-trajectory isolation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from recorder.rollout.agent import (
    AgentRun,
    AgentSpec,
    agent_env,
    compaction_env,
    ensure_agent,
    run_agent,
)
from recorder.rollout.client import RecorderClient, RecorderError, RecorderRefused, RolloutEvent
from recorder.rollout.diff import (
    Baseline,
    BrokenRepository,
    ForgedDiff,
    apply_patch,
    apply_test_patch,
    preimages_in_tree,
    snapshot,
    take_diff,
)
from recorder.rollout.errors import InfraError
from recorder.rollout.eval_tree import remove_bytecode, remove_path_shadows, restore_protected
from recorder.rollout.evaluate import Grade, GraderCannotRun, run_grader
from recorder.rollout.protect import protected_pathspecs, pythonpath_entries
from recorder.rollout.sandbox import (
    CommandTimeout,
    Sandbox,
    SandboxBootError,
    SandboxError,
    SandboxSpec,
    open_sandbox,
)
from recorder.rollout.tasks import Task
from recorder.rollout.workspace import checkout, run_setup, tail
from replay.placeholders import minimal_sample
from replay.samples import Sample

if TYPE_CHECKING:
    from recorder.rollout.cluster import RayOptions

T = TypeVar("T")
log = logging.getLogger("recorder.rollout")

Outcome = str  # "passed" | "failed" | "infra_error"


# How much of the agent's diff the log keeps in `diff_taken`: enough to read
# what the agent did in `replay view` / `show` without the `--out` file, and
# bounded so one runaway diff (a vendored tree, a generated file) cannot bloat
# every replay of the log. The whole diff is graded and goes to `--out`.
PATCH_IN_LOG = 256 * 1024


class RolloutRequest(msgspec.Struct, frozen=True, kw_only=True):
    task: Task
    sample_index: int = 0
    group_index: int = 0
    # temperature / top_p / top_k / max_new_tokens: forced on every turn of the session.
    sampling: dict[str, Any] = {}
    recorder_url: str  # the recorder as the driver reaches it
    agent_base_url: str | None = None  # the recorder as the sandbox reaches it (default: above)
    admin_token: str | None = None
    sandbox: SandboxSpec = SandboxSpec()
    agent: AgentSpec = AgentSpec()
    wall_budget_s: float = 1800.0
    turn_budget: int | None = None
    session_metadata: dict[str, Any] = {}
    # Set by a caller that must know the session before the rollout reports back (the
    # Ray path closes the session of a rollout whose node died); None: a fresh id.
    session_id: str | None = None
    # Where the rollout runs (a Ray node: node_id, hostname, node_ip, agent), recorded with
    # each sandbox it creates; {} on the driver's own machine.
    node: dict[str, str] = {}


class RolloutResult(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str | None
    outcome: Outcome  # "passed" | "failed" (policy: reward from eval, trained) | "infra_error"
    reward: float
    # The recorder's close answer; on an infrastructure failure the same-shape
    # aborted placeholders.
    samples: list[Sample]
    infra_cause: str | None = None  # "sandbox_boot", "recorder_unreachable", ...
    evidence: dict[str, Any] = {}  # tests passed/failed, exit code, output tail
    turns: int = 0
    timings: dict[str, float] = {}  # agent_s, eval_s, total_s, ...
    # The agent's whole diff against base_commit (tests included: edits to protected
    # paths are here even though grading reverted them); "" when there was none.
    diff: str = ""


def session_id_for(req: RolloutRequest) -> str:
    """A readable, unique session id (it travels as a bearer token: a safe alphabet)."""
    if req.session_id is not None:
        return req.session_id
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", req.task.instance_id)[:120].strip("-") or "task"
    return f"ro-{slug}-g{req.group_index}-s{req.sample_index}-{uuid.uuid4().hex[:8]}"


def placeholder_result(
    req: RolloutRequest, session_id: str | None, cause: str, message: str, **kw: Any
) -> RolloutResult:
    """The result of a rollout whose recorder could not even close it: one minimal sample."""
    sample = minimal_sample(
        0,
        session_id=session_id or "",
        rollout_id=session_id or "",
        reason=cause,
        metadata={"instance_id": req.task.instance_id, "group_index": req.group_index},
    )
    return RolloutResult(
        session_id=session_id,
        outcome="infra_error",
        reward=0.0,
        samples=[sample],
        infra_cause=cause,
        evidence={"error": message[-2000:]},
        **kw,
    )


class _Rollout:
    """One rollout's state: its session, sandboxes, pending events and timings."""

    def __init__(self, req: RolloutRequest, client: RecorderClient) -> None:
        self.req = req
        self.client = client
        self.sid = session_id_for(req)
        self.opened = False
        self.sandboxes: dict[Sandbox, str] = {}  # live sandbox -> its role
        self.killing: list[asyncio.Future[None]] = []
        self.events: list[RolloutEvent] = []
        self.timings: dict[str, float] = {}
        self.turns = 0
        # The repository as setup left it, in each sandbox (set by `prepare`).
        self.bases: dict[str, Baseline] = {}
        self.broken: BrokenRepository | None = None  # why the agent's work could not be diffed
        self.restored: list[str] = []  # protected paths the patch changed, restored
        self.diff = b""
        self.started = time.perf_counter()
        self.deadline = time.monotonic() + req.wall_budget_s

    # -- bookkeeping ------------------------------------------------------------------------

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t

    def note(self, kind: str, **detail: Any) -> None:
        self.events.append(RolloutEvent(kind, detail))

    async def flush(self) -> None:
        events, self.events = self.events, []
        with self.timed("recorder_s"):
            await self.client.append_events(self.sid, events)

    # -- steps ------------------------------------------------------------------------------

    async def open(self) -> None:
        req = self.req
        metadata = {
            "instance_id": req.task.instance_id,
            "sample_index": req.sample_index,
            "group_index": req.group_index,
            **req.session_metadata,
        }
        config: dict[str, Any] = {"sampling": req.sampling}
        if req.turn_budget is not None:
            config["max_turns"] = req.turn_budget
        with self.timed("recorder_s"):
            await self.client.open_session(self.sid, metadata, config)
        self.opened = True

    async def boot(self, role: str) -> Sandbox:
        spec = self.req.sandbox
        spec = msgspec.structs.replace(
            spec, metadata={**spec.metadata, "session_id": self.sid, "role": role}
        )
        t = time.perf_counter()
        try:
            with self.timed("boot_s"):
                sb = await open_sandbox(spec)
        except SandboxBootError as exc:
            raise InfraError("sandbox_boot", f"{role} sandbox ({spec.backend}): {exc}") from exc
        self.sandboxes[sb] = role
        self.note(
            "sandbox_created",
            role=role,
            backend=spec.backend,
            sandbox_id=sb.id,
            boot_s=round(time.perf_counter() - t, 3),
            **({"node": self.req.node} if self.req.node else {}),
        )
        return sb

    def release(self, sb: Sandbox) -> None:
        """Kill a sandbox in the background (off the critical path: the agent's sandbox
        goes while the eval runs, the eval's while the session closes); `reap` waits."""
        role = self.sandboxes.pop(sb, "unknown")
        self.note("sandbox_killed", role=role, sandbox_id=sb.id)
        self.killing.append(asyncio.ensure_future(sb.kill()))

    async def reap(self) -> None:
        """Wait for every sandbox kill (so nothing outlives the rollout); a sandbox still
        alive here (a failure, the budget, a cancel) is logged with its own role."""
        with self.timed("cleanup_s"):
            for sb in list(self.sandboxes):
                self.release(sb)
            killing, self.killing = self.killing, []
            for done in await asyncio.gather(*killing, return_exceptions=True):
                if isinstance(done, BaseException):
                    log.warning("rollout %s: a sandbox kill failed: %r", self.sid, done)

    async def prepare(self, sb: Sandbox, role: str) -> str:
        """The task's repository in `sb`, set up; its baseline in `self.bases[role]` (the
        eval's lists the ignored files setup left among the protected paths)."""
        task = self.req.task
        with self.timed("checkout_s"):
            done = await checkout(sb, task)
        repo = done.path
        with self.timed("setup_s"):
            results = await run_setup(sb, task, repo)
            specs = protected_pathspecs(task) if role == "eval" else []
            self.bases[role] = await snapshot(sb, repo, done.commit, specs)
        for cmd, result in zip(
            ["git checkout of base_commit", *task.setup], [done.result, *results], strict=True
        ):
            self.note(
                "command_run",
                role=role,
                cmd=cmd[:500],
                exit_code=result.exit_code,
                duration_s=round(result.duration_s, 3),
            )
        return repo

    async def agent_phase(self) -> bytes:
        req = self.req
        sb = await self.boot("agent")
        repo = await self.prepare(sb, "agent")
        with self.timed("install_s"):
            binary = await ensure_agent(sb, req.agent)
        env = agent_env(
            sb, req.agent, base_url=req.agent_base_url or req.recorder_url, session_id=self.sid
        )
        compaction = await self.compaction()
        env = {**compaction, **env}  # the agent's own `env` wins
        budget = self.deadline - time.monotonic()
        self.note(
            "agent_started", binary=binary, wall_budget_s=round(budget, 3), compaction=compaction
        )
        await self.flush()
        with self.timed("agent_s"):
            run = await run_agent(
                sb,
                req.agent,
                binary=binary,
                repo=repo,
                prompt=req.task.problem_statement,
                env=env,
                timeout_s=budget,
                max_turns=req.turn_budget,
            )
        await self.after_agent(run)
        with self.timed("diff_s"):
            # Nothing of the agent's may run while its work is read: a process left
            # behind had swapped the diff file for a FIFO and hijacked the reader.
            await sb.end_processes()
            try:
                patch = await take_diff(sb, repo, self.bases["agent"])
            except BrokenRepository as exc:
                patch, self.broken = b"", exc
        self.diff = patch
        paths = re.findall(rb"^diff --git a/(.*) b/", patch, flags=re.M)
        self.note(
            "diff_taken",
            bytes=len(patch),
            files=len(paths),
            paths=[p.decode(errors="replace") for p in paths[:200]],
            empty=not patch.strip(),
            **({"broken": str(self.broken)} if self.broken else {}),
            patch=patch[:PATCH_IN_LOG].decode(errors="replace"),
            patch_truncated=len(patch) > PATCH_IN_LOG,
        )
        self.release(sb)
        # Dead before the eval sandbox exists: a process the agent left behind must not
        # get to edit the tree being graded (local sandboxes share one file system).
        with self.timed("cleanup_s"):
            await asyncio.gather(*self.killing, return_exceptions=True)
        return patch

    async def compaction(self) -> dict[str, str]:
        """The agent's compaction settings, from the recorder's context length."""
        if self.req.agent.compact_at is None:
            return {}
        with self.timed("recorder_s"):
            context_length = await self.client.context_length()
        return compaction_env(context_length, self.req.agent.compact_at)

    async def after_agent(self, run: AgentRun) -> None:
        """Record how the agent ended; raise InfraError when that was not the model's doing."""
        with self.timed("recorder_s"):
            info = await self.client.inspect(self.sid)
        self.turns = int(info.get("turns_completed", 0))
        started = int(info.get("turns", 0))
        budget_spent = "turn budget spent" in str(run.result.get("result", "")) or (
            run.result.get("subtype") == "error_max_turns"
        )
        stop = "turn_budget" if budget_spent else run.stop
        self.note(
            "agent_finished",
            stop=stop,
            exit_code=run.exit_code,
            duration_s=round(run.duration_s, 3),
            turns=self.turns,
            result={k: v for k, v in run.result.items() if k != "result"},
            # The transcript's tail only when the agent did not end cleanly.
            **({"output_tail": tail(run.output_tail, 1000)} if run.exit_code != 0 else {}),
        )
        if self.turns == 0 and run.stop == "wall_budget":
            raise InfraError(
                "budget_before_answer",
                f"the wall-clock budget ({self.req.wall_budget_s:g} s) ran out before any answer",
            )
        if (
            run.api_error
            and not budget_spent
            and (
                started > self.turns or re.search(r"\b5\d\d\b|overloaded|onnection", run.api_error)
            )
        ):
            raise InfraError(
                "engine_error", f"the agent ended on an engine failure: {run.api_error}"
            )
        if self.turns == 0 and run.stop == "exited" and run.exit_code != 0:
            raise InfraError(
                "agent_failed",
                f"the agent exited {run.exit_code} before any model answer: "
                f"{tail(run.output_tail, 800)}",
            )

    async def eval_phase(self, patch: bytes) -> Grade:
        if self.broken or not patch.strip():
            failure = self.broken.failure if self.broken else None
            grade = Grade.zero(failure, str(self.broken or "empty diff"))
            self.note("eval_result", **grade.evidence(), empty_diff=True)
            return grade
        with self.timed("eval_s"):
            sb = await self.boot("eval")
            repo = await self.prepare(sb, "eval")
            grade = await self.patched_grade(sb, repo, patch)
        self.note(
            "eval_result", **grade.evidence(), duration_s=round(self.timings.get("grader_s", 0), 3)
        )
        self.release(sb)
        return grade

    async def patched_grade(self, sb: Sandbox, repo: str, patch: bytes) -> Grade:
        """The patch applied and graded.

        A grader that cannot run with the patch (`GraderCannotRun`) but runs without it
        (`grader_runs_unpatched`), and again cannot with it, was broken by the patch: 0,
        `grader_broken_by_patch`. A step that fails because the eval sandbox's own disk
        is full is the patch's doing (setup alone fits: it filled no more of the agent's
        disk of the same size): 0, `disk_full`. An audit's patch of many empty files
        had used up the fresh disk's inodes: `eval_crashed`, a masked 0."""
        try:
            return await self.apply(sb, repo, patch) or await self.grade(sb, repo)
        except GraderCannotRun as exc:
            if not await self.grader_runs_unpatched():
                raise
            try:  # once more with the patch: a grader that fails to start now and then
                return await self.run_grader(sb, repo)  # must not give a correct fix 0
            except GraderCannotRun:
                return Grade.zero("grader_broken_by_patch", exc.message)
        except (InfraError, OSError) as exc:
            if "No space left on device" not in str(exc) or not await sb.filled_its_own_disk():
                raise
            return Grade.zero("disk_full", str(exc))

    async def grader_runs_unpatched(self) -> bool:
        """Does the grader run on a fresh eval sandbox without the patch? Asked only when it
        could not run with it (exit 126/127 before pytest started): a patch that made a
        script the grader sources `exit 127` had turned its 0 into an infrastructure
        abort (an audit's `. ./env.sh && pytest`). Then the patch broke it: 0."""
        sb = await self.boot("eval_unpatched")
        try:
            repo = await self.prepare(sb, "eval_unpatched")
            task = self.req.task
            if task.test_patch and await apply_test_patch(sb, repo, task.test_patch):
                return False  # (it applied on the patched tree: a setup that differs)
            await run_grader(sb, task, repo)
        except GraderCannotRun:
            return False
        finally:
            self.release(sb)
        return True

    async def apply(self, sb: Sandbox, repo: str, patch: bytes) -> Grade | None:
        """Apply the agent's patch; None, or its 0 when it does not apply or changed what
        setup made (`ForgedDiff`: no diff the driver takes does).

        A diff against the tree setup left applies to that same tree by construction,
        so when the eval's setup made the agent's tree again, or at least the content
        of every file the patch changes, a refusal is the agent's doing (its object
        store rewritten): a policy failure, not an infrastructure abort that would mask
        its 0. Otherwise (a setup whose output differs run to run, in a file the patch
        changes) it stays infrastructure."""
        try:
            await apply_patch(sb, repo, patch, self.bases["agent"])
        except ForgedDiff as exc:
            return Grade.zero("diff_forged", str(exc))
        except InfraError as exc:
            tree = self.bases["eval"].tree
            if exc.cause != "patch_apply" or (
                tree != self.bases["agent"].tree
                and not await preimages_in_tree(sb, repo, tree, patch)
            ):
                raise
            return Grade.zero("patch_apply", exc.message)
        self.note("patch_applied", bytes=len(patch))
        return None

    async def grade(self, sb: Sandbox, repo: str) -> Grade:
        """Protected paths back as setup left them, the task's test_patch on top, then the
        grader."""
        task = self.req.task
        base = self.bases["eval"]
        changed = await restore_protected(sb, repo, base, protected_pathspecs(task))
        changed += await remove_path_shadows(sb, repo, base, pythonpath_entries(task))
        await remove_bytecode(sb, repo)
        if changed:
            self.note("protected_restored", paths=changed[:200], count=len(changed))
        if task.test_patch:
            conflict = await apply_test_patch(sb, repo, task.test_patch)
            if conflict is not None:
                return Grade.zero("test_patch_conflict", conflict, protected_changed=changed)
            self.note("test_patch_applied", bytes=len(task.test_patch.encode()))
        self.restored = changed
        return await self.run_grader(sb, repo)

    async def run_grader(self, sb: Sandbox, repo: str) -> Grade:
        """The task's grader on the tree `grade` made ready."""
        t = time.perf_counter()
        grade = await run_grader(sb, self.req.task, repo)
        self.timings["grader_s"] = time.perf_counter() - t
        return msgspec.structs.replace(grade, protected_changed=self.restored)

    async def finish(self, grade: Grade) -> RolloutResult:
        await self.flush()
        with self.timed("recorder_s"):
            closing = self.client.close_session(
                self.sid, reward=grade.reward, reward_detail=grade.evidence()
            )
            reaping = asyncio.ensure_future(self.reap())
            try:
                result = await closing
            finally:
                await asyncio.shield(reaping)
        return RolloutResult(
            session_id=self.sid,
            outcome="passed" if grade.passed else "failed",
            reward=grade.reward,
            samples=result.samples,
            evidence=grade.evidence(),
            turns=self.turns,
            timings=self.total_timings(),
            diff=self.diff.decode(errors="replace"),
        )

    def total_timings(self) -> dict[str, float]:
        return {**self.timings, "total_s": time.perf_counter() - self.started}

    async def fail(self, cause: str, message: str) -> RolloutResult:
        """Close the session aborted: its samples are the reducer's same-shape placeholders."""
        log.warning("rollout %s: infrastructure failure %s: %s", self.sid, cause, message)
        await self.reap()
        if not self.opened:
            return placeholder_result(self.req, None, cause, message, timings=self.total_timings())
        self.note("failed", cause=cause, message=message[-2000:])
        try:
            await self.flush()
            with self.timed("recorder_s"):
                result = await self.client.close_session(
                    self.sid, status="aborted", reason=f"{cause}: {message[:500]}"
                )
        except RecorderError as exc:
            log.warning("rollout %s: cannot close the session: %s", self.sid, exc)
            return placeholder_result(
                self.req, self.sid, cause, message, turns=self.turns, timings=self.total_timings()
            )
        return RolloutResult(
            session_id=self.sid,
            outcome="infra_error",
            reward=0.0,
            samples=result.samples,
            infra_cause=cause,
            evidence={"error": message[-2000:]},
            turns=self.turns,
            timings=self.total_timings(),
        )

    async def run(self) -> RolloutResult:
        try:
            await self.open()
            patch = await self.agent_phase()
            grade = await self.eval_phase(patch)
            return await self.finish(grade)
        except InfraError as exc:
            return await self.fail(exc.cause, exc.message)
        except RecorderError as exc:
            return await self.fail("recorder_unreachable", str(exc))
        except CommandTimeout as exc:
            return await self.fail("setup_failed", str(exc))
        except SandboxError as exc:
            return await self.fail("sandbox_gone", f"{type(exc).__name__}: {exc}")
        except Exception:
            trace = traceback.format_exc()
            log.error("rollout %s: driver error\n%s", self.sid, trace)
            return await self.fail("driver_error", trace)


async def run_rollout(
    req: RolloutRequest, *, on_cancelled: Callable[[RolloutResult], None] | None = None
) -> RolloutResult:
    """Run one rollout to its samples. Never raises; CancelledError passes through after
    the agent is killed, the sandboxes are removed and the session is closed aborted.

    `on_cancelled` gets the result of that cleanup (status aborted, infra cause
    `cancelled`) before CancelledError is raised, if the rollout had opened its
    session: so what a caller writes out agrees with the log (`replay export`).
    """
    try:
        async with RecorderClient(req.recorder_url, req.admin_token) as client:
            rollout = _Rollout(req, client)
            try:
                return await rollout.run()
            except asyncio.CancelledError:
                cleanup = asyncio.ensure_future(
                    rollout.fail("cancelled", "the rollout was stopped")
                )
                await finish_despite_cancel([cleanup])
                if on_cancelled is not None and rollout.opened:
                    notify(on_cancelled, _cancelled_result(req, rollout.sid, cleanup))
                raise
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.error("rollout of %s failed outside its steps", req.task.instance_id, exc_info=True)
        return placeholder_result(req, None, "driver_error", f"{type(exc).__name__}: {exc}")


async def abort_rollout(req: RolloutRequest, cause: str, message: str) -> RolloutResult:
    """Close the session of a rollout whose runner is gone (its Ray node died): `aborted`,
    a `failed` event with `cause`, the reducer's placeholders; the same `fail` step as a
    rollout that failed on its own. `req.session_id` names the session; if it was never
    opened, the result is a placeholder with no session."""
    assert req.session_id is not None, "abort_rollout needs the session id the runner used"
    async with RecorderClient(req.recorder_url, req.admin_token) as client:
        rollout = _Rollout(req, client)
        try:
            await client.inspect(rollout.sid)
        except RecorderRefused:  # never opened: nothing in the log to close
            return placeholder_result(req, None, cause, message)
        except RecorderError as exc:
            return placeholder_result(req, rollout.sid, cause, f"{message}; {exc}")
        rollout.opened = True
        return await rollout.fail(cause, message)


def _cancelled_result(
    req: RolloutRequest, sid: str, cleanup: asyncio.Future[RolloutResult]
) -> RolloutResult:
    """The cleanup's result, or a placeholder of the same meaning if the cleanup failed."""
    if cleanup.cancelled() or cleanup.exception() is not None:
        return placeholder_result(req, sid, "cancelled", "the rollout was stopped")
    return cleanup.result()


async def run_group(
    reqs: Sequence[RolloutRequest],
    *,
    concurrency: int | None = None,
    on_start: Callable[[int], None] | None = None,
    on_result: Callable[[int, RolloutResult], None] | None = None,
    ray: RayOptions | None = None,
) -> list[RolloutResult]:
    """Run rollouts concurrently (at most `concurrency` at once), results in `reqs` order.

    With `ray`, each rollout is a task on that Ray cluster (`recorder.rollout.cluster`),
    with the same callbacks, isolation and cancellation; without it Ray is not imported.

    One rollout's exception never cancels its siblings: its real traceback is
    logged and it yields a placeholder result of the same shape. `on_start` /
    `on_result` (index into `reqs`) feed a progress display and an output file;
    when the group is cancelled, `on_result` also gets each started rollout's
    aborted result (infra cause `cancelled`) before CancelledError is raised.
    """
    if ray is not None:
        from recorder.rollout.cluster import run_group_ray

        return await run_group_ray(
            reqs, ray, concurrency=concurrency, on_start=on_start, on_result=on_result
        )
    gate = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(i: int, req: RolloutRequest) -> RolloutResult:
        async with gate if gate is not None else contextlib.nullcontext():
            notify(on_start, i)
            try:
                result = await run_rollout(req, on_cancelled=lambda r: notify(on_result, i, r))
            except Exception as exc:  # run_rollout does not raise; this is the last guard
                log.error("rollout of %s raised", req.task.instance_id, exc_info=exc)
                result = placeholder_result(req, None, "driver_error", traceback.format_exc())
        notify(on_result, i, result)
        return result

    return await run_all([one(i, r) for i, r in enumerate(reqs)])


async def run_all(coros: Sequence[Awaitable[T]]) -> list[T]:
    """Run every rollout coroutine at once and return their results in order.

    Not gather: on cancel it would re-raise the first child's CancelledError at once,
    while its siblings are still killing agents and closing sessions. Here a cancel
    reaches every task and returns only once all of them have cleaned up.
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        if tasks:  # asyncio.wait refuses an empty set
            await asyncio.wait(tasks)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        await finish_despite_cancel(tasks)
        raise
    return [task.result() for task in tasks]


async def finish_despite_cancel(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Wait until every task is done, even if this waiter is cancelled again meanwhile
    (cleanup — agents killed, sandboxes removed, sessions closed — always completes)."""
    pending = set(tasks)
    while pending:
        try:
            _, pending = await asyncio.wait(pending)
        except asyncio.CancelledError:
            continue


def notify(callback: Callable[..., None] | None, *args: Any) -> None:
    """Call a progress callback; its failure is logged, never a rollout's."""
    if callback is None:
        return
    try:
        callback(*args)
    except Exception:
        log.exception("a rollout progress callback failed")
