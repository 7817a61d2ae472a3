"""End to end through the official SDK: what the agent sees and what the log holds."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sqlite3
from typing import Any

import anthropic
import pytest
import zstandard

from recorder.dialects.translate import parse_request
from recorder.log import events as ev
from recorder.model.tokens import full_input_ids
from recorder.server.deltas import MIN_SHARED_BYTES, shared_prefix_len
from tests.server.conftest import (
    SYSTEM,
    TOOLS,
    Harness,
    array_rows,
    make_harness,
    tool_call_text,
)
from tools.test_engine import Fault
from tools.test_engine.scripted import Reply, hashed_logprob


async def ask(
    client: anthropic.AsyncAnthropic, messages: list[dict[str, Any]], *, stream: bool, **kw: Any
) -> Any:
    kw.setdefault("system", SYSTEM)
    kw.setdefault("tools", TOOLS)
    kw.setdefault("max_tokens", 256)
    if stream:
        async with client.messages.stream(model="test-model", messages=messages, **kw) as s:
            return await s.get_final_message()
    return await client.messages.create(model="test-model", messages=messages, **kw)


def echo(message: Any) -> dict[str, Any]:
    """The assistant message a client sends back for a response."""
    return {
        "role": "assistant",
        "content": [
            b.model_dump(
                exclude_none=True, exclude={"citations", "caller", "toolset_name", "parsed_output"}
            )
            for b in message.content
        ],
    }


def tool_result(tool_use_id: str, text: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": text}],
    }


async def turn_tokens(h: Harness, session_id: str) -> list[tuple[list[int], list[int]]]:
    """(engine input, engine output) per answered turn, from the log."""
    inputs: dict[int, list[int]] = {}
    outputs: dict[int, list[int]] = {}
    for e in await h.payloads(session_id):
        if isinstance(e, ev.RenderedInput):
            inputs[e.turn] = await h.array(e.input_ids)  # type: ignore[assignment]
        elif isinstance(e, ev.GenerateResult):
            outputs.setdefault(e.turn, []).extend(await h.array(e.output_ids))  # type: ignore[arg-type]
    return [(inputs[t], outputs.get(t, [])) for t in sorted(inputs)]


async def open_raw_stream(h: Harness, sid: str, content: str, max_tokens: int) -> Any:
    """POST a streaming request with raw aiohttp (to drop it at will); read `message_start`."""
    body = {
        "model": "m",
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": content}],
    }
    assert h.http is not None
    resp = await h.http.post(
        h.url + "/v1/messages", json=body, headers={"Authorization": f"Bearer {sid}"}
    )
    assert resp.status == 200
    first = await resp.content.readuntil(b"\n\n")
    assert first.startswith(b"event: message_start")
    return resp


async def wait_for_events(h: Harness, sid: str, kind: type) -> list[Any]:
    """The session's events of `kind`, once there are any (empty after ~10 s)."""
    for _ in range(200):
        found = await h.payloads(sid, kind)
        if found:
            return found
        await asyncio.sleep(0.05)
    return []


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_multi_turn_tool_use(any_harness: Harness, stream: bool) -> None:
    h = any_harness
    sid = await h.open_session(instance_id="repo-1", sample_index=0, group_index=3)
    client = h.client(sid)
    h.engine.push(
        tool_call_text("Bash", {"command": "ls"}, preface="Let me look around.\n"),
        Reply(
            text="<think>\nThe listing shows a.txt.\n</think>\n\n"
            + tool_call_text("Bash", {"command": "cat a.txt"})
        ),
        "The file says hello. Done.",
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is in this repo?"}]
    first = await ask(client, messages, stream=stream)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use"]
    assert first.content[0].text.strip() == "Let me look around."
    assert first.content[1].name == "Bash" and first.content[1].input == {"command": "ls"}
    assert first.content[1].id.startswith("toolu_")

    messages += [echo(first), tool_result(first.content[1].id, "a.txt")]
    second = await ask(client, messages, stream=stream, thinking={"type": "adaptive"})
    assert second.stop_reason == "tool_use"
    assert second.content[0].type == "thinking"
    assert second.content[0].thinking.strip() == "The listing shows a.txt."
    assert second.content[0].signature

    messages += [echo(second), tool_result(second.content[-1].id, "hello")]
    third = await ask(client, messages, stream=stream)
    assert third.stop_reason == "end_turn"
    assert third.content[0].text == "The file says hello. Done."
    assert third.usage.output_tokens > 0
    assert third.usage.cache_read_input_tokens > 0
    assert third.usage.input_tokens < 100  # only the new tokens are uncached

    # The log: every turn extends one chain, token for token.
    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [(d.action, d.reason) for d in decisions] == [
        ("new", "first"),
        ("extend", "extends"),
        ("extend", "extends"),
    ]
    tokens = await turn_tokens(h, sid)
    for (prev_in, prev_out), (cur_in, _) in itertools.pairwise(tokens):
        assert cur_in[: len(prev_in) + len(prev_out)] == prev_in + prev_out
    # ... and exactly what the engine received.
    assert [r.input_ids for r in h.engine.requests] == [t[0] for t in tokens]
    rendered = await h.payloads(sid, ev.RenderedInput)
    assert rendered[1].prefix_len == len(tokens[0][0]) + len(tokens[0][1])
    requests = await h.payloads(sid, ev.MessagesRequest)
    assert [r.turn for r in requests] == [0, 1, 2]
    assert all(r.stream is stream for r in requests)
    assert requests[1].tool_result_ids == (first.content[1].id,)
    sent = await h.payloads(sid, ev.ResponseSent)
    assert [s.stop_reason for s in sent] == ["tool_use", "tool_use", "end_turn"]
    assert sent[0].content[1]["id"] == first.content[1].id
    verdicts = await h.payloads(sid, ev.TitoVerdict)
    assert len(verdicts) == 3
    body = bytes(await h.array(requests[0].body))  # type: ignore[arg-type]
    assert b"What is in this repo?" in body


# The log of a session opened for one plain turn.
ONE_TURN_LOG = [
    "session_opened",
    "messages_request",
    "chain_decision",
    "rendered_input",
    "generate_attempt",
    "generate_result",
    "tito_verdict",
    "response_sent",
    "state_snapshot",
]


async def test_turn_event_order(harness: Harness) -> None:
    h = harness
    sid = await h.open_session()
    await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=False)
    assert await h.types(sid) == ONE_TURN_LOG
    result = (await h.payloads(sid, ev.GenerateResult))[0]
    ids = await h.array(result.output_ids)
    assert result.logprobs is not None
    logprobs = await h.array(result.logprobs)
    assert len(ids) == len(logprobs) > 0
    assert ids[-1] in h.tokenizer.eos_token_ids
    assert result.finish_reason == "stop"


