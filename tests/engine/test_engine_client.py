"""EngineClient and generate_with_resume against the scripted engine."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recorder.model import engine_wire
from recorder.model.engine import EngineClient
from recorder.model.engine_wire import (
    EngineError,
    GenerateOutput,
    MissingLogprobs,
    SamplingParams,
    new_rid,
    parse_generate_response,
)
from recorder.model.resume import Attempt, generate_with_resume
from tools.test_engine import Fault, Reply, ScriptedEngine, free_port, hashed_logprob

PROMPT_TEXT = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
async def engine(tokenizer):
    async with ScriptedEngine(tokenizer, context_length=4096) as eng:
        yield eng


@pytest.fixture
async def client():
    async with EngineClient(["http://unused"], timeout_s=30) as c:
        yield c


@pytest.fixture
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT_TEXT)


class Recorder:
    """Collects generate_with_resume's callbacks, as the server would record them."""

    def __init__(self) -> None:
        self.attempts: list[Attempt] = []
        self.results: list[tuple[Attempt, GenerateOutput]] = []

    async def on_attempt(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)

    async def on_result(self, attempt: Attempt, out: GenerateOutput) -> None:
        self.results.append((attempt, out))


async def _resume(client, url, prompt, params, rec: Recorder, **kw):
    return await generate_with_resume(
        client, url, prompt, params, on_attempt=rec.on_attempt, on_result=rec.on_result, **kw
    )


async def test_generate_returns_ids_logprobs_and_meta(engine, client, tokenizer, prompt) -> None:
    engine.push("Hi there!")
    out = await client.generate(engine.url, prompt, SamplingParams(max_new_tokens=50), new_rid())
    expected = [*tokenizer.encode("Hi there!"), 2]
    assert out.output_ids == expected
    assert out.logprobs == [hashed_logprob(len(prompt) + i, t) for i, t in enumerate(expected)]
    assert (out.finish_reason, out.finish_detail) == ("stop", "2")
    assert out.weight_version == "0"
    assert out.prompt_tokens == len(prompt) and out.cached_tokens == 0
    assert out.routed_experts is None and out.latency_s > 0
    sent = engine.requests[0]
    assert sent.return_logprob and sent.max_new_tokens == 50 and sent.input_ids == prompt
    # The next turn extends the chain: the engine reports the cached prefix.
    nxt = prompt + out.output_ids + tokenizer.encode("\n<|im_start|>user\nmore")
    again = await client.generate(engine.url, nxt, SamplingParams(max_new_tokens=50), new_rid())
    assert again.cached_tokens == len(prompt) + len(out.output_ids)


async def test_length_stop_strings_and_stop_ids(engine, client, tokenizer, prompt) -> None:
    engine.push("one two three four five", "alpha beta gamma", "x y z")
    out = await client.generate(engine.url, prompt, SamplingParams(max_new_tokens=3), new_rid())
    assert (out.finish_reason, out.finish_detail, len(out.output_ids)) == ("length", "3", 3)
    out = await client.generate(
        engine.url, prompt, SamplingParams(max_new_tokens=20, stop=(" beta",)), new_rid()
    )
    assert (out.finish_reason, out.finish_detail) == ("stop", " beta")
    assert tokenizer.decode(out.output_ids) == "alpha beta"  # no_stop_trim: kept
    y = tokenizer.encode("x y z")[1]
    out = await client.generate(
        engine.url, prompt, SamplingParams(max_new_tokens=20, stop_token_ids=(y,)), new_rid()
    )
    assert (out.finish_reason, out.finish_detail) == ("stop", str(y))
    assert out.output_ids[-1] == y


async def test_sampling_params_are_sglang_keys() -> None:
    params = SamplingParams(max_new_tokens=5, stop=("a",), stop_token_ids=(2,))
    sg = params.to_sglang()
    assert sg["skip_special_tokens"] is False and sg["no_stop_trim"] is True
    assert sg["spaces_between_special_tokens"] is False
    assert sg["stop"] == ["a"] and sg["stop_token_ids"] == [2]
    assert "stop" not in SamplingParams(max_new_tokens=5).to_sglang()
    assert params.with_max_new_tokens(2).max_new_tokens == 2


async def test_context_overflow_is_http_400(engine, client, prompt) -> None:
    with pytest.raises(EngineError) as err:
        await client.generate(engine.url, prompt, SamplingParams(max_new_tokens=4096), new_rid())
    assert err.value.kind == "http" and err.value.status == 400
    assert "maximum context length" in err.value.message
    with pytest.raises(EngineError, match="longer than the model's context length"):
        await client.generate(engine.url, [5] * 4096, SamplingParams(max_new_tokens=1), new_rid())


