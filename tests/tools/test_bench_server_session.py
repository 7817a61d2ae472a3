"""bench_server's load generator assembles each body from the messages' kept JSON:
the recorder must receive, byte for byte, the request `json.dumps` would send."""

from __future__ import annotations

import json

from tools.bench_server import Session, encode_message


def request(messages: list[dict[str, str]], stream: bool) -> bytes:
    body = {"model": "bench", "max_tokens": 64, "messages": messages, "stream": stream}
    return json.dumps(body).encode()


def test_a_session_body_is_the_conversation_as_json_dumps_writes_it() -> None:
    session = Session(3, prelude_words=4)
    user = {"role": "user", "content": session.prelude + ' Session 3, "step" 0: go é.'}
    first = session.body(encode_message(user), stream=False)
    assert first == request([user], stream=False)
    answer = {"role": "assistant", "content": "I will read it.\n"}
    session.messages += (encode_message(user), encode_message(answer))
    again = {"role": "user", "content": "Session 3, step 1: go on."}
    second = session.body(encode_message(again), stream=True)
    assert second == request([user, answer, again], stream=True)
    # Turns alternate "stream": it comes after the messages, so each body starts with
    # the previous one's messages (the prefix the recorder stores a body's delta from).
    assert second.startswith(first[: first.rindex(b"]")])