async def test_request_is_stored_after_the_engine_has_it(harness: Harness) -> None:
    """Storing the body and engine input waits until the /generate request is sent,
    so it never competes with sending a long prompt; then it overlaps the engine."""
    h = harness
    sid = await h.open_session()
    puts: list[float] = []
    sent: list[float] = []
    put_array, generate = h.store.put_array, h.ctx.engine.generate

    async def timed_put(*args: Any, **kwargs: Any) -> Any:
        puts.append(asyncio.get_running_loop().time())
        return await put_array(*args, **kwargs)

    async def slow_to_send(*args: Any, on_sent: Any = None, **kwargs: Any) -> Any:
        await asyncio.sleep(0.05)  # the prompt is still on its way

        def note() -> None:
            sent.append(asyncio.get_running_loop().time())
            on_sent()

        return await generate(*args, on_sent=note, **kwargs)

    h.store.put_array = timed_put  # type: ignore[method-assign]
    h.ctx.engine.generate = slow_to_send  # type: ignore[method-assign]
    h.engine.push(Reply(text="ok", token_delay_s=0.02))
    await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=False)
    assert len(sent) == 1 and len(puts) >= 2  # body, input (and the output arrays)
    assert min(puts) >= sent[0]
    assert await h.types(sid) == ONE_TURN_LOG


async def test_stop_reasons(harness: Harness) -> None:
    h = harness
    sid = await h.open_session()
    client = h.client(sid)
    h.engine.push("one two three four five six seven eight nine ten eleven twelve")
    capped = await ask(client, [{"role": "user", "content": "count"}], stream=True, max_tokens=4)
    assert capped.stop_reason == "max_tokens"
    assert capped.usage.output_tokens == 4
    # "STOP" is a whole match; "STO" ends inside the token " STOP" (the engine
    # stops after that token): either way the client gets the text before it.
    for content, stop in (("go", "STOP"), ("again", "STO")):
        h.engine.push("alpha beta STOP gamma")
        stopped = await ask(
            client, [{"role": "user", "content": content}], stream=False, stop_sequences=[stop]
        )
        assert stopped.stop_reason == "stop_sequence"
        assert stopped.stop_sequence == stop
        assert stopped.content[0].text == "alpha beta "
    clamp = await h.payloads(sid, ev.ClampApplied)
    assert clamp == []  # 4 and 256 both fit the context