async def test_abort_midway_then_resume_stitches(tokenizer, client, prompt) -> None:
    text = "The quick brown fox jumps over the lazy dog and keeps running."
    async with ScriptedEngine(tokenizer, token_delay_s=0.001) as engine:
        # Reference: the same reply uninterrupted.
        engine.push(text)
        ref = await client.generate(
            engine.url, prompt, SamplingParams(max_new_tokens=64), new_rid()
        )
        engine.push(text)
        engine.inject(Fault(abort_after=4, message="weight update"))
        rec = Recorder()
        turn = await _resume(client, engine.url, prompt, SamplingParams(max_new_tokens=64), rec)
    assert turn.output_ids == ref.output_ids
    assert turn.logprobs == ref.logprobs
    assert turn.finish_reason == "stop"
    assert [a.resumed_tokens for a in turn.attempts] == [0, 4]
    assert [a.max_new_tokens for a in turn.attempts] == [64, 60]
    assert [r.finish_reason for _, r in rec.results] == ["abort", "stop"]
    assert rec.results[0][1].finish_detail == "weight update"
    assert rec.attempts == turn.attempts and turn.attempts[0].rid != turn.attempts[1].rid
    # The second attempt re-submitted prompt + partial output.
    assert engine.requests[-1].input_ids == prompt + ref.output_ids[:4]
    assert engine.requests[-1].max_new_tokens == 60
    assert turn.prompt_tokens == len(prompt)


async def test_pause_continue_records_weight_version_per_token(tokenizer, client, prompt) -> None:
    async with ScriptedEngine(tokenizer, token_delay_s=0.001, weight_version="7") as engine:
        engine.push("one two three four five six seven eight")
        engine.inject(Fault(pause_after=3, pause_s=0.05))
        rec = Recorder()
        turn = await _resume(client, engine.url, prompt, SamplingParams(max_new_tokens=64), rec)
        assert not engine.core.paused
    n = len(turn.output_ids)
    assert turn.weight_versions == ["7"] * 3 + ["8"] * (n - 3)
    assert turn.finish_reason == "stop" and len(turn.attempts) == 2
    assert rec.results[0][1].finish_detail == "pause_generation (abort)"


async def test_new_requests_block_while_paused(engine, client, prompt) -> None:
    engine.pause("abort")
    task = asyncio.create_task(
        client.generate(engine.url, prompt, SamplingParams(max_new_tokens=8), new_rid())
    )
    while not engine.core.running:
        await asyncio.sleep(0.005)
    assert not task.done()
    engine.resume(new_weight_version="v2")
    out = await task
    assert out.weight_version == "v2" and out.finish_reason in ("stop", "length")


async def test_external_abort_returns_partial_output(tokenizer, client, prompt) -> None:
    async with ScriptedEngine(tokenizer, token_delay_s=0.05) as engine:
        engine.push("a b c d e f g h i j k l m n o p")
        rid = new_rid()
        task = asyncio.create_task(
            client.generate(engine.url, prompt, SamplingParams(max_new_tokens=64), rid)
        )
        while not engine.core.running:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.12)
        await client.abort(engine.url, rid)
        out = await task
    assert out.finish_reason == "abort"
    assert 0 < len(out.output_ids) < 17 and out.logprobs is not None
    assert engine.aborts == [rid]


async def test_missing_logprobs_fails_the_turn(engine, client, prompt) -> None:
    for mode in ("missing", "short"):
        engine.push("Hello world")
        engine.inject(Fault(logprobs=mode))
        rec = Recorder()
        with pytest.raises(MissingLogprobs, match="never re-tokenized"):
            await _resume(client, engine.url, prompt, SamplingParams(max_new_tokens=32), rec)
        # The offending output was reported before the error (the server records it).
        assert rec.results[-1][1].logprobs is None and rec.results[-1][1].output_ids


async def test_http_5xx_is_engine_error(engine, client, prompt) -> None:
    engine.inject(Fault(status=503, message="overloaded"))
    rec = Recorder()
    with pytest.raises(EngineError) as err:
        await _resume(client, engine.url, prompt, SamplingParams(max_new_tokens=8), rec)
    assert (err.value.kind, err.value.status, err.value.message) == ("http", 503, "overloaded")
    assert len(rec.attempts) == 1 and not rec.results


async def test_engine_down_is_unreachable(client, prompt) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError) as err:
        await client.generate(url, prompt, SamplingParams(max_new_tokens=8), new_rid())
    assert err.value.kind == "unreachable"
    assert not await client.health(url)
    assert await client.context_length(url) is None


