"""An answer the client went on to act on is trained, whatever branch it sits in.

Hand-written logs of the histories that change in ways a plain retry does
not: Claude Code's partial compaction at the context limit (the summary
request re-sends only the head of the conversation; the answers after it
come back verbatim after the summary), several rounds of it, and the
retries and regenerates whose answers no later request ever used.
"""

from __future__ import annotations

from builders import Log, TurnRef

from replay.reducer import reduce_session
from replay.rules import Rules
from replay.samples import SessionResult, check_invariants, trainable_tokens

NO_SEGMENT = "in no segment (abandoned branch, nested or orphan chain)"


def reduce(log: Log) -> SessionResult:
    return reduce_session(log.events, log.arrays, Rules())


def shape(r: SessionResult) -> list[tuple[str, list[int]]]:
    return [(s.kind, s.turns) for s in r.segments]


def every_token_trained(r: SessionResult) -> None:
    acc = r.token_accounting
    assert NO_SEGMENT not in acc, acc
    assert acc["trained"] == acc["engine output"], acc
    assert sum(trainable_tokens(s) for s in r.samples) == acc["engine output"]


def engine_tokens(turns: list[TurnRef]) -> list[tuple[int, int, float]]:
    return [
        (len(t.input) + j, tok, lp)
        for t in turns
        for j, (tok, lp) in enumerate(zip(t.output, t.logprobs, strict=True))
    ]


def partial_compaction(log: Log, *, keys: bool = True, answered: bool = False) -> list[TurnRef]:
    """The wire of issue 20 (2.1.330, --context-length 18000), one token per message.

    #0 [u1] -> Bash; #1 [.., tool_result] -> "Done."; #2 [.., u2] -> Bash;
    #3 400 prompt is too long (no turn); #4 [u1, A0, tool_result + summary
    instruction] -> summary; #5 [summary, "Done.", u2, A2, tool_result] -> "OK."
    """
    t0 = log.turn([1, 2, 3], [10, 11, 2], tool_uses=[("tu0", "Bash")])
    t1 = log.turn(t0.then([4, 5]), [12, 2], tool_results=["tu0"])
    t2 = log.turn(t1.then([6, 7]), [13, 14, 2], tool_uses=[("tu2", "Bash")])
    summary = log.turn(
        [*t0.then([4]), 8, 9], [15, 16, 2], tool_results=["tu0"], decision=("new", "diverged")
    )
    after = log.turn(
        [1, 30, 12, 6, 13, 14, 31, 9],
        [17, 2],
        decision=("new", "compaction"),
        answers=[t1, t2] if keys else (),
        tool_results=["tu2"] if answered else (),
    )
    return [t0, t1, t2, summary, after]


def test_partial_compaction_trains_the_answers_kept_after_the_summary() -> None:
    log = Log("partial").open()
    t0, t1, t2, summary, after = partial_compaction(log)
    log.reward(1.0).close()
    r = reduce(log)
    assert shape(r) == [("wipe", [0, 1, 2]), ("wipe", [0, 3]), ("final", [4])]
    every_token_trained(r)
    old, summarised, final = r.samples
    # The summary's branch trains the shared first turn; the old context holds it as context.
    assert old.metadata["turns_trained_elsewhere"] == [0]
    assert summarised.metadata["turns_trained_elsewhere"] == []
    assert old.tokens == t2.full and old.prompt_len == len(t0.input)
    check_invariants(old, engine_tokens=engine_tokens([t1, t2]))
    check_invariants(summarised, engine_tokens=engine_tokens([t0, summary]))
    check_invariants(final, engine_tokens=engine_tokens([after]))
    assert not [d for d in r.diagnostics if "abandoned" in d]
    assert any("acted on: turns [1, 2]" in d for d in r.diagnostics)


def test_a_tool_result_alone_is_evidence_too() -> None:
    """A log from before `answer_keys`: the answered tool call still counts."""
    log = Log("partial-v2").open()
    partial_compaction(log, keys=False, answered=True)
    log.close()
    r = reduce(log)
    assert shape(r) == [("wipe", [0, 1, 2]), ("wipe", [0, 3]), ("final", [4])]
    every_token_trained(r)


def test_without_evidence_for_the_last_answer_only_the_turns_before_it_are_trained() -> None:
    """Turn 1 was acted on (turn 2's input carries it); turn 2's answer was never used."""
    log = Log("partial-unused").open()
    partial_compaction(log, keys=False)
    log.close()
    r = reduce(log)
    assert shape(r) == [("wipe", [0, 1]), ("wipe", [0, 3]), ("final", [4])]
    assert r.token_accounting[NO_SEGMENT] == 3  # turn 2's Bash call
    assert any("abandoned branch" in d and "1 turn(s)" in d for d in r.diagnostics)


def test_three_compaction_rounds_train_every_token() -> None:
    log = Log("rounds").open()
    turns = partial_compaction(log)
    after = turns[-1]
    for k in range(2):
        a1 = log.turn(after.then([40 + k]), [50 + k, 2], tool_uses=[(f"tb{k}", "Bash")])
        a2 = log.turn(a1.then([41 + k]), [52 + k, 2], tool_results=[f"tb{k}"])
        log.turn([*after.then([40 + k]), 60, 9], [61, 2], decision=("new", "diverged"))
        after = log.turn(
            [1, 70 + k, 50 + k, 52 + k, 9],
            [71 + k, 2],
            decision=("new", "compaction"),
            answers=[a1, a2],
        )
    log.reward(1.0).close()
    r = reduce(log)
    assert [s.kind for s in r.segments] == ["wipe"] * 6 + ["final"]
    every_token_trained(r)
    for s in r.samples:
        check_invariants(s)


def test_a_retry_after_a_timeout_is_still_abandoned() -> None:
    """The first answer reached no one: the retry's answer was the one acted on."""
    log = Log("retry").open()
    t0 = log.turn([1, 2, 3], [10, 2], tool_uses=[("tu0", "Bash")])
    log.turn(t0.then([4, 5]), [11, 2], tool_uses=[("tu1", "Bash")], tool_results=["tu0"])
    retry = log.turn(
        t0.then([4, 5]),
        [12, 2],
        tool_uses=[("tu1b", "Bash")],
        tool_results=["tu0"],
        decision=("new", "diverged"),
    )
    log.turn(retry.then([6]), [13, 2], tool_results=["tu1b"])
    log.close()
    r = reduce(log)
    assert shape(r) == [("final", [0, 2, 3])]
    assert r.token_accounting[NO_SEGMENT] == 2
    assert any("abandoned branch" in d for d in r.diagnostics)