async def test_an_answer_cut_at_a_stop_sequence_is_extended_token_for_token(
    harness: Harness,
) -> None:
    h = harness
    sid = await h.open_session()
    client = h.client(sid)
    h.engine.push("alpha beta STOP gamma", "Next.")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    stopped = await ask(client, messages, stream=False, stop_sequences=["STOP"])
    assert stopped.content[0].text == "alpha beta "
    messages += [echo(stopped), {"role": "user", "content": "and then?"}]
    await ask(client, messages, stream=False)
    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [d.action for d in decisions] == ["new", "extend"]
    (first_in, first_out), (second_in, _) = await turn_tokens(h, sid)
    assert second_in[: len(first_in) + len(first_out)] == first_in + first_out
    rendered = await h.payloads(sid, ev.RenderedInput)
    assert rendered[1].prefix_len == len(first_in) + len(first_out)


async def test_max_tokens_clamped_to_context(harness: Harness) -> None:
    h = harness
    sid = await h.open_session()
    await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=False, max_tokens=100_000)
    (clamp,) = await h.payloads(sid, ev.ClampApplied)
    (rendered,) = await h.payloads(sid, ev.RenderedInput)
    assert clamp.requested == 100_000
    assert clamp.clamped_to == h.config.context_length - rendered.input_ids.length
    assert h.engine.requests[0].max_new_tokens == clamp.clamped_to


async def test_compaction_starts_a_new_chain(harness: Harness) -> None:
    h = harness
    sid = await h.open_session()
    client = h.client(sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the bug in parser.py"}]
    first = await ask(client, messages, stream=True)
    messages += [echo(first), {"role": "user", "content": "Summarize the conversation so far."}]
    await ask(client, messages, stream=True)
    # Claude Code's next request starts over from a summary: same system, new prefix.
    compacted = [
        {"role": "user", "content": "This session continues from a summary: we fixed parser.py."}
    ]
    await ask(client, compacted, stream=True)
    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [(d.action, d.reason) for d in decisions] == [
        ("new", "first"),
        ("extend", "extends"),
        ("new", "compaction"),
    ]
    assert decisions[2].chain_id != decisions[0].chain_id
    rendered = await h.payloads(sid, ev.RenderedInput)
    assert rendered[2].prefix_len == 0


async def test_concurrent_subagents_and_main_line(harness: Harness) -> None:
    h = harness
    sid = await h.open_session()
    client = h.client(sid)
    h.engine.push(
        tool_call_text("Agent", {"description": "A", "prompt": "Investigate module alpha"})
        + "\n"
        + tool_call_text("Agent", {"description": "B", "prompt": "Investigate module beta"}),
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Investigate both modules"}]
    dispatch = await ask(client, messages, stream=True)
    assert [b.name for b in dispatch.content if b.type == "tool_use"] == ["Agent", "Agent"]
    ids = [b.id for b in dispatch.content if b.type == "tool_use"]

    sub_system = "You are a subagent. Report findings briefly."

    async def subagent(prompt: str, reply: str) -> str:
        h.engine.push(Reply(text=reply, match=prompt))
        msgs: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        out = await ask(client, msgs, stream=True, system=sub_system, tools=[TOOLS[0]])
        return str(out.content[0].text)

    found = await asyncio.gather(
        subagent("Investigate module alpha", "alpha is fine"),
        subagent("Investigate module beta", "beta has a bug"),
    )
    assert found == ["alpha is fine", "beta has a bug"]
    messages += [
        echo(dispatch),
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": ids[0], "content": found[0]},
                {"type": "tool_result", "tool_use_id": ids[1], "content": found[1]},
            ],
        },
    ]
    final = await ask(client, messages, stream=True)
    assert final.stop_reason == "end_turn"
    decisions = await h.payloads(sid, ev.ChainDecision)
    by_turn = {d.turn: d for d in decisions}
    assert by_turn[0].reason == "first"
    subs = [by_turn[1], by_turn[2]]
    assert {d.reason for d in subs} == {"subagent"}
    assert {d.dispatch_tool_use_id for d in subs} == set(ids)
    assert (by_turn[3].action, by_turn[3].chain_id) == ("extend", by_turn[0].chain_id)
    requests = await h.payloads(sid, ev.MessagesRequest)
    assert requests[1].system_digest != requests[0].system_digest
    assert set(requests[3].tool_result_ids) == set(ids)