async def test_dropped_connection_is_unreachable_and_aborts(engine, client, prompt) -> None:
    engine.inject(Fault(disconnect=True))
    with pytest.raises(EngineError) as err:
        await _resume(client, engine.url, prompt, SamplingParams(max_new_tokens=8), Recorder())
    assert err.value.kind == "unreachable" and err.value.may_be_running
    # The request got there and may still run: its rid is aborted (seed 004).
    assert engine.aborts == [engine.requests[0].rid]


async def test_refused_connection_sends_no_abort(client, prompt) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError) as err:
        await _resume(client, url, prompt, SamplingParams(max_new_tokens=8), Recorder())
    assert err.value.kind == "unreachable" and not err.value.may_be_running


async def test_client_timeout_is_timeout_and_aborts(engine, prompt) -> None:
    engine.inject(Fault(delay_s=30))
    async with EngineClient([engine.url], timeout_s=0.3) as slow:
        with pytest.raises(EngineError) as err:
            await _resume(slow, engine.url, prompt, SamplingParams(max_new_tokens=8), Recorder())
    assert err.value.kind == "timeout"
    assert engine.aborts == [engine.requests[0].rid]


async def test_turn_budget_timeout_aborts_rid(engine, client, prompt) -> None:
    engine.inject(Fault(delay_s=30))
    rec = Recorder()
    with pytest.raises(EngineError) as err:
        await _resume(
            client, engine.url, prompt, SamplingParams(max_new_tokens=8), rec, budget_s=0.2
        )
    assert err.value.kind == "timeout"
    assert engine.aborts == [rec.attempts[0].rid]


async def test_cancellation_sends_abort_request(tokenizer, client, prompt) -> None:
    async with ScriptedEngine(tokenizer, token_delay_s=0.05) as engine:
        engine.push("a b c d e f g h i j k l m n o p")
        rec = Recorder()
        task = asyncio.create_task(
            _resume(client, engine.url, prompt, SamplingParams(max_new_tokens=64), rec)
        )
        while not engine.core.running:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.aborts == [rec.attempts[0].rid]
        while engine.core.running:  # the engine stops generating for it
            await asyncio.sleep(0.005)


async def test_attempt_budget_exhausted_returns_abort(tokenizer, client, prompt) -> None:
    async with ScriptedEngine(tokenizer) as engine:
        engine.push("a b c d e f g h i j k l m n o p")
        engine.inject(Fault(abort_after=1, times=10))
        rec = Recorder()
        turn = await _resume(
            client, engine.url, prompt, SamplingParams(max_new_tokens=64), rec, max_attempts=3
        )
    assert turn.finish_reason == "abort" and "3 attempts" in turn.finish_detail
    assert len(turn.attempts) == 3 and len(turn.output_ids) == 3 == len(turn.logprobs)


async def test_abort_at_token_limit_finishes_as_length(engine, client, prompt) -> None:
    engine.push("a b c d e f g h i j k l m n o p")
    engine.inject(Fault(abort_after=4))
    turn = await _resume(client, engine.url, prompt, SamplingParams(max_new_tokens=4), Recorder())
    assert (turn.finish_reason, len(turn.output_ids), len(turn.attempts)) == ("length", 4, 1)


async def test_routed_experts_and_info(engine, client, prompt) -> None:
    ids = np.asarray(prompt, dtype=np.int64)  # numpy input is sent as plain ints
    out = await client.generate(
        engine.url, ids, SamplingParams(max_new_tokens=4), new_rid(), return_routed_experts=True
    )
    experts = np.frombuffer(out.routed_experts or b"", dtype=np.int32)
    assert experts.size == (len(prompt) + len(out.output_ids)) * 2 * 2
    info = await client.model_info(engine.url)
    assert info["weight_version"] == "0" and info["tool_call_parser"] == "qwen25"
    assert await client.context_length(engine.url) == 4096
    assert await client.health(engine.url)
    engine.core.healthy = False
    assert not await client.health(engine.url)


def test_pick_is_stable_and_spreads() -> None:
    urls = [f"http://e{i}" for i in range(4)]
    client = EngineClient(urls)
    picks = [client.pick(f"session-{i}") for i in range(400)]
    assert picks == [client.pick(f"session-{i}") for i in range(400)]
    counts = {u: picks.count(u) for u in urls}
    assert min(counts.values()) > 50, counts
    # Adding an engine moves only sessions that now pick the new one.
    grown = EngineClient([*urls, "http://e4"])
    moved = [i for i in range(400) if grown.pick(f"session-{i}") != picks[i]]
    assert all(grown.pick(f"session-{i}") == "http://e4" for i in moved)


