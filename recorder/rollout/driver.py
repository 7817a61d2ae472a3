"""One rollout as one awaitable call: task -> sandbox -> agent -> diff -> eval -> reward -> samples.

`run_rollout(RolloutRequest) -> RolloutResult` takes and returns plain,
serialisable msgspec Structs, so a trainer's workers (Ray actors in slime and
verl) can run it anywhere that reaches the recorder over HTTP. `run_group`
runs a GRPO group's samples concurrently with per-trajectory isolation.
"""

from __future__ import annotations

from typing import Any

import msgspec

from recorder.rollout.agent import AgentSpec
from recorder.rollout.sandbox import SandboxSpec
from recorder.rollout.tasks import Task
from replay.samples import Sample

Outcome = str  # "passed" | "failed" | "infra_error"


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