async def test_abort_then_resume_across_weight_versions(any_harness: Harness) -> None:
    h = any_harness
    sid = await h.open_session()
    text = "The quick brown fox jumps over the lazy dog and keeps running far away."
    h.engine.push(text)
    h.engine.inject(Fault(pause_after=5, pause_s=0.05, new_weight_version="7"))
    answer = await ask(h.client(sid), [{"role": "user", "content": "tell me"}], stream=True)
    assert answer.content[0].text == text
    types = await h.types(sid)
    assert types[4:] == [
        "generate_attempt",
        "generate_result",
        "turn_aborted",
        "turn_resumed",
        "generate_attempt",
        "generate_result",
        "tito_verdict",
        "response_sent",
        "state_snapshot",
    ]
    results = await h.payloads(sid, ev.GenerateResult)
    assert [r.finish_reason for r in results] == ["abort", "stop"]
    assert [r.weight_version for r in results] == ["0", "7"]
    first_ids = await h.array(results[0].output_ids)
    rest_ids = await h.array(results[1].output_ids)
    assert len(first_ids) == 5
    expected = [*h.tokenizer.encode(text), h.tokenizer.eos_token_ids[0]]
    assert first_ids + rest_ids == expected
    # Logprobs stitched: each token keeps the logprob of its absolute position.
    (rendered,) = await h.payloads(sid, ev.RenderedInput)
    start = rendered.input_ids.length
    logprobs = await h.array(results[0].logprobs) + await h.array(results[1].logprobs)  # type: ignore[arg-type,operator]
    assert logprobs == pytest.approx(
        [hashed_logprob(start + i, t) for i, t in enumerate(expected)], abs=1e-6
    )
    (aborted,) = await h.payloads(sid, ev.TurnAborted)
    (resumed,) = await h.payloads(sid, ev.TurnResumed)
    assert aborted.partial_tokens == 5 and resumed.resumed_tokens == 5
    attempts = await h.payloads(sid, ev.GenerateAttempt)
    assert attempts[1].resumed_tokens == 5
    assert h.engine.requests[1].input_ids == h.engine.requests[0].input_ids + first_ids


async def test_client_disconnect_mid_stream_aborts_the_engine(
    tokenizer: Any, sqlite_url: str
) -> None:
    h = await make_harness(tokenizer, sqlite_url, engine_kwargs={"token_delay_s": 0.05})
    try:
        sid = await h.open_session()
        h.engine.push(" ".join(["word"] * 200))
        resp = await open_raw_stream(h, sid, "talk a lot", max_tokens=400)
        while not h.engine.core.running:
            await asyncio.sleep(0.01)
        resp.close()  # the client goes away mid-generation
        (gone,) = await wait_for_events(h, sid, ev.ClientDisconnected)
        (attempt,) = await h.payloads(sid, ev.GenerateAttempt)
        assert gone.rid == attempt.rid
        assert attempt.rid in h.engine.aborts
        assert not any(isinstance(e, ev.ResponseSent) for e in await h.payloads(sid))
        # The session goes on.
        h.engine.push("still here")
        again = await ask(h.client(sid), [{"role": "user", "content": "hello?"}], stream=False)
        assert again.content[0].text == "still here"
    finally:
        await h.close()


async def test_missing_logprobs_fails_the_turn(harness: Harness) -> None:
    h = harness
    sid = await h.open_session()
    h.engine.inject(Fault(logprobs="missing"))
    client = h.client(sid)
    with pytest.raises(anthropic.InternalServerError) as info:
        await ask(client, [{"role": "user", "content": "hi"}], stream=False)
    assert info.value.status_code == 500
    assert info.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    assert "logprobs" in info.value.body["error"]["message"]  # type: ignore[index]
    (failed,) = await h.payloads(sid, ev.TurnFailed)
    assert failed.reason.startswith("missing_logprobs")
    (result,) = await h.payloads(sid, ev.GenerateResult)
    assert result.logprobs is None
    assert not any(isinstance(e, (ev.ResponseSent, ev.TitoVerdict)) for e in await h.payloads(sid))
    ok = await ask(client, [{"role": "user", "content": "hi"}], stream=True)
    assert ok.stop_reason == "end_turn"


async def test_missing_logprobs_mid_stream_is_an_error_event(harness: Harness) -> None:
    h = harness
    sid = await h.open_session()
    h.engine.inject(Fault(logprobs="missing", delay_s=0.3))
    with pytest.raises(anthropic.APIStatusError) as info:
        await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=True)
    assert info.value.body["error"]["type"] == "api_error"  # type: ignore[index]


async def test_engine_5xx_is_overloaded_and_recorded(harness: Harness) -> None:
    h = harness
    sid = await h.open_session()
    h.engine.inject(Fault(status=503, message="scheduler busy"))
    client = h.client(sid)
    with pytest.raises(anthropic.APIStatusError) as info:
        await ask(client, [{"role": "user", "content": "hi"}], stream=False)
    assert info.value.status_code == 529
    assert info.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    (err,) = await h.payloads(sid, ev.EngineError)
    assert (err.kind, err.status) == ("http", 503)
    assert "scheduler busy" in err.message
    ok = await ask(client, [{"role": "user", "content": "hi"}], stream=False)
    assert ok.stop_reason == "end_turn"


