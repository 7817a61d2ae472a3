"""bench_server's load generator assembles each body from the messages' kept JSON:
the recorder must receive exactly the request the conversation says."""

from __future__ import annotations

import orjson

from tools.bench_server import Session


def test_a_session_body_is_the_conversation_as_json() -> None:
    session = Session(3, prelude_words=4)
    user = {"role": "user", "content": session.prelude + " Session 3, step 0: go."}
    first = session.body(orjson.dumps(user), stream=False)
    assert orjson.loads(first) == {
        "model": "bench", "max_tokens": 64, "stream": False, "messages": [user],
    }  # fmt: skip
    answer = {"role": "assistant", "content": "I will read it."}
    session.messages += (orjson.dumps(user), orjson.dumps(answer))
    again = {"role": "user", "content": "Session 3, step 1: go on."}
    second = session.body(orjson.dumps(again), stream=True)
    assert orjson.loads(second) == {
        "model": "bench", "max_tokens": 64, "stream": True, "messages": [user, answer, again],
    }  # fmt: skip
    # The earlier turn's bytes are a prefix of the next body's messages (an append-only log).
    assert second.startswith(first[: first.index(b"]}")].replace(b"false", b"true", 1))