def test_rids_are_fixed_length_hex() -> None:
    rids = {new_rid() for _ in range(1000)}
    assert len(rids) == 1000 and {len(r) for r in rids} == {32}
    assert all(int(r, 16) >= 0 for r in rids)


def test_parse_response_variants() -> None:
    def body(finish, logprobs=None, **meta):
        return {
            "output_ids": [5, 6],
            "meta_info": {"finish_reason": finish, "output_token_logprobs": logprobs, **meta},
        }

    triples = [[-0.5, 5, "a"], [-1.5, 6, None]]
    out = parse_generate_response(
        body({"type": "abort", "message": "m"}, triples, weight_version=3), rid="r", latency_s=0
    )
    assert (out.finish_reason, out.finish_detail, out.logprobs) == ("abort", "m", [-0.5, -1.5])
    assert out.weight_version == "3"
    assert parse_generate_response(body(None), rid="r", latency_s=0).finish_reason == "unknown"
    assert (
        parse_generate_response(
            body({"type": "length", "length": 2}), rid="r", latency_s=0
        ).logprobs
        is None
    )
    assert (
        parse_generate_response([body("stop", triples)], rid="r", latency_s=0).finish_reason
        == "stop"
    )
    none_lp = [[None, 5, None], [-1.0, 6, None]]
    assert parse_generate_response(body("stop", none_lp), rid="r", latency_s=0).logprobs is None
    with pytest.raises(EngineError, match=r"is for token 7") as err:
        parse_generate_response(
            body("stop", [[-0.5, 7, None], [-1, 6, None]]), rid="r", latency_s=0
        )
    assert err.value.kind == "protocol"
    with pytest.raises(EngineError, match="output_ids/meta_info"):
        parse_generate_response({"text": "hi"}, rid="r", latency_s=0)
    raw = np.arange(8, dtype=np.int32).tobytes()
    out = parse_generate_response(
        body("stop", triples, routed_experts=base64.b64encode(raw).decode()), rid="r", latency_s=0
    )
    assert out.routed_experts == raw
    # An abort while queued: no output, no logprobs needed.
    empty = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}}
    assert parse_generate_response(empty, rid="r", latency_s=0).logprobs == []


async def test_on_sent_fires_once_the_engine_has_the_request(engine, client, prompt) -> None:
    engine.push(Reply(text="a slow answer of several tokens", token_delay_s=0.02))
    sent_at: list[int] = []

    def on_sent() -> None:
        sent_at.append(len(engine.requests))

    task = asyncio.ensure_future(
        client.generate(
            engine.url, prompt, SamplingParams(max_new_tokens=50), new_rid(), on_sent=on_sent
        )
    )
    for _ in range(200):
        if sent_at:
            break
        await asyncio.sleep(0.005)
    assert sent_at and not task.done()  # signalled while the engine still works
    out = await task
    assert out.output_ids and len(sent_at) == 1


async def test_a_gone_engine_moves_the_turn_and_the_resume_goes_on(tokenizer, prompt) -> None:
    """Aborted on A with partial output, A dies, the turn resumes on B from that output.

    The failed attempt is reported (`on_moved`) and has no result; the stitched
    output is A's partial output + B's continuation, as a resume on A would be.
    """
    async with (
        ScriptedEngine(tokenizer, context_length=4096) as a,
        ScriptedEngine(tokenizer, context_length=4096) as b,
        EngineClient([a.url, b.url], timeout_s=30, health_interval_s=0) as client,
    ):
        a.push("one two three four five six")
        a.inject(Fault(abort_after=2))
        moved: list[tuple[Attempt, EngineError, str]] = []
        rec = Recorder()

        async def on_result(attempt: Attempt, out: GenerateOutput) -> None:
            await rec.on_result(attempt, out)
            await a.stop()  # gone before the resume reaches it

        async def on_moved(attempt: Attempt, exc: EngineError, url: str) -> None:
            moved.append((attempt, exc, url))

        turn = await generate_with_resume(
            client,
            a.url,
            prompt,
            SamplingParams(max_new_tokens=64),
            on_attempt=rec.on_attempt,
            on_result=on_result,
            session_id="s",
            on_moved=on_moved,
        )
    partial = rec.results[0][1].output_ids
    assert len(partial) == 2 and turn.finish_reason == "stop"
    assert [(x.attempt, x.url, x.resumed_tokens) for x in turn.attempts] == [
        (0, a.url, 0),
        (1, a.url, 2),
        (2, b.url, 2),
    ]
    ((failed, exc, to),) = moved
    assert (failed.attempt, exc.kind, to) == (1, "unreachable", b.url)
    assert [x.attempt for x, _ in rec.results] == [0, 2]
    assert turn.output_ids == partial + rec.results[1][1].output_ids
    assert b.requests[-1].input_ids == prompt + partial
    assert client.down == {a.url}