async def test_engine_timeout_mid_stream_is_an_overloaded_error_event(
    tokenizer: Any, sqlite_url: str
) -> None:
    h = await make_harness(tokenizer, sqlite_url, turn_budget_s=0.5)
    try:
        sid = await h.open_session()
        h.engine.inject(Fault(delay_s=30))
        client = h.client(sid)
        with pytest.raises(anthropic.APIStatusError) as info:
            await ask(client, [{"role": "user", "content": "hi"}], stream=True)
        assert info.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        (err,) = await h.payloads(sid, ev.EngineError)
        assert err.kind == "timeout"
        (sent,) = h.engine.requests
        assert h.engine.aborts == [sent.rid]  # the engine does not keep generating
        ok = await ask(client, [{"role": "user", "content": "hi"}], stream=True)
        assert ok.stop_reason == "end_turn"  # the session goes on
    finally:
        await h.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_no_answer_goes_out_unless_its_events_are_durable(
    harness: Harness, stream: bool
) -> None:
    h = harness
    sid = await h.open_session()
    append = h.store.append
    failing = True

    async def append_failing_answers(session_id: str, events: Any, **kw: Any) -> Any:
        if failing and any(isinstance(e.event, ev.ResponseSent) for e in events):
            raise OSError("disk full")
        return await append(session_id, events, **kw)

    h.store.append = append_failing_answers  # type: ignore[method-assign]
    h.engine.push("An answer that must not arrive.")
    client = h.client(sid)
    with pytest.raises(anthropic.APIStatusError) as info:
        await ask(client, [{"role": "user", "content": "hi"}], stream=stream)
    assert info.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    assert not await h.payloads(sid, ev.ResponseSent)
    failing = False
    ok = await ask(client, [{"role": "user", "content": "hi"}], stream=stream)
    assert ok.stop_reason == "end_turn"  # the session goes on, rebuilt from its log
    assert len(await h.payloads(sid, ev.ResponseSent)) == 1


async def test_a_non_canonical_output_is_recorded_and_masked(harness: Harness) -> None:
    """An output that decode -> re-encode does not give back fails TITO; its turn is masked."""
    h = harness
    tok = h.tokenizer
    split = [*tok.encode("hel"), *tok.encode("lo")]  # re-encodes as one token
    assert tok.encode(tok.decode(split)) != split
    sid = await h.open_session()
    h.engine.push(Reply(ids=[*split, *tok.eos_token_ids]), "Fine.")
    client = h.client(sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say hello"}]
    first = await ask(client, messages, stream=False)
    assert first.content[0].text == "hello"
    messages += [echo(first), {"role": "user", "content": "Again"}]
    await ask(client, messages, stream=False)
    verdicts = await h.payloads(sid, ev.TitoVerdict)
    assert [(v.ok, v.first_divergence) for v in verdicts] == [(False, 0), (True, None)]
    assert verdicts[0].reencoded_ids is not None
    assert await h.array(verdicts[0].reencoded_ids) == [*tok.encode("hello"), *tok.eos_token_ids]
    status, data = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    assert status == 200, data
    (sample,) = data["samples"]
    assert sample["metadata"]["tito_masked_turns"] == [0]
    tokens, mask, prompt = sample["tokens"], sample["loss_mask"], sample["prompt_len"]
    trained = [t for t, m in zip(tokens[prompt:], mask, strict=True) if m]
    assert tok.decode(trained).startswith("Fine.")  # only the second turn's output


async def test_engine_down(tokenizer: Any, sqlite_url: str) -> None:
    from recorder.server import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    # The stream must not open before the error (a 529 status, not an error
    # event): allow for a loaded machine.
    h = await make_harness(tokenizer, sqlite_url, engine_urls=[dead], first_byte_after_s=10.0)
    try:
        sid = await h.open_session()
        for stream in (False, True):
            with pytest.raises(anthropic.APIStatusError) as info:
                await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=stream)
            assert info.value.status_code == 529
        errors = await h.payloads(sid, ev.EngineError)
        assert [e.kind for e in errors] == ["unreachable", "unreachable"]
        status, state = await h.admin("GET", f"/sessions/{sid}")
        assert status == 200 and state["status"] == "open"
    finally:
        await h.close()


