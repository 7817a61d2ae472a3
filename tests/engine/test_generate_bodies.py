"""`/generate` bodies that reuse the JSON of a session's previous token ids.

Whatever the cache holds, a body must be byte for byte `orjson.dumps` of the
request: the engine gets exactly the tokens the log records.
"""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recorder.model.engine import EngineClient
from recorder.model.engine_wire import GenerateBodies, SamplingParams
from recorder.model.resume import generate_with_resume
from tools.test_engine import ScriptedEngine


def _fields(rid: str) -> dict[str, object]:
    return {
        "rid": rid,
        "input_ids": None,
        "stream": False,
        "sampling_params": SamplingParams(max_new_tokens=8, stop=("\n",)).to_sglang(),
    }


def _expected(rid: str, ids: np.ndarray) -> bytes:
    return orjson.dumps({**_fields(rid), "input_ids": ids}, option=orjson.OPT_SERIALIZE_NUMPY)


def _ids(draw_ints: list[int]) -> np.ndarray:
    return np.asarray(draw_ints, dtype=np.int32)


# One step of a session's inputs: extend the last one, keep it (a retry), cut it
# (a reset / a shorter chain), fork it (a shared head, then other tokens), or start over.
_STEP = st.one_of(
    st.tuples(st.just("extend"), st.lists(st.integers(0, 2**31 - 1), max_size=40)),
    st.tuples(st.just("same"), st.just([])),
    st.tuples(st.just("cut"), st.integers(0, 60)),
    st.tuples(st.just("fork"), st.integers(0, 60), st.lists(st.integers(0, 200_000), max_size=9)),
    st.tuples(st.just("fresh"), st.lists(st.integers(0, 200_000), max_size=30)),
)


def _apply(ids: np.ndarray, step: tuple) -> np.ndarray:  # type: ignore[type-arg]
    kind = step[0]
    if kind == "extend":
        return np.concatenate([ids, _ids(step[1])])
    if kind == "same":
        return ids.copy()
    if kind == "cut":
        return ids[: step[1]].copy()
    if kind == "fork":
        return np.concatenate([ids[: step[1]], _ids(step[2])])
    return _ids(step[1])


@settings(max_examples=200, deadline=None)
@given(st.lists(_STEP, max_size=25), st.integers(0, 4000))
def test_every_body_is_the_json_of_its_request(steps: list, budget: int) -> None:  # type: ignore[type-arg]
    bodies = GenerateBodies(budget)
    ids = np.zeros(0, np.int32)
    for i, step in enumerate(steps):
        ids = _apply(ids, step)
        rid = f"{i:032x}"
        assert bodies.build("s", _fields(rid), ids) == _expected(rid, ids)
        assert bodies.held_bytes <= budget


def test_a_session_extending_its_input_reuses_the_previous_array() -> None:
    bodies = GenerateBodies(1 << 20)
    first = np.arange(1000, dtype=np.int32)
    body = bodies.build("s", _fields("a" * 32), first)
    # The held body is the one sent: nothing else is kept for the session.
    assert bodies.held_bytes == len(body) and len(bodies) == 1
    second = np.concatenate([first, np.array([7, 8, 9], np.int32)])
    assert bodies.build("s", _fields("b" * 32), second) == _expected("b" * 32, second)
    # Another session's body never stands in for this one's.
    other = np.concatenate([first[:10], np.array([5], np.int32)])
    assert bodies.build("t", _fields("c" * 32), other) == _expected("c" * 32, other)
    assert len(bodies) == 2


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_holds_the_sessions_that_fit_and_frees_idle_ones() -> None:
    ids = np.arange(100, dtype=np.int32)
    one = len(_expected("a" * 32, ids))
    clock = _Clock()
    bodies = GenerateBodies(2 * one, idle_s=60.0, clock=clock)
    for key in ("a", "b", "c"):
        bodies.build(key, _fields("a" * 32), ids)
    # Full of bodies in use: the newcomer is not kept, nothing is pushed out.
    assert ("a" in bodies, "b" in bodies, "c" in bodies) == (True, True, False)
    assert bodies.held_bytes == 2 * one
    clock.now = 61.0
    bodies.build("c", _fields("a" * 32), ids)  # "a" went idle: its room goes to "c"
    assert ("a" in bodies, "b" in bodies, "c" in bodies) == (False, True, True)
    assert bodies.held_bytes == 2 * one
    bodies.forget("c")
    assert len(bodies) == 1 and bodies.held_bytes == one
    nothing = GenerateBodies(0)
    assert nothing.build("a", _fields("a" * 32), ids) == _expected("a" * 32, ids)
    assert len(nothing) == 0 and nothing.held_bytes == 0


