"""Property tests: arbitrary (also damaged) logs never crash the reducer, and
every sample it builds keeps the invariants."""

from __future__ import annotations

import random

import numpy as np
import pytest
from builders import Attempt, Log, TurnRef
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recorder.log.events import GenerateResult
from replay.reducer import reduce_session
from replay.rules import Rules
from replay.samples import check_invariants, encode_result

tokens = st.lists(st.integers(0, 60), min_size=0, max_size=5)
SYSTEMS = ["sys-main", "sys-sub", "sys-other"]

rules_strategy = st.builds(
    Rules,
    mask_tito_failed=st.booleans(),
    stale_weight_tokens=st.sampled_from(["keep", "mask"]),
    sample_mode=st.sampled_from(["fan_out", "collapse_to_final"]),
    reward_mode=st.sampled_from(["uniform", "copy", "final_only"]),
    max_segments=st.one_of(st.none(), st.integers(1, 4)),
    max_segment_tokens=st.one_of(st.none(), st.integers(2, 30)),
    over_segment_cap=st.sampled_from(["drop", "truncate"]),
    context_length=st.one_of(st.none(), st.integers(2, 40)),
    routed_experts=st.one_of(st.none(), st.just((2, 2))),
    orphan_chains=st.sampled_from(["main", "drop"]),
    placeholder_unclosed=st.booleans(),
    side_requests=st.sampled_from(["drop", "train"]),
)


def random_log(data: st.DataObject) -> Log:
    log = Log("prop", context_length=data.draw(st.one_of(st.none(), st.integers(4, 60))))
    if data.draw(st.booleans()):
        log.open(rollout_id="r")
    done: list[TurnRef] = []
    dispatch_ids: list[str] = []
    for i in range(data.draw(st.integers(0, 10))):
        if done and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(done))
            input_ids = base.then(data.draw(tokens))
        else:
            input_ids = data.draw(st.lists(st.integers(0, 60), min_size=0, max_size=6))
        n_attempts = data.draw(st.integers(1, 3))
        attempts = []
        for k in range(n_attempts):
            out = data.draw(tokens)
            last = k == n_attempts - 1
            routed = None
            if data.draw(st.booleans()):
                rows = data.draw(st.sampled_from([len(out), len(input_ids) + len(out), 3]))
                routed = np.ones((rows, 2, 2), dtype=np.int32)
            attempts.append(
                Attempt(
                    out,
                    version=data.draw(st.sampled_from(["1", "2"])),
                    finish=data.draw(st.sampled_from(["stop", "length", "abort"]))
                    if last
                    else "abort",
                    missing_logprobs=data.draw(st.booleans()) and data.draw(st.booleans()),
                    routed=routed,
                )
            )
        tool_uses = []
        if data.draw(st.booleans()):
            tid = f"d{i}"
            tool_uses.append((tid, data.draw(st.sampled_from(["Agent", "Task", "Bash"]))))
            dispatch_ids.append(tid)
        results = (
            data.draw(st.lists(st.sampled_from(dispatch_ids), max_size=2)) if dispatch_ids else []
        )
        t = log.turn(
            input_ids,
            attempts=attempts,
            system=data.draw(st.sampled_from(SYSTEMS)),
            tool_results=results,
            tool_uses=tool_uses,
            tito_ok=data.draw(st.sampled_from([True, True, False, None])),
            fail=data.draw(st.sampled_from([None, None, None, "boom"])),
            disconnect=data.draw(st.booleans()) and data.draw(st.booleans()),
            respond=data.draw(st.sampled_from([True, True, True, False])),
            n_tools=data.draw(st.sampled_from([None, 0, 3])),
        )
        done.append(t)
        if data.draw(st.integers(0, 9)) == 0:
            log.open(attempt=1)
    if data.draw(st.booleans()):
        log.reward(data.draw(st.floats(-1, 1)))
    if data.draw(st.booleans()):
        log.close(data.draw(st.sampled_from(["completed", "failed", "aborted", "truncated"])))
    return log


def damage(log: Log, data: st.DataObject) -> tuple[list, dict]:
    events = list(log.events)
    arrays = dict(log.arrays)
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    if data.draw(st.booleans()):
        events = [e for e in events if rng.random() > 0.15]
    if data.draw(st.booleans()):
        for key in list(arrays):
            if rng.random() < 0.1:
                del arrays[key]
    if data.draw(st.booleans()) and events:
        events.append(rng.choice(events))  # a duplicated event
    return events, arrays


def engine_pairs(log: Log) -> set[tuple[int, float]]:
    pairs = set()
    for rec in log.events:
        ev = rec.event
        if isinstance(ev, GenerateResult) and ev.logprobs is not None:
            out = log.arrays[ev.output_ids.digest]
            lps = log.arrays[ev.logprobs.digest]
            pairs |= {(int(t), float(lp)) for t, lp in zip(out, lps, strict=True)}
    return pairs


@settings(
    max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(data=st.data(), rules=rules_strategy)
def test_arbitrary_logs_reduce_to_valid_samples(data: st.DataObject, rules: Rules) -> None:
    log = random_log(data)
    events, arrays = damage(log, data)
    result = reduce_session(events, arrays, rules)

    assert not any(d.startswith("reducer error") for d in result.diagnostics), result.diagnostics
    assert result.samples, "a session always yields at least one sample"
    opens = [e.event for e in sorted(events, key=lambda e: e.seq) if e.type == "session_opened"]
    budget = rules.context_length or (opens[-1].context_length if opens else None)
    pairs = engine_pairs(log)
    for s in result.samples:
        check_invariants(s, context_length=budget, routed_experts=rules.routed_experts)
        for i, m in enumerate(s.loss_mask):
            if m:
                assert (s.tokens[s.prompt_len + i], s.rollout_logprobs[i]) in pairs
    if result.placeholder:
        assert all(s.status == "aborted" and s.reward == 0.0 for s in result.samples)
    if rules.max_segments is not None:
        assert len(result.samples) <= rules.max_segments
    assert len({s.rollout_id for s in result.samples}) == 1

    # Every engine output token is trained or untrained for a stated reason.
    acc = dict(result.token_accounting)
    total = acc.pop("engine output")
    assert total == sum(acc.values()), result.token_accounting
    assert acc["trained"] == sum(sum(s.loss_mask) for s in result.samples)
    for s in result.samples:
        assert s.metadata["fully_masked"] is (not any(s.loss_mask))

    again = reduce_session(list(reversed(events)), arrays, rules)
    assert encode_result(again) == encode_result(result)


def test_a_reducer_error_still_accounts_every_engine_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fail-safe's placeholders train nothing, and `replay stats` must say what they
    leave out: found in an audit, it booked nothing, so a session that produced tokens
    read as one that produced none, its balance "ok"."""
    import replay.reducer as reducer

    log = Log("crashy").open()
    t = log.turn([1, 2, 3], [10, 11, 2], tool_uses=[("tu", "Bash")])
    log.turn(t.then([4]), [12, 13, 2], tool_results=["tu"])
    log.reward(1.0).close()

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("a reducer bug")

    monkeypatch.setattr(reducer, "_build_segments", boom)
    result = reducer.reduce_session(log.events, log.arrays, Rules())
    assert result.placeholder
    assert result.token_accounting == {"engine output": 6, "placeholder session": 6, "trained": 0}
