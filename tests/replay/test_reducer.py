"""Reducer unit tests over hand-written event logs (see builders.py)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping

import numpy as np
import pytest
from builders import MAIN, Attempt, Log, TurnRef

from replay.reducer import reduce_session
from replay.rules import Rules
from replay.samples import (
    SessionResult,
    check_invariants,
    encode_result,
    trainable_tokens,
)

SUB = "sys-sub"


def reduce(log: Log, **rules: object) -> SessionResult:
    return reduce_session(log.events, log.arrays, Rules(**rules))  # type: ignore[arg-type]


def engine_tokens(sample_prompt_len: int, chain: list[TurnRef]) -> list[tuple[int, int, float]]:
    """(position, id, logprob) of every token the engine emitted along a chain."""
    out = []
    for t in chain:
        for j, (tok, lp) in enumerate(zip(t.output, t.logprobs, strict=True)):
            out.append((len(t.input) + j, tok, lp))
    return out


def kinds(result: SessionResult) -> list[str]:
    return [s.metadata["segment_kind"] for s in result.samples]


# ---------------------------------------------------------------- linear


def test_linear_session_masks_model_tokens_and_keeps_engine_logprobs() -> None:
    log = Log("lin").open(instance_id="i-7", rollout_id="g3")
    t0 = log.turn([1, 2, 3], [10, 11, 2], tool_uses=[("tu1", "Bash")])
    t1 = log.turn(t0.then([4, 5, 6]), [12, 2], tool_results=["tu1"])
    t2 = log.turn(t1.then([7]), [13, 14, 15, 2])
    log.reward(1.0).close()
    r = reduce(log)

    assert r.status == "completed" and not r.placeholder
    assert [s.kind for s in r.segments] == ["final"]
    (s,) = r.samples
    assert s.tokens == t2.full
    assert s.prompt_len == 3 and s.response_len == len(t2.full) - 3
    assert s.loss_mask == [1, 1, 1, 0, 0, 0, 1, 1, 0, 1, 1, 1, 1]
    assert trainable_tokens(s) == 9
    assert s.rollout_logprobs[:3] == t0.logprobs and s.rollout_logprobs[3:6] == [0.0] * 3
    assert s.weight_versions == ["1"] * 3 + [""] * 3 + ["1"] * 2 + [""] + ["1"] * 4
    assert s.reward == 1.0 and s.rollout_id == "g3"
    assert s.metadata["session"] == {"instance_id": "i-7", "rollout_id": "g3"}
    assert s.metadata["turns"] == [0, 1, 2]
    check_invariants(s, engine_tokens=engine_tokens(3, [t0, t1, t2]))


def test_rollout_id_defaults_to_session_id_and_reward_defaults_to_zero() -> None:
    log = Log("sess-x").open()
    log.turn([1, 2], [3, 2])
    log.close()
    r = reduce(log)
    assert r.samples[0].rollout_id == "sess-x"
    assert r.reward == 0.0 and "no RewardAssigned: reward 0" in r.diagnostics


# ---------------------------------------------------------------- compaction


def compaction_log(status: str = "completed") -> tuple[Log, list[TurnRef], list[TurnRef]]:
    log = Log("cmp").open()
    a0 = log.turn([1, 2, 3], [10, 11])
    a1 = log.turn(a0.then([4]), [12, 13])  # the summary request extends the chain
    b0 = log.turn([1, 2, 99, 98], [20, 21], decision=("new", "compaction"))  # new prefix
    b1 = log.turn(b0.then([5]), [22, 2])
    log.reward(1.0).close(status, reason="" if status == "completed" else "sandbox died")
    return log, [a0, a1], [b0, b1]


def test_compaction_yields_wipe_then_final() -> None:
    log, wiped, final = compaction_log()
    r = reduce(log)
    assert kinds(r) == ["wipe", "final"]
    wipe, fin = r.samples
    assert wipe.tokens == wiped[-1].full and fin.tokens == final[-1].full
    assert wipe.prompt_len == 3 and fin.prompt_len == 4
    assert [s.reward for s in r.samples] == [0.5, 0.5]
    assert {s.rollout_id for s in r.samples} == {"cmp"}
    assert [s.metadata["segment_index"] for s in r.samples] == [0, 1]
    assert all(s.metadata["segment_count"] == 2 for s in r.samples)
    check_invariants(wipe, engine_tokens=engine_tokens(3, wiped))
    check_invariants(fin, engine_tokens=engine_tokens(4, final))


def test_return_to_old_chain_makes_it_final_again() -> None:
    log = Log("back").open()
    a0 = log.turn([1, 2, 3], [10, 11])
    log.turn([1, 2, 9], [20])  # a compaction attempt...
    a1 = log.turn(a0.then([4]), [12, 2])  # ...abandoned: the client continues the old chain
    log.close()
    r = reduce(log)
    assert kinds(r) == ["wipe", "final"]
    assert r.samples[1].tokens == a1.full


# ---------------------------------------------------------------- divergence


def test_retried_request_trains_only_the_answer_the_conversation_kept() -> None:
    log = Log("retry").open()
    log.turn([1, 2, 3], [10, 11])  # its answer never reached the client...
    again = log.turn([1, 2, 3], [12, 13], decision=("new", "diverged"))  # ...which retried
    last = log.turn(again.then([4]), [14, 2])
    log.reward(1.0).close()
    r = reduce(log)
    assert kinds(r) == ["final"]  # no segment for the abandoned answer
    (s,) = r.samples
    assert s.tokens == last.full and s.prompt_len == 3 and s.reward == 1.0
    assert trainable_tokens(s) == 4  # [12, 13] and [14, 2], never [10, 11]
    check_invariants(s, engine_tokens=engine_tokens(3, [again, last]))
    assert any("abandoned branch" in d and "1 turn(s)" in d for d in r.diagnostics)


def test_edited_history_keeps_the_turns_before_the_edit_in_the_branch_that_went_on() -> None:
    log = Log("edit").open()
    a0 = log.turn([1, 2, 3], [10, 11])
    a1 = log.turn(a0.then([4]), [12])
    log.turn(a1.then([5]), [13])  # the turn whose request the user then edited
    b2 = log.turn(a1.then([6, 7]), [14], decision=("new", "diverged"))
    b3 = log.turn(b2.then([8]), [15, 2])
    log.reward(1.0).close()
    r = reduce(log)
    assert kinds(r) == ["final"]
    (s,) = r.samples
    assert s.tokens == b3.full and s.prompt_len == 3
    assert s.metadata["turns"] == [0, 1, 3, 4]  # turn 2's answer was abandoned
    check_invariants(s, engine_tokens=engine_tokens(3, [a0, a1, b2, b3]))


def test_returning_to_the_original_branch_abandons_the_fork() -> None:
    log = Log("fork-back").open()
    a0 = log.turn([1, 2, 3], [10, 11])
    log.turn(a0.then([4]), [12])
    log.turn(a0.then([5]), [13], decision=("new", "diverged"))  # a fork after turn 0...
    a2 = log.turn(a0.then([4, 12, 6]), [14, 2])  # ...but the client goes on with the first
    log.close()
    r = reduce(log)
    assert kinds(r) == ["final"] and r.samples[0].tokens == a2.full
    assert r.samples[0].metadata["turns"] == [0, 1, 3]


def test_forks_before_a_compaction_leave_one_wipe() -> None:
    log = Log("fork-cmp").open()
    a0 = log.turn([1, 2, 3], [10, 11])
    log.turn(a0.then([4]), [12])
    b1 = log.turn(a0.then([5]), [13], decision=("new", "diverged"))
    c0 = log.turn([1, 2, 99], [20, 2], decision=("new", "compaction"))
    log.close()
    r = reduce(log)
    assert kinds(r) == ["wipe", "final"]
    assert r.samples[0].tokens == b1.full  # the branch extended last
    assert r.samples[1].tokens == c0.full


def test_live_decision_disagreement_is_reported() -> None:
    log = Log("dis").open()
    t0 = log.turn([1, 2], [3])
    log.turn(t0.then([4]), [5], decision=("new", "diverged"))
    log.close()
    r = reduce(log)
    assert any("live decision was 'new'" in d for d in r.diagnostics)
    assert kinds(r) == ["final"]


# ---------------------------------------------------------------- subagents


def subagent_log(*, returned: bool = True) -> tuple[Log, dict[str, TurnRef]]:
    log = Log("sub").open()
    m0 = log.turn([1, 2, 3], [10, 11], tool_uses=[("agent-1", "Agent")])
    s0 = log.turn([50, 51], [60, 61], system=SUB)
    s1 = log.turn(s0.then([52]), [62, 2], system=SUB)
    m1 = log.turn(m0.then([4, 5]), [12, 2], tool_results=["agent-1"] if returned else [])
    log.reward(0.9).close()
    return log, {"m0": m0, "s0": s0, "s1": s1, "m1": m1}


def test_subagent_that_never_returned_is_still_its_own_segment() -> None:
    log, t = subagent_log(returned=False)  # the agent exited while the subagent ran
    r = reduce(log)
    assert kinds(r) == ["subagent", "final"]
    assert r.samples[0].tokens == t["s1"].full
    assert r.samples[0].metadata["dispatch_tool_use_id"] == "agent-1"


def test_subagent_dispatch_and_return() -> None:
    log, t = subagent_log()
    r = reduce(log)
    assert kinds(r) == ["subagent", "final"]
    sub, fin = r.samples
    assert sub.tokens == t["s1"].full and sub.prompt_len == 2
    assert sub.metadata["dispatch_tool_use_id"] == "agent-1"
    assert fin.tokens == t["m1"].full
    check_invariants(sub, engine_tokens=engine_tokens(2, [t["s0"], t["s1"]]))
    check_invariants(fin, engine_tokens=engine_tokens(3, [t["m0"], t["m1"]]))
    assert r.samples[0].reward == pytest.approx(0.45)


def test_task_tool_name_also_dispatches_and_parallel_subagents_pair_in_order() -> None:
    log = Log("par").open()
    m0 = log.turn([1, 2], [10], tool_uses=[("a", "Task"), ("b", "Task")])
    sa = log.turn([50], [60], system=SUB)
    sb = log.turn([70], [80], system=SUB)
    sa2 = log.turn(sa.then([51]), [61], system=SUB)
    log.turn(m0.then([3]), [11], tool_results=["a", "b"])
    log.close()
    r = reduce(log)
    assert kinds(r) == ["subagent", "subagent", "final"]
    by_dispatch = {s.metadata["dispatch_tool_use_id"]: s for s in r.samples[:2]}
    assert by_dispatch["a"].tokens == sa2.full
    assert by_dispatch["b"].tokens == sb.full
    # Ordered by completion: b finished (its last turn) before a.
    assert [s.metadata["dispatch_tool_use_id"] for s in r.samples[:2]] == ["b", "a"]


def test_background_subagent_after_its_dispatch_returned_is_still_a_subagent() -> None:
    """A background agent: the tool_result ("Async agent launched") comes back first."""
    log2 = Log("sub2").open()
    m0 = log2.turn([1, 2, 3], [10], tool_uses=[("agent-1", "Agent")])
    log2.turn(m0.then([4]), [11], tool_results=["agent-1"])  # launched, not finished
    log2.turn([50, 51], [60], system=SUB)  # the background subagent's first request
    log2.turn([50, 52], [61], system=SUB)  # a later foreign chain: the dispatch is taken
    log2.close()
    main = reduce(log2, orphan_chains="drop")
    assert [(s.kind, s.dispatch_tool_use_id) for s in main.segments] == [
        ("subagent", "agent-1"),
        ("final", None),
    ]
    assert any("no pending dispatch" in d for d in main.diagnostics)


def test_non_dispatch_tool_does_not_open_a_subagent() -> None:
    log = Log("nd").open()
    m0 = log.turn([1, 2, 3], [10], tool_uses=[("x", "Bash")])
    log.turn([50, 51], [60], system=SUB)
    log.turn(m0.then([4]), [11], tool_results=["x"])
    log.close()
    assert "subagent" not in kinds(reduce(log))


def test_nested_subagent_is_dropped_never_invented() -> None:
    log = Log("nest").open()
    m0 = log.turn([1, 2, 3], [10], tool_uses=[("outer", "Agent")])
    s0 = log.turn([50, 51], [60], system=SUB, tool_uses=[("inner", "Agent")])
    n0 = log.turn([80, 81], [90], system="sys-nested")
    log.turn(n0.then([82]), [91], system="sys-nested")
    s1 = log.turn(s0.then([52]), [61, 2], system=SUB, tool_results=["inner"])
    log.turn(m0.then([4]), [11, 2], tool_results=["outer"])
    log.reward(1.0).close()
    r = reduce(log)
    assert kinds(r) == ["subagent", "final"]
    sub = r.samples[0]
    assert sub.tokens == s1.full
    assert sub.metadata["nested_dropped_turns"] == 2
    assert r.turns_total == 6 and r.turns_used == 4
    assert any("nested subagent" in d for d in r.diagnostics)
    for s in r.samples:
        check_invariants(s)


# ---------------------------------------------------------------- aborts


def abort_log() -> tuple[Log, TurnRef]:
    log = Log("ab").open()
    t0 = log.turn(
        [1, 2, 3],
        attempts=[
            Attempt([10, 11], version="7", finish="abort"),
            Attempt([12, 13, 2], version="8", finish="stop"),
        ],
    )
    log.close()
    return log, t0


def test_abort_resume_stitches_attempts_with_per_token_weight_versions() -> None:
    log, t0 = abort_log()
    r = reduce(log)
    (s,) = r.samples
    assert s.tokens == [1, 2, 3, 10, 11, 12, 13, 2]
    assert s.loss_mask == [1] * 5
    assert s.weight_versions == ["7", "7", "8", "8", "8"]
    assert s.rollout_logprobs == t0.logprobs
    assert s.metadata["aborts"] == 1 and r.aborts == 1
    check_invariants(s, engine_tokens=engine_tokens(3, [t0]))


def test_stale_weight_tokens_can_be_masked() -> None:
    log, _ = abort_log()
    (s,) = reduce(log, stale_weight_tokens="mask").samples
    assert s.loss_mask == [0, 0, 1, 1, 1]
    assert s.rollout_logprobs[:2] == [0.0, 0.0]
    assert s.weight_versions[:2] == ["7", "7"]
    assert s.metadata["stale_weight_masked_tokens"] == 2
    check_invariants(s)


def test_a_turn_moved_off_a_gone_engine_trains_only_the_answered_attempts() -> None:
    """The live server retries a turn on a live engine when its engine is gone: the
    failed attempt (GenerateAttempt + EngineError, no result) adds no token."""
    log = Log("moved").open()
    t0 = log.turn([1, 2, 3], attempts=[Attempt([], gone=True), Attempt([10, 11, 2])])
    t1 = log.turn(
        t0.then([4]),
        attempts=[
            Attempt([12, 13], version="7", finish="abort"),
            Attempt([], gone=True),
            Attempt([14, 2], version="7"),
        ],
    )
    log.close()
    r = reduce(log)
    (s,) = r.samples
    assert s.tokens == [*t1.full]
    assert t0.output == [10, 11, 2] and t1.output == [12, 13, 14, 2]
    assert s.loss_mask == [1, 1, 1, 0, 1, 1, 1, 1]
    assert s.rollout_logprobs == [*t0.logprobs, 0.0, *t1.logprobs]
    check_invariants(s, engine_tokens=engine_tokens(3, [t0, t1]))


def test_turn_ending_in_abort_without_resume_is_unusable() -> None:
    log = Log("ab2").open()
    t0 = log.turn([1, 2], [3, 2])
    log.turn(t0.then([4]), attempts=[Attempt([5, 6], finish="abort")], respond=False)
    log.close()
    r = reduce(log)
    assert r.samples[0].tokens == t0.full
    assert any("aborted and never resumed" in d for d in r.diagnostics)


# ---------------------------------------------------------------- TITO


def test_tito_failed_turn_is_masked_by_default_and_kept_when_rule_off() -> None:
    log = Log("tito").open()
    t0 = log.turn([1, 2], [3, 4], tito_ok=False)
    log.turn(t0.then([5]), [6, 2])
    log.close()
    (masked,) = reduce(log).samples
    assert masked.loss_mask == [0, 0, 0, 1, 1]
    assert masked.rollout_logprobs[:2] == [0.0, 0.0]
    assert masked.metadata["tito_masked_turns"] == [0]
    assert reduce(log).tito_failed_turns == 1
    (kept,) = reduce(log, mask_tito_failed=False).samples
    assert kept.loss_mask == [1, 1, 0, 1, 1]


# ---------------------------------------------------------------- failures


def test_missing_logprobs_turn_is_unusable_never_retokenized() -> None:
    log = Log("nolp").open()
    t0 = log.turn([1, 2], [3, 2])
    log.turn(
        t0.then([4]), attempts=[Attempt([5, 6], missing_logprobs=True)], fail="logprobs missing"
    )
    t2 = log.turn(t0.then([4]), [7, 2])  # the client retried
    log.close()
    r = reduce(log)
    (s,) = r.samples
    assert s.tokens == t2.full
    assert 5 not in s.tokens
    check_invariants(s, engine_tokens=engine_tokens(2, [t0, t2]))


def test_missing_logprobs_without_turn_failed_event_is_still_unusable() -> None:
    log = Log("nolp2").open()
    log.turn([1, 2], attempts=[Attempt([5, 6], missing_logprobs=True)])
    log.close()
    r = reduce(log)
    assert r.placeholder and any("logprobs missing" in d for d in r.diagnostics)


@pytest.mark.parametrize("bad", [0.5, float("nan"), float("-inf"), float("inf")])
def test_logprobs_out_of_range_make_only_their_turn_unusable(bad: float) -> None:
    """A logprob above 0, NaN or infinite drops its turn, named by its attempt."""
    log = Log("badlp").open()
    t0 = log.turn([1, 2], [3, 2])
    log.turn(t0.then([4]), attempts=[Attempt([5, 6], logprobs=[-0.5, bad])])
    t2 = log.turn(t0.then([4]), [7, 2])
    log.close()
    r = reduce(log)
    assert any("turn 1: unusable: attempt 0: logprobs not finite" in d for d in r.diagnostics)
    assert not any(d.startswith(("turn 0: unusable", "turn 2: unusable")) for d in r.diagnostics)
    (s,) = r.samples
    assert s.tokens == t2.full and 5 not in s.tokens
    check_invariants(s, engine_tokens=engine_tokens(2, [t0, t2]))


def test_logprobs_at_zero_and_very_negative_are_in_range() -> None:
    log = Log("edgelp").open()
    t0 = log.turn([1, 2], attempts=[Attempt([3, 2], logprobs=[0.0, -1e30])])
    log.close()
    r = reduce(log)
    assert not any("unusable" in d for d in r.diagnostics)
    (s,) = r.samples
    assert s.tokens == t0.full and s.rollout_logprobs[-2:] == [0.0, float(np.float32(-1e30))]


def test_engine_error_and_disconnect_without_response_are_unusable() -> None:
    log = Log("err").open()
    t0 = log.turn([1, 2], [3, 2])
    log.turn(t0.then([4]), [9], engine_error=True, respond=False)
    log.turn(t0.then([4]), [8], disconnect=True, respond=False)
    log.close()
    r = reduce(log)
    assert r.samples[0].tokens == t0.full
    assert r.turns_used == 1


@pytest.mark.parametrize("status", ["failed", "aborted"])
def test_failed_session_yields_same_shape_placeholders(status: str) -> None:
    log, _, _ = compaction_log(status)
    r = reduce(log, routed_experts=(4, 2))
    assert r.placeholder and r.status == status and r.reward == 0.0
    assert len(r.samples) == 2
    for s in r.samples:
        assert s.status == "aborted" and s.reward == 0.0 and not any(s.loss_mask)
        assert s.routed_experts is not None
        assert s.routed_experts.shape == (len(s.tokens), 4, 2)
        assert not s.routed_experts.to_array().any()
        check_invariants(s, routed_experts=(4, 2))


def test_unclosed_session_yields_placeholders_unless_rule_off() -> None:
    log = Log("open").open()
    log.turn([1, 2], [3, 2])
    r = reduce(log)
    assert r.placeholder and "never closed" in r.diagnostics[-1]
    assert reduce(log, placeholder_unclosed=False).samples[0].loss_mask == [1, 1]


def test_session_with_no_usable_turn_yields_one_minimal_placeholder() -> None:
    log = Log("none", pad_token_id=None).open()
    log.turn([1, 2], [3], fail="engine down")
    log.close()
    r = reduce(log, routed_experts=(3, 2))
    (s,) = r.samples
    assert s.tokens == [2, 2]  # no pad id: the first EOS id
    assert s.status == "aborted" and s.loss_mask == [0]
    assert s.routed_experts is not None and s.routed_experts.shape == (2, 3, 2)
    check_invariants(s, routed_experts=(3, 2))


class ExplodingArrays(Mapping[bytes, np.ndarray]):
    def __getitem__(self, key: bytes) -> np.ndarray:
        raise RuntimeError("disk on fire")

    def __iter__(self) -> Iterator[bytes]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def get(self, key, default=None):  # type: ignore[no-untyped-def, override]
        raise RuntimeError("disk on fire")


def test_reducer_crash_yields_minimal_placeholder_not_exception() -> None:
    log = Log("boom", pad_token_id=5).open(rollout_id="r9")
    log.turn([1, 2], [3, 2])
    log.close()
    r = reduce_session(log.events, ExplodingArrays(), Rules(routed_experts=(2, 2)))
    (s,) = r.samples
    assert r.placeholder and "RuntimeError: disk on fire" in r.diagnostics[0]
    assert s.tokens == [5, 5] and s.rollout_id == "r9" and s.session_id == "boom"
    check_invariants(s, routed_experts=(2, 2))


def test_every_placeholder_fallback_keeps_the_routing_shape() -> None:
    from replay.placeholders import placeholders_for

    class Broken:  # a built sample that cannot even be copied
        tokens = None

    common = {"session_id": "s", "rollout_id": "r", "reason": "failed"}
    layered = placeholders_for(
        [Broken()],  # type: ignore[list-item]
        pad_token_id=7,
        routed_experts=(3, 2),
        metadata={"k": 1},
        **common,
    )
    (s,) = layered  # the copy failed: one minimal sample instead
    assert s.tokens == [7, 7] and s.metadata["k"] == 1
    last_resort = placeholders_for(
        [Broken()],  # type: ignore[list-item]
        pad_token_id=7,
        routed_experts=(3, 2),
        metadata=42,  # type: ignore[arg-type]  # even the minimal sample fails
        **common,
    )
    (s,) = last_resort
    assert s.tokens == [0, 0] and s.metadata["placeholder"] == "placeholder build failed"
    assert (s.session_id, s.rollout_id) == ("s", "r")
    for sample in (*layered, *last_resort):
        check_invariants(sample, routed_experts=(3, 2))


def test_missing_arrays_make_turns_unusable() -> None:
    log = Log("miss").open()
    t0 = log.turn([1, 2], [3, 2])
    log.turn(t0.then([4]), [5, 2])
    log.close()
    arrays = dict(log.arrays)
    last_input = log.events[[e.type for e in log.events].index("rendered_input", 5)].event
    del arrays[last_input.input_ids.digest]  # type: ignore[attr-defined]
    r = reduce_session(log.events, arrays, Rules())
    assert r.samples[0].tokens == t0.full
    assert any("input_ids array" in d and "missing" in d for d in r.diagnostics)


# ---------------------------------------------------------------- empty turns, retries


def test_empty_turn_inside_a_chain_contributes_nothing() -> None:
    log = Log("empty").open()
    t0 = log.turn([1, 2], [3])
    t1 = log.turn(t0.then([4]), [])
    t2 = log.turn(t1.then([5]), [6, 2])
    log.close()
    (s,) = reduce(log).samples
    assert s.tokens == t2.full and s.loss_mask == [1, 0, 0, 1, 1]


def test_session_whose_only_output_is_empty_gets_a_placeholder() -> None:
    log = Log("empty2").open()
    log.turn([1, 2], [])
    log.close()
    r = reduce(log)
    assert r.placeholder and any("no response tokens" in d for d in r.diagnostics)


def test_retried_session_starts_clean_from_last_open() -> None:
    log = Log("retry").open(attempt=0)
    log.turn([1, 2], [3, 4])
    log.reward(1.0).close("aborted")
    log.open(attempt=1)
    log._turn = 0  # the retry numbers its turns from 0 again
    t = log.turn([1, 2], [7, 2])
    log.reward(0.25).close()
    r = reduce(log)
    (s,) = r.samples
    assert s.tokens == t.full and s.reward == 0.25 and not r.placeholder
    assert 3 not in s.tokens and r.turns_total == 1
    assert r.diagnostics == []


# ---------------------------------------------------------------- budgets and caps


def test_tool_output_overflowing_the_context_is_trimmed_together() -> None:
    log = Log("ovf", context_length=12).open()
    t0 = log.turn([1, 2, 3], [10, 11])
    t1 = log.turn(t0.then(list(range(100, 110))), [12, 2])  # a huge tool output
    log.close()
    (s,) = reduce(log).samples
    assert len(s.tokens) == 12 and s.tokens == t1.full[:12]
    assert s.status == "truncated" and s.metadata["truncated"] == ["context budget"]
    assert s.loss_mask == [1, 1] + [0] * 7
    check_invariants(s, context_length=12, engine_tokens=engine_tokens(3, [t0]))


def test_rules_context_length_overrides_session_and_prompt_over_budget_is_masked() -> None:
    log = Log("ovf2", context_length=1000).open()
    log.turn(list(range(1, 20)), [30, 2])
    log.close()
    (s,) = reduce(log, context_length=8).samples
    assert len(s.tokens) == 8 and s.prompt_len == 7 and s.loss_mask == [0]
    assert "prompt alone over budget" in s.metadata["truncated"][0]
    check_invariants(s, context_length=8)


def test_length_finish_marks_sample_truncated() -> None:
    log = Log("len").open()
    log.turn([1, 2], attempts=[Attempt([3, 4], finish="length")])
    log.close()
    r = reduce(log)
    assert r.samples[0].status == "truncated" and r.status == "truncated"


def many_wipes(n: int) -> Log:
    log = Log("many").open()
    for i in range(n):
        t = log.turn([1, 100 + i], [200 + i])
        log.turn(t.then([3]), [300 + i, 2])
    log.reward(1.0).close()
    return log


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("uniform", [0.25, 0.25, 0.25, 0.25]),
        ("copy", [1.0, 1.0, 1.0, 1.0]),
        ("final_only", [0.0, 0.0, 0.0, 1.0]),
    ],
)
def test_reward_modes(mode: str, expected: list[float]) -> None:
    r = reduce(many_wipes(4), reward_mode=mode)
    assert kinds(r) == ["wipe", "wipe", "wipe", "final"]
    assert [s.reward for s in r.samples] == expected


def test_segment_cap_never_drops_the_final_segment() -> None:
    log = Log("nofinal").open()
    m0 = log.turn(list(range(1, 10)), [3], tool_uses=[("a", "Agent")])
    log.turn([50], [60], system=SUB)
    log.turn(m0.then([4]), [5], tool_results=["a"])
    log.reward(1.0).close()
    # The final chain is over the segment cap: truncated (here to nothing), never dropped.
    r = reduce(log, reward_mode="final_only", max_segment_tokens=5)
    assert kinds(r) == ["subagent", "final"]
    sub, fin = r.samples
    assert len(fin.tokens) == 5 and fin.reward == 1.0 and sub.reward == 0.0
    assert fin.metadata["fully_masked"] is True and sub.metadata["fully_masked"] is False
    assert r.token_accounting == {
        "engine output": 3,
        "trained": 1,
        "truncated (segment cap or context budget)": 2,
    }


def test_segment_count_cap_keeps_head_and_final() -> None:
    r = reduce(many_wipes(6), max_segments=3)
    assert [s.tokens[1] for s in r.samples] == [100, 101, 105]
    assert kinds(r) == ["wipe", "wipe", "final"]
    assert [s.reward for s in r.samples] == pytest.approx([1 / 3] * 3)
    assert any("3 middle segment(s) left out" in d for d in r.diagnostics)
    assert [seg.dropped for seg in r.segments].count("over max_segments=3") == 3
    assert len(r.segments) == 6
    assert [s.metadata["segment_index"] for s in r.samples] == [0, 1, 2]


def test_collapse_to_final() -> None:
    r = reduce(many_wipes(3), sample_mode="collapse_to_final")
    assert kinds(r) == ["final"] and r.samples[0].reward == 1.0
    assert r.samples[0].metadata["segment_count"] == 1
    assert [(seg.kind, seg.dropped) for seg in r.segments] == [
        ("wipe", "collapsed to the final segment"),
        ("wipe", "collapsed to the final segment"),
        ("final", None),
    ]


def test_segment_token_cap_drop_and_truncate() -> None:
    log = Log("cap").open()
    a = log.turn([1, 2], [3, 4, 5, 6, 7, 8])  # 8 tokens: over the cap
    log.turn([1, 9], [10, 2])  # 4 tokens
    log.reward(1.0).close()
    dropped = reduce(log, max_segment_tokens=5, over_segment_cap="drop")
    assert kinds(dropped) == ["final"] and dropped.samples[0].reward == 1.0
    assert (
        dropped.segments[0].dropped is not None
        and "over max_segment_tokens" in dropped.segments[0].dropped
    )
    cut = reduce(log, max_segment_tokens=5, over_segment_cap="truncate")
    assert kinds(cut) == ["wipe", "final"]
    assert cut.samples[0].tokens == a.full[:5] and cut.samples[0].status == "truncated"
    for s in cut.samples:
        check_invariants(s, context_length=5)


# ---------------------------------------------------------------- routed experts


def test_routed_experts_follow_tokens() -> None:
    layers, top_k = 2, 2
    log = Log("moe").open()
    full0 = np.arange(5 * layers * top_k).reshape(5, layers, top_k) + 1  # input 3 + output 2
    t0 = log.turn([1, 2, 3], attempts=[Attempt([10, 11], routed=full0)])
    out1 = np.full((2, layers, top_k), 77)  # output-only routing
    log.turn(t0.then([4]), attempts=[Attempt([12, 2], routed=out1)])
    log.close()
    (s,) = reduce(log, routed_experts=(layers, top_k)).samples
    re = s.routed_experts
    assert re is not None and re.shape == (8, layers, top_k)
    arr = re.to_array()
    assert (arr[:5] == full0).all() and (arr[5] == 0).all() and (arr[6:] == 77).all()
    check_invariants(s, routed_experts=(layers, top_k))
    assert reduce(log).samples[0].routed_experts is None


# ---------------------------------------------------------------- determinism, schema


def test_same_log_gives_identical_bytes_whatever_the_event_order() -> None:
    log, _ = subagent_log()
    a = encode_result(reduce(log))
    shuffled = list(log.events)
    random.Random(3).shuffle(shuffled)
    b = encode_result(reduce_session(shuffled, dict(reversed(log.arrays.items())), Rules()))
    assert a == b


def test_old_version_reward_event_reduces() -> None:
    log = Log("v1").open()
    log.turn([1, 2], [3, 2])
    log.reward_v1(0.75).close()
    assert log.events[-2].version == 1
    r = reduce(log)
    assert r.reward == 0.75 and r.samples[0].reward == 0.75


def test_rules_version_is_stamped_on_results_and_samples() -> None:
    log, _ = subagent_log()
    rules = Rules(reward_mode="copy")
    r = reduce_session(log.events, log.arrays, rules)
    assert r.rules_version == rules.version
    assert {s.metadata["rules_version"] for s in r.samples} == {rules.version}


def test_main_system_prompt_is_the_first_requests() -> None:
    log = Log("sys").open()
    m0 = log.turn([1, 2], [3], system=MAIN)
    log.turn(m0.then([4]), [5, 2], system=MAIN)
    log.close()
    assert kinds(reduce(log)) == ["final"]


@pytest.mark.parametrize("title_first", [True, False])
def test_without_tools_the_longer_conversation_is_the_main_line(title_first: bool) -> None:
    """No request offers tools: a short title request is `side` whether it comes first or
    last; the conversation (longer input, two turns) is `final`, every token trained."""
    log = Log("no-tools").open()

    def title() -> None:
        log.turn([90, 91], [92, 2], system="sys-title", n_tools=0, decision=("new", "first"),
                 chain_id=9)  # fmt: skip

    if title_first:
        title()
    m0 = log.turn([1, 2, 3, 4, 5], [6, 2], n_tools=0, decision=("new", "first"))
    m1 = log.turn(m0.then([7, 8]), [9, 2], n_tools=0, prefix_len=7)
    if not title_first:
        title()
    log.close()
    result = reduce(log, side_requests="train")
    assert kinds(result) == ["side", "final"]
    final = result.samples[-1]
    assert sum(final.loss_mask) == len(m0.output) + len(m1.output)


def test_compaction_summary_without_the_last_answer_is_no_fork() -> None:
    """Claude Code's summary request after a tool result leaves out the last answer."""
    log = Log("summary").open()
    t0 = log.turn([1, 2, 3], [10, 2], tool_uses=[("tu1", "Bash")], n_chat_messages=2)
    last_input = t0.then([4, 5, 6])  # tool result + generation prompt
    t1 = log.turn(last_input, [11, 2], tool_results=["tu1"], n_chat_messages=4)
    summary = log.turn(
        [*t0.then([4, 5]), 7, 8, 6],  # tool result + compact instruction + generation prompt
        [12, 2],
        tool_results=["tu1"],
        n_chat_messages=5,
        decision=("new", "compaction"),
    )
    log.turn([1, 2, 9], [13, 2], decision=("new", "compaction"), n_chat_messages=2)
    log.reward(1.0).close()
    r = reduce(log)
    assert [(s.kind, s.turns) for s in r.segments] == [
        ("wipe", [t0.turn, t1.turn]),
        ("wipe", [summary.turn]),
        ("final", [3]),
    ]
    assert sum(trainable_tokens(s) for s in r.samples) == 8
    assert not [d for d in r.diagnostics if "abandoned" in d or "live decision" in d]


def test_a_retry_of_the_last_tool_result_turn_still_forks() -> None:
    """Same tool results but no added message: a retry, the first answer is abandoned."""
    log = Log("retry-tool").open()
    t0 = log.turn([1, 2, 3], [10, 2], tool_uses=[("tu1", "Bash")], n_chat_messages=2)
    log.turn(t0.then([4, 5]), [11, 2], tool_results=["tu1"], n_chat_messages=4)
    log.turn(
        t0.then([4, 5]),
        [12, 2],
        tool_results=["tu1"],
        n_chat_messages=4,
        decision=("new", "diverged"),
    )
    log.close()
    r = reduce(log)
    assert kinds(r) == ["final"]
    assert any("abandoned branch" in d for d in r.diagnostics)