def test_a_session_with_a_kept_body_pushes_out_the_least_recently_used() -> None:
    """A session that had a body keeps its (longer) next one: the oldest makes room."""
    ids = np.arange(100, dtype=np.int32)
    one = len(_expected("a" * 32, ids))
    bodies = GenerateBodies(2 * one + 10, idle_s=60.0, clock=_Clock())
    bodies.build("a", _fields("a" * 32), ids)
    bodies.build("b", _fields("a" * 32), ids)
    longer = np.arange(110, dtype=np.int32)
    assert bodies.build("a", _fields("a" * 32), longer) == _expected("a" * 32, longer)
    assert ("a" in bodies, "b" in bodies) == (True, False)
    assert bodies.held_bytes == len(_expected("a" * 32, longer))


@pytest.mark.parametrize("sessions", [3, 5, 9])
def test_sessions_in_rotation_beyond_the_budget_still_find_their_bodies(sessions: int) -> None:
    """More sessions than the budget holds, taking turns round-robin (many agents at
    once): the bodies that fit stay kept and are found every round (plain LRU would
    drop each body just before its session's next turn: no turn would find one)."""
    clock = _Clock()
    ids = {k: np.arange(1000, dtype=np.int32) + k for k in range(sessions)}
    one = len(_expected("a" * 32, ids[0]))
    bodies = GenerateBodies(2 * one + one // 2, idle_s=60.0, clock=clock)
    found = 0
    for _ in range(6):
        for k in range(sessions):
            clock.now += 1.0
            found += str(k) in bodies
            ids[k] = np.append(ids[k], np.int32(7))  # the next turn extends the input
            body = bodies.build(str(k), _fields("a" * 32), ids[k])
            assert body == _expected("a" * 32, ids[k])
    assert found == 2 * 5  # two sessions fit; each finds its body in rounds 2..6
    assert bodies.held_bytes <= bodies.budget_bytes


def test_no_key_keeps_nothing() -> None:
    bodies = GenerateBodies(1 << 20)
    ids = np.arange(10, dtype=np.int32)
    assert bodies.build(None, _fields("a" * 32), ids) == _expected("a" * 32, ids)
    assert len(bodies) == 0


async def test_the_engine_gets_each_turns_exact_ids(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Turns of one session that extend, retry and fork: the engine reads exactly the ids."""
    prompt = tokenizer.encode("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(max_new_tokens=6)
    async with (
        ScriptedEngine(tokenizer, context_length=4096) as engine,
        EngineClient([engine.url]) as client,
    ):
        sent: list[list[int]] = []
        ids = list(prompt)
        for turn in range(5):
            if turn == 3:
                ids = ids[: len(prompt) - 2] + tokenizer.encode("a longer fork " * 30)
            out = await generate_with_resume(
                client,
                engine.url,
                np.asarray(ids, np.int32),
                params,
                on_attempt=_nothing,
                on_result=_nothing,
                session_id="s1",
            )
            sent.append(list(ids))
            if turn != 1:  # turn 2 retries turn 1's input
                ids = ids + out.output_ids + tokenizer.encode("\nmore")
        assert len(client.bodies) == 1
    assert [r.input_ids for r in engine.requests] == sent


async def _nothing(*_: object) -> None:
    return None