async def test_without_a_session_a_gone_engine_fails_the_turn(tokenizer, prompt) -> None:
    async with (
        ScriptedEngine(tokenizer, context_length=4096) as b,
        EngineClient([f"http://127.0.0.1:{free_port()}", b.url], health_interval_s=0) as client,
    ):
        with pytest.raises(EngineError) as failed:
            await _resume(
                client, client.urls[0], prompt, SamplingParams(max_new_tokens=8), Recorder()
            )
    assert failed.value.kind == "unreachable" and b.requests == []


_ENTRY = st.one_of(
    st.lists(
        st.one_of(st.floats(allow_nan=False), st.integers(-3, 9), st.none(), st.text(max_size=2)),
        max_size=3,
    ),
    st.integers(0, 9),
    st.none(),
    st.text(max_size=3),
    st.dictionaries(st.text(max_size=1), st.integers(), max_size=1),
)


@settings(max_examples=400, deadline=None)
@given(
    ids=st.lists(st.integers(0, 9), max_size=6),
    entries=st.lists(_ENTRY, max_size=7),
    well_formed=st.booleans(),
)
def test_logprobs_fast_path_decides_as_the_entry_by_entry_check(
    ids: list[int], entries: list[object], well_formed: bool
) -> None:
    """Whatever the engine sends, reading the logprob triples whole gives the same
    logprobs, None, or protocol error as checking them one by one."""
    if well_formed:  # mostly valid answers, so the fast path is taken too
        entries = [[-0.25 * i, t, None] for i, t in enumerate(ids)] + entries[:1]

    def outcome(read: object) -> object:
        try:
            return ("ok", read(entries, ids, "u"))  # type: ignore[operator]
        except EngineError as exc:
            return ("error", exc.kind, str(exc))
        except (TypeError, ValueError) as exc:
            return ("raised", type(exc))

    def one_by_one(raw: list[object], want: list[int], url: str) -> list[float] | None:
        if not want:
            return []
        return None if len(raw) < len(want) else engine_wire._checked_logprobs(raw, want, url)

    assert outcome(engine_wire._logprobs) == outcome(one_by_one)


_META_VALUE = st.one_of(
    st.none(), st.integers(-2, 5), st.floats(allow_nan=False), st.text(max_size=3), st.booleans()
)


@settings(max_examples=400, deadline=None)
@given(
    ids=st.lists(st.one_of(st.integers(0, 9), st.booleans()), max_size=5),
    entries=st.lists(_ENTRY, max_size=6),
    meta=st.dictionaries(
        st.sampled_from(
            ["finish_reason", "weight_version", "prompt_tokens", "cached_tokens", "extra"]
        ),
        _META_VALUE,
    ),
    well_formed=st.booleans(),
    error=st.sampled_from([None, "absent", "boom"]),
    wrong=st.integers(-1, 4),
)
def test_typed_answer_decoding_agrees_with_the_untyped_reading(
    ids: list[int],
    entries: list[object],
    meta: dict[str, object],
    well_formed: bool,
    error: object,
    wrong: int,
) -> None:
    """`decode_generate_answer` gives what `parse_generate_response` gives for the same
    bytes, or None (the caller then takes the untyped reading): never another output."""
    if well_formed:  # the triples SGLang sends, and maybe one more (ignored)
        entries = [[-0.25 * i, t, None] for i, t in enumerate(ids)] + [[-1.0, 0, None]][
            : len(entries) % 2
        ]
        if 0 <= wrong < len(ids):  # a triple for another token
            entries[wrong] = [-0.5, int(ids[wrong]) + 1, None]
    body: dict[str, object] = {
        "output_ids": ids,
        "meta_info": {**meta, "output_token_logprobs": entries},
    }
    if error != "absent":
        body["error"] = error
    raw = json.dumps(body).encode()
    typed = engine_wire.decode_generate_answer(raw, rid="r", latency_s=0.5, url="u")
    try:
        untyped: object = parse_generate_response(json.loads(raw), rid="r", latency_s=0.5, url="u")
    except (EngineError, TypeError, ValueError) as exc:
        untyped = exc
    if typed is not None:
        assert isinstance(untyped, GenerateOutput) and typed == untyped
    usual = well_formed and error == "absent" and not meta and not 0 <= wrong < len(ids)
    if usual and all(type(i) is int for i in ids):
        assert typed is not None  # the usual answer takes the typed path
