"""IdsJson: a session's prompt JSON reuses its previous prompt's, and is always exactly the ids.

The cache may only be used for a prompt that starts with the cached one; a
rewound chain, a token changed anywhere in the prefix, another chain of the
same session or a different session must be encoded from its own ids. Each
case is checked against `orjson.dumps(list(ids))`, the encoding it replaces,
and through the real engine client: the scripted engine receives the ids.
"""

from __future__ import annotations

from array import array

import numpy as np
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from recorder.model.engine import EngineClient
from recorder.model.engine_wire import SamplingParams, new_rid
from recorder.model.ids_json import PER_KEY, IdsJson
from tools.test_engine import ScriptedEngine


def plain(ids: object) -> bytes:
    return orjson.dumps([int(i) for i in ids])  # type: ignore[attr-defined]


def test_an_extended_prompt_encodes_only_its_new_ids_and_equals_a_full_encoding() -> None:
    cache = IdsJson()
    ids = array("i", range(1000, 1100))
    assert cache.encode(ids, "s") == plain(ids)
    assert cache.reused == 0
    ids.extend([7, 70000, 0, 2**31 - 1])
    assert cache.encode(ids, "s") == plain(ids)
    assert cache.reused == 1
    assert cache.encode(ids, "s") == plain(ids)  # the same prompt again (a retry)
    assert cache.reused == 2


def test_a_token_changed_inside_the_cached_prefix_is_never_sent_from_the_cache() -> None:
    cache = IdsJson()
    ids = np.arange(5000, dtype=np.int32)
    cache.encode(ids, "s")
    for where in (0, 2500, 4999):
        other = ids.copy()
        other[where] += 1
        longer = np.concatenate([other, np.array([1, 2, 3], np.int32)])
        assert cache.encode(longer, "s") == plain(longer)
    shorter = ids[:4000]  # a rewound chain: shorter than what was cached
    assert cache.encode(shorter, "s") == plain(shorter)


def test_sessions_do_not_share_prompts_and_a_lists_and_empty_prompts_pass_through() -> None:
    cache = IdsJson()
    ids = array("i", [5, 6, 7])
    cache.encode(ids, "a")
    assert cache.encode(array("i", [5, 6, 7, 8]), "b") == b"[5,6,7,8]"
    assert cache.reused == 0
    assert cache.encode([1, 2], "a") == b"[1,2]"
    assert cache.encode(array("i"), "a") == b"[]"
    assert cache.encode(array("i", [5, 6, 7, 9]), None) == b"[5,6,7,9]"


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["extend", "rewind", "switch", "flip", "other"]),
            st.lists(st.integers(0, 2**31 - 1), max_size=6),
            st.integers(0, 10_000),
        ),
        min_size=1,
        max_size=25,
    ),
    st.integers(0, 400),
)
def test_any_sequence_of_prompts_is_encoded_exactly(
    steps: list[tuple[str, list[int], int]], budget: int
) -> None:
    """Main line and subagent chains of two sessions interleaving, rewinding, changing
    a token, under a byte budget that evicts: every call equals the plain encoding."""
    cache = IdsJson(max_bytes=budget)
    lines = {("s", 0): [1], ("s", 1): [2], ("t", 0): [3]}
    keys = list(lines)
    current = keys[0]
    for op, new, at in steps:
        ids = lines[current]
        if op == "extend":
            ids += new
        elif op == "rewind":
            del ids[at % len(ids) + 1 :]
        elif op == "switch":
            current = keys[at % len(keys)]
            ids = lines[current]
        elif op == "flip":
            ids[at % len(ids)] ^= 1
        else:  # another session's ids under this key
            ids = lines[keys[(keys.index(current) + 1) % len(keys)]]
        sent = array("i", ids)
        assert cache.encode(sent, current[0]) == plain(sent)
        assert cache.held_bytes <= budget
        assert all(len(v) <= PER_KEY for v in cache._by_key.values())


async def test_the_engine_receives_the_exact_ids_of_consecutive_and_resumed_prompts(
    tokenizer: object,
) -> None:
    params = SamplingParams(max_new_tokens=4)
    async with (
        ScriptedEngine(tokenizer, context_length=4096) as engine,  # type: ignore[arg-type]
        EngineClient([engine.url], timeout_s=30) as client,
    ):
        prompt = array("i", range(100, 400))
        sent = [prompt[:]]
        await client.generate(engine.url, prompt, params, new_rid(), session_id="s")
        prompt.extend([11, 12, 13])
        sent.append(prompt[:])
        await client.generate(engine.url, prompt, params, new_rid(), session_id="s")
        changed = prompt[:]
        changed[0] = 99  # same length and tail, first token changed
        sent.append(changed)
        await client.generate(engine.url, changed, params, new_rid(), session_id="s")
        received = [list(r.input_ids) for r in engine.requests]
    assert received == [list(s) for s in sent]
    assert client.ids_json.reused == 1
