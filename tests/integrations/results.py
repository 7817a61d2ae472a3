"""Driver results made of real reducer samples (the event-log builders of tests/replay).

A hook converts `RolloutResult.samples`, which the recorder's close answer
builds with `replay.reducer`; so these tests build them the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from recorder.rollout.driver import RolloutResult
from replay.reducer import reduce_session
from replay.rules import Rules
from tests.replay.builders import Attempt, Log

SUB = "sys-sub"


def fan_out_log(
    session_id: str = "s1", *, routed: tuple[int, int] | None = None, **meta: Any
) -> Log:
    """A session with a subagent, a compaction and a final chain: three segments."""

    def att(out: list[int], n_in: int) -> list[Attempt]:
        if routed is None:
            return [Attempt(out)]
        rows = np.arange((n_in + len(out)) * routed[0] * routed[1]).reshape(-1, *routed) % 7 + 1
        return [Attempt(out, routed=rows)]

    log = Log(session_id).open(**meta)
    m = log.turn([1, 2, 3], attempts=att([30], 3), tool_uses=[("ag", "Agent")])
    s = log.turn([50, 51], attempts=att([60, 61], 2), system=SUB)
    log.turn(s.then([52]), attempts=att([62, 2], 5), system=SUB)
    log.turn(m.then([8]), attempts=att([33, 2], 5), tool_results=["ag"])
    w = log.turn([1, 2, 77], attempts=att([24], 3))
    log.turn(w.then([7]), attempts=att([25, 2], 5))
    return log


def result_of(
    log: Log,
    *,
    reward: float = 1.0,
    outcome: str = "passed",
    rules: Rules | None = None,
    close: bool = True,
) -> RolloutResult:
    if close:
        log.reward(reward).close()
    reduced = reduce_session(log.events, log.arrays, rules or Rules())
    return RolloutResult(
        session_id=log.session_id,
        outcome=outcome,
        reward=reward,
        samples=reduced.samples,
        turns=reduced.turns_total,
        timings={"agent_s": 3.0, "eval_s": 1.0, "total_s": 4.5},
    )


def infra_failure(cause: str = "sandbox_boot") -> RolloutResult:
    log = Log("broken").open()
    log.turn([1, 2], [3, 2])
    log.fail(cause).close("failed", reason=cause)
    reduced = reduce_session(log.events, log.arrays, Rules())
    return RolloutResult(
        session_id="broken",
        outcome="infra_error",
        reward=0.0,
        samples=reduced.samples,
        infra_cause=cause,
    )