async def test_same_session_requests_are_serialized(tokenizer: Any, sqlite_url: str) -> None:
    h = await make_harness(tokenizer, sqlite_url, engine_kwargs={"token_delay_s": 0.01})
    try:
        sid = await h.open_session()
        client = h.client(sid)
        results = await asyncio.gather(
            *(
                ask(client, [{"role": "user", "content": f"question {i}"}], stream=i % 2 == 0)
                for i in range(6)
            )
        )
        assert all(r.stop_reason == "end_turn" for r in results)
        payloads = (await h.payloads(sid))[1:]
        turns = [getattr(e, "turn", None) for e in payloads if type(e) is not ev.StateSnapshot]
        # Each turn's events are contiguous: no interleaving.
        assert turns == sorted(turns)
        assert sorted(set(turns)) == list(range(6))
    finally:
        await h.close()


async def test_pings_while_the_engine_is_slow(tokenizer: Any, sqlite_url: str) -> None:
    h = await make_harness(tokenizer, sqlite_url)
    try:
        sid = await h.open_session()
        h.engine.inject(Fault(delay_s=1.0))
        body = {
            "model": "m",
            "max_tokens": 50,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        assert h.http is not None
        async with h.http.post(
            h.url + "/v1/messages", json=body, headers={"x-api-key": sid}
        ) as resp:
            raw = (await resp.read()).decode()
        names = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
        assert names[0] == "message_start"
        assert names.count("ping") >= 3
        assert names[-2:] == ["message_delta", "message_stop"]
        assert "content_block_start" in names and "content_block_delta" in names
    finally:
        await h.close()


async def test_streaming_event_shapes(harness: Harness) -> None:
    h = harness
    sid = await h.open_session()
    h.engine.push(
        Reply(
            text="<think>\nplan\n</think>\n\nRunning it.\n"
            + tool_call_text("Bash", {"command": "make"})
        )
    )
    body = {
        "model": "m",
        "max_tokens": 200,
        "stream": True,
        "thinking": {"type": "adaptive"},
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "build"}],
    }
    assert h.http is not None
    async with h.http.post(
        h.url + "/v1/messages?beta=true", json=body, headers={"Authorization": f"Bearer {sid}"}
    ) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    import json

    frames = [f for f in raw.split("\n\n") if f.strip()]
    parsed = []
    for frame in frames:
        event_line, data_line = frame.split("\n")
        parsed.append((event_line[7:], json.loads(data_line[6:])))
    parsed = [p for p in parsed if p[0] != "ping"]
    kinds = [
        (name, data.get("delta", data.get("content_block", {})).get("type"))
        for name, data in parsed
    ]
    assert kinds == [
        ("message_start", None),
        ("content_block_start", "thinking"),
        ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
        ("content_block_start", "text"),
        ("content_block_delta", "text_delta"),
        ("content_block_stop", None),
        ("content_block_start", "tool_use"),
        ("content_block_delta", "input_json_delta"),
        ("content_block_stop", None),
        ("message_delta", None),
        ("message_stop", None),
    ]
    delta = parsed[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"]["output_tokens"] > 0
    assert json.loads(parsed[9][1]["delta"]["partial_json"]) == {"command": "make"}


async def test_unexpected_error_is_contained_to_its_session(harness: Harness) -> None:
    h = harness

    class Exploding:
        label = "exploding test parser"

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def parse(self, text: str, tools: list[dict[str, Any]]) -> Any:
            if "BOOM" in text:
                raise RuntimeError("parser bug triggered by BOOM")
            return await self.inner.parse(text, tools)

    h.ctx.parser = Exploding(h.ctx.parser)  # type: ignore[assignment]
    bad, good = await h.open_session(), await h.open_session()
    h.engine.push(Reply(text="BOOM", match="explode"))
    with pytest.raises(anthropic.InternalServerError) as info:
        await ask(h.client(bad), [{"role": "user", "content": "explode"}], stream=False)
    assert "RuntimeError" in info.value.body["error"]["message"]  # type: ignore[index]
    (failed,) = await h.payloads(bad, ev.SessionFailed)
    assert failed.error_type == "RuntimeError"
    assert "parser bug" in failed.traceback
    # The turn itself is marked failed: its answer never reached the client,
    # so replay must not treat it as an answered turn.
    (turn_failed,) = await h.payloads(bad, ev.TurnFailed)
    assert turn_failed.turn == 0 and "RuntimeError" in turn_failed.reason
    ok = await ask(h.client(good), [{"role": "user", "content": "fine"}], stream=True)
    assert ok.stop_reason == "end_turn"
    # The failed session's state is rebuilt from the log and it keeps serving.
    again = await ask(h.client(bad), [{"role": "user", "content": "fine now"}], stream=False)
    assert again.stop_reason == "end_turn"


async def test_a_failure_while_recording_a_failure_still_answers(harness: Harness) -> None:
    """Seed 001: the error path itself must not crash (format strings, a failing store)."""
    h = harness
    message = "bad {json} %s %(x)s"

    class Exploding:
        label = "exploding test parser"

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def parse(self, text: str, tools: list[dict[str, Any]]) -> Any:
            if "BOOM" in text:
                raise ValueError(message)
            return await self.inner.parse(text, tools)

    append = h.store.append

    async def append_refusing_failures(session_id: str, events: Any, **kw: Any) -> Any:
        if any(isinstance(e.event, ev.SessionFailed) for e in events):
            raise OSError("the disk went away while recording a failure")
        return await append(session_id, events, **kw)

    h.ctx.parser = Exploding(h.ctx.parser)  # type: ignore[assignment]
    h.store.append = append_refusing_failures  # type: ignore[method-assign]
    sid = await h.open_session()
    h.engine.push(Reply(text="BOOM", match="explode"))
    with pytest.raises(anthropic.InternalServerError) as info:
        await ask(h.client(sid), [{"role": "user", "content": "explode"}], stream=True)
    assert message in info.value.body["error"]["message"]  # type: ignore[index]
    again = await ask(h.client(sid), [{"role": "user", "content": "fine now"}], stream=False)
    assert again.stop_reason == "end_turn"


async def test_head_root_health_models(harness: Harness) -> None:
    h = harness
    assert h.http is not None
    async with h.http.head(h.url + "/") as resp:
        assert resp.status == 200
    async with h.http.get(h.url + "/health") as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "ok"
    sid = await h.open_session()
    models = await h.client(sid).models.list()
    assert models.data[0].id


async def test_count_tokens_is_the_real_count(harness: Harness) -> None:
    h = harness
    sid = await h.open_session()
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    counted = await h.client(sid).messages.count_tokens(
        model="m",
        messages=messages,
        system=SYSTEM,
        tools=TOOLS,  # type: ignore[arg-type]
    )
    await ask(h.client(sid), messages, stream=False)
    (rendered,) = await h.payloads(sid, ev.RenderedInput)
    assert counted.input_tokens == rendered.input_ids.length
    assert not any(isinstance(e, ev.RequestRejected) for e in await h.payloads(sid))


@pytest.mark.parametrize("thinking", [None, {"type": "enabled", "budget_tokens": 64}])
async def test_count_tokens_after_hidden_reasoning_is_the_next_turns_input(
    any_harness: Harness, thinking: dict[str, Any] | None
) -> None:
    """The chain keeps the model's `<think>` verbatim; a client that never saw it (thinking
    not enabled) echoes the answer without it. The count is the next turn's real input,
    whether the reasoning was hidden or shown, and counting leaves the session as it was."""
    h = any_harness
    sid = await h.open_session()
    client = h.client(sid)
    extra = {} if thinking is None else {"thinking": thinking}
    h.engine.push(
        Reply(text="<think>\nThe user wants a listing; ls will do it.\n</think>\n\n"
              + tool_call_text("Bash", {"command": "ls"})),
        "It holds a.txt. Done.",
    )  # fmt: skip
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is in this repo?"}]
    first = await ask(client, messages, stream=False, **extra)
    assert any(b.type == "thinking" for b in first.content) == (thinking is not None)
    messages += [echo(first), tool_result(first.content[-1].id, "a.txt")]
    counts = [
        (
            await client.messages.count_tokens(
                model="m",
                messages=messages,
                system=SYSTEM,
                tools=TOOLS,
                **extra,  # type: ignore[arg-type]
            )
        ).input_tokens
        for _ in range(2)
    ]
    fresh = len(full_input_ids(parse_request(json.dumps(
        {"model": "m", "messages": messages, "system": SYSTEM, "tools": TOOLS, **extra}
    ).encode(), count_tokens=True), h.tokenizer))  # fmt: skip
    await ask(client, messages, stream=False, **extra)
    rendered = await h.payloads(sid, ev.RenderedInput)
    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [d.action for d in decisions] == ["new", "extend"]  # type: ignore[attr-defined]
    assert counts == [rendered[-1].input_ids.length] * 2  # type: ignore[attr-defined]
    if thinking is None:  # a from-scratch render misses the hidden reasoning
        assert fresh < counts[0]


async def test_disconnect_recorded_even_when_the_engine_is_paused(
    tokenizer: Any, sqlite_url: str
) -> None:
    h = await make_harness(tokenizer, sqlite_url)
    try:
        sid = await h.open_session()
        h.engine.pause()
        resp = await open_raw_stream(h, sid, "x", max_tokens=20)
        resp.close()
        assert await wait_for_events(h, sid, ev.ClientDisconnected)
        h.engine.resume()
    finally:
        await h.close()


async def test_inputs_are_stored_as_deltas(harness: Harness, sqlite_url: str) -> None:
    """A turn's input is stored as a suffix after the previous input: only new tokens cost."""
    h = harness
    sid = await h.open_session()
    client = h.client(sid)
    messages: list[dict[str, Any]] = []
    for k in range(4):
        messages.append({"role": "user", "content": f"step {k}: " + "more context " * 50})
        answer = await ask(client, messages, stream=k % 2 == 0)
        messages.append(echo(answer))
    rendered = await h.payloads(sid, ev.RenderedInput)
    rows = array_rows(sqlite_url)
    assert rows[rendered[0].input_ids.digest][0] is None
    for prev, cur in itertools.pairwise(rendered):
        parent, total = rows[cur.input_ids.digest]
        # Stored as the delta after the chain's tokens the previous turn's state
        # snapshot stored: its output, as a delta after the previous input.
        grandparent, chain_len = rows[parent]
        assert grandparent == prev.input_ids.digest
        assert prev.input_ids.length < chain_len <= cur.prefix_len
        assert total == cur.input_ids.length
        assert cur.prefix_len > prev.input_ids.length
    # Bodies too: each after the bytes it shares with the previous one.
    requests = await h.payloads(sid, ev.MessagesRequest)
    bodies = [(await h.store.get_array(r.body)).tobytes() for r in requests]
    for r, body in zip(requests, bodies, strict=True):
        assert parse_request(body).n_input_messages == r.n_messages
    for (prev, cur), r in zip(itertools.pairwise(bodies), requests[1:], strict=True):
        if shared_prefix_len(prev, cur) >= MIN_SHARED_BYTES:
            assert rows[r.body.digest][0] is not None
    assert rows[requests[-1].body.digest][0] is not None


WORDS = [f"{w}{i}" for i, w in enumerate(["ls", "src", "def", "test", "x"] * 60)]


async def test_a_max_tokens_changing_every_turn_does_not_store_every_body_whole(
    harness: Harness, sqlite_url: str
) -> None:
    """The Anthropic SDK sends `max_tokens` first (its keys sorted): a client that
    sizes it to the room left changes every body's first bytes. Its bodies still
    cost what they add (`recorder.server.deltas`, a body's stream): measured
    against the same conversation with `max_tokens` constant, in the same log."""
    h = harness
    db = sqlite3.connect(sqlite_url.split("///", 1)[1])

    def body_bytes() -> int:
        query = "SELECT COALESCE(SUM(LENGTH(data)), 0) FROM arrays WHERE dtype = 'uint8'"
        return int(db.execute(query).fetchone()[0])

    async def session(max_tokens: Any) -> tuple[int, list[bytes]]:
        rng = random.Random(5)
        before = body_bytes()
        sid = await h.open_session()
        client = h.client(sid)
        messages: list[dict[str, Any]] = []
        for k in range(8):
            result = " ".join(rng.choice(WORDS) for _ in range(150))  # compresses as prose
            messages.append({"role": "user", "content": f"step {k}: {result}"})
            answer = await ask(client, messages, stream=k % 2 == 1, max_tokens=max_tokens(k))
            messages.append(echo(answer))
        requests = await h.payloads(sid, ev.MessagesRequest)
        bodies = [(await h.store.get_array(r.body)).tobytes() for r in requests]
        for k, body in enumerate(bodies):
            assert json.loads(body)["max_tokens"] == max_tokens(k)
            assert list(json.loads(body))[:2] == ["max_tokens", "messages"]  # the SDK's order
        return body_bytes() - before, bodies

    try:
        constant, _ = await session(lambda k: 256)
        changing, bodies = await session(lambda k: 1100 - 123 * k)
    finally:
        db.close()
    # A few bytes a turn more (a head piece, two 16-byte copies); before, every body
    # was stored whole (compressed) from the second on.
    whole = sum(len(zstandard.ZstdCompressor().compress(b)) for b in bodies)
    assert changing < constant + 8 * 128 < 0.7 * whole  # before: changing == whole


async def test_sessions_spread_across_engines(tokenizer: Any, sqlite_url: str) -> None:
    from tools.test_engine.scripted import ScriptedEngine

    async with ScriptedEngine(tokenizer, context_length=8192) as second:
        h = await make_harness(tokenizer, sqlite_url)
        try:
            first_url = h.engine.url
            await h.stop_server()
            h.engine_urls = [first_url, second.url]
            await h.start_server()
            sids = [await h.open_session() for _ in range(16)]
            for sid in sids:
                await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=False)
            used = set()
            for sid in sids:
                (opened,) = await h.payloads(sid, ev.SessionOpened)
                (attempt,) = await h.payloads(sid, ev.GenerateAttempt)
                assert attempt.engine_url == opened.engine_url
                used.add(opened.engine_url)
            assert used == {first_url, second.url}
            assert h.engine.requests and second.requests
        finally:
            await h.close()
