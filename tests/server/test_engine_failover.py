"""Several engines: a session whose engine dies moves to a live one (issue 15).

Between health checks, the turn that finds its engine gone moves itself: it is
retried on a live engine within the same request (each engine at most once),
the failed attempt stays in the log without a result, and the samples hold
only the answered attempts' tokens, live and replayed alike.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import msgspec
import openai
import pytest

from recorder.log import events as ev
from recorder.server import free_port
from replay.export import export_samples, read_samples
from replay.rules import Rules
from replay.samples import Sample
from replay.tito import turn_tokens
from tests.server.conftest import Harness, make_harness
from tests.server.test_e2e import ask, echo
from tests.server.test_openai import engine_outputs, samples_of, trained
from tools.test_engine import Fault
from tools.test_engine.launch import start_subprocess
from tools.test_engine.scripted import ScriptedEngine, default_reply_text


async def _session_on(h: Harness, url: str) -> str:
    """Open sessions until one is pinned to `url` (pinning hashes the session id)."""
    for _ in range(64):
        sid = await h.open_session()
        status, data = await h.admin("GET", f"/sessions/{sid}")
        assert status == 200, data
        if data["engine_url"] == url:
            return sid
    raise AssertionError(f"no session pinned to {url}")


async def _health(h: Harness) -> Any:
    assert h.http is not None
    async with h.http.get(h.url + "/health") as resp:
        return await resp.json()


async def test_a_dead_engines_session_moves_to_a_live_one(harness: Harness, tokenizer: Any) -> None:
    h = harness
    dying = ScriptedEngine(tokenizer, context_length=8192)
    dying_url = await dying.start()
    live_url = h.engine.url
    h.engine_urls = [live_url, dying_url]
    await h.restart(reopen_store=False)
    sid = await _session_on(h, dying_url)
    client = h.client(sid)
    dying.push("First answer.")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    first = await ask(client, messages, stream=False)
    assert first.content[0].text == "First answer."
    assert (await _health(h))["engines_down"] == []

    await dying.stop()
    await h.ctx.engine.check_engines()  # what the periodic check does
    assert (await _health(h))["engines_down"] == [dying_url]
    h.engine.push("Second answer, elsewhere.")
    messages += [echo(first), {"role": "user", "content": "go on"}]
    second = await ask(client, messages, stream=True)
    assert second.content[0].text == "Second answer, elsewhere."

    attempts = await h.payloads(sid, ev.GenerateAttempt)
    assert [a.engine_url for a in attempts] == [dying_url, live_url]
    status, closed = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    assert status == 200, closed
    assert [s["metadata"]["turns"] for s in closed["samples"]] == [[0, 1]]


async def test_a_refused_connection_moves_the_turn_itself(harness: Harness, tokenizer: Any) -> None:
    """Between checks, the turn that finds its engine gone is answered by a live one."""
    h = harness
    dying = ScriptedEngine(tokenizer, context_length=8192)
    dying_url = await dying.start()
    h.engine_urls = [h.engine.url, dying_url]
    await h.restart(reopen_store=False)
    sid = await _session_on(h, dying_url)
    h.ctx.engine.health_interval_s = 0  # no further checks: only the refused connection tells
    await dying.stop()
    h.engine.push("Answered by the live engine.")
    answer = await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=False)
    assert answer.content[0].text == "Answered by the live engine."
    assert dying_url in (await _health(h))["engines_down"]
    attempts = await h.payloads(sid, ev.GenerateAttempt)
    assert [a.engine_url for a in attempts] == [dying_url, h.engine.url]


async def test_an_engine_failing_its_health_check_mid_turn_loses_the_turn(
    tokenizer: Any, sqlite_url: str
) -> None:
    """The engine holds the request and stops passing /health (a dead node may never
    reset the connection): the check moves the turn, the stuck rid is aborted."""
    stuck = ScriptedEngine(tokenizer, context_length=8192)
    stuck_url = await stuck.start()
    h = await make_harness(tokenizer, sqlite_url, engine_health_interval_s=0)
    try:
        h.engine_urls = [h.engine.url, stuck_url]
        await h.restart(reopen_store=False)
        sid = await _session_on(h, stuck_url)
        stuck.inject(Fault(delay_s=60))
        h.engine.push("Answered by the live engine.")
        turn = asyncio.ensure_future(
            ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=True)
        )
        while not stuck.core.running:
            await asyncio.sleep(0.01)
        stuck.core.healthy = False
        await h.ctx.engine.check_engines()  # what the periodic check does
        answer = await asyncio.wait_for(turn, 60)
        assert answer.content[0].text == "Answered by the live engine."
        attempts = await h.payloads(sid, ev.GenerateAttempt)
        assert [a.engine_url for a in attempts] == [stuck_url, h.engine.url]
        (error,) = await h.payloads(sid, ev.EngineError)
        assert error.attempt == 0 and "health check" in error.message
        while attempts[0].rid not in stuck.aborts:  # sent without holding the turn up
            await asyncio.sleep(0.01)
    finally:
        await h.close()
        await stuck.stop()


async def test_a_hung_engine_process_loses_the_turn_to_a_live_one(
    tokenizer: Any, sqlite_url: str, live_engine: str, dying_engine: tuple[Any, str]
) -> None:
    """SIGSTOP: the connection stays open and nothing answers, /health times out."""
    proc, hung = dying_engine
    h = await make_harness(
        tokenizer, sqlite_url, engine_urls=[hung, live_engine], engine_health_interval_s=0
    )
    try:
        h.ctx.engine.health_timeout_s = 1.0
        sid = await _session_on(h, hung)
        history: list[Any] = [{"role": "user", "content": f"hi {HANG}"}]
        turn = asyncio.ensure_future(_say(h, sid, "anthropic", True, history))
        await _wait_for_attempt(h, sid, 0)
        proc.send_signal(signal.SIGSTOP)
        try:
            await h.ctx.engine.check_engines()
            answer = await asyncio.wait_for(turn, 60)
        finally:
            proc.send_signal(signal.SIGCONT)
        rendered = (await h.payloads(sid, ev.RenderedInput))[0]
        prompt: list[int] = await h.array(rendered.input_ids)  # type: ignore[assignment]
        assert answer == default_reply_text(prompt, 12)
        attempts = await h.payloads(sid, ev.GenerateAttempt)
        assert [a.engine_url for a in attempts] == [hung, live_engine]
        assert h.ctx.engine.down == {hung}
    finally:
        await h.close()


async def test_each_engine_is_tried_once_then_the_turn_fails(
    tokenizer: Any, sqlite_url: str
) -> None:
    """Every engine gone: one attempt each, then the 529 the client retries later."""
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    # No checks: as if each engine died after the last one. The stream's first byte
    # waits longer than three refused connections take under any load: a 529 is
    # only possible before the stream opens (after it, the error goes in the stream).
    h = await make_harness(
        tokenizer,
        sqlite_url,
        engine_urls=dead,
        engine_health_interval_s=0,
        first_byte_after_s=30.0,
    )
    try:
        sid = await h.open_session()
        with pytest.raises(anthropic.APIStatusError) as failed:
            await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=True)
        assert failed.value.status_code == 529
        attempts = await h.payloads(sid, ev.GenerateAttempt)
        assert sorted(a.engine_url for a in attempts) == sorted(dead)
        errors = await h.payloads(sid, ev.EngineError)
        assert [e.attempt for e in errors] == [0, 1, 2]
        assert (await h.payloads(sid, ev.TurnFailed)) == []  # the engine errors say why
    finally:
        await h.close()


async def test_an_engine_that_answers_is_not_left(harness: Harness, tokenizer: Any) -> None:
    """An HTTP error or a dropped connection from an engine whose /health passes: 529,
    no move (another engine would not fix the request, and this one is alive)."""
    h = harness
    other = ScriptedEngine(tokenizer, context_length=8192)
    other_url = await other.start()
    try:
        h.engine_urls = [h.engine.url, other_url]
        await h.restart(reopen_store=False)
        sid = await _session_on(h, h.engine.url)
        client = h.client(sid)
        for fault in (Fault(status=500), Fault(disconnect=True)):
            h.engine.inject(fault)
            with pytest.raises(anthropic.APIStatusError) as failed:
                await ask(client, [{"role": "user", "content": "hi"}], stream=False)
            assert failed.value.status_code == 529, fault
        attempts = await h.payloads(sid, ev.GenerateAttempt)
        assert {a.engine_url for a in attempts} == {h.engine.url}
        assert other.requests == [] and h.ctx.engine.down == set()
    finally:
        await other.stop()


# --------------------------------------------------------------------------
# The turn during which the engine dies: moved within the turn (real processes)
# --------------------------------------------------------------------------

HANG = "HANG-AT-THE-ENGINE"
"""A prompt holding this waits at the dying engine (its script says so) until it is killed."""


@pytest.fixture(scope="module")
def live_engine() -> Iterator[str]:
    """A test engine process that stays up (shared: its replies depend only on the prompt)."""
    proc, url = start_subprocess(["--backend", "scripted"])
    try:
        yield url
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def dying_engine(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    script = tmp_path / "hang.json"
    script.write_text(json.dumps({"faults": [{"match": HANG, "delay_s": 120}]}))
    proc, url = start_subprocess(["--backend", "scripted", "--script", str(script)])
    try:
        yield proc, url
    finally:
        proc.kill()
        proc.wait()


async def _say(h: Harness, sid: str, dialect: str, stream: bool, history: list[Any]) -> str:
    """One turn in `dialect` through its official SDK; the answer's text (added to history)."""
    if dialect == "anthropic":
        answer = await ask(h.client(sid), history, stream=stream, tools=[])
        history.append(echo(answer))
        return str(answer.content[0].text)
    client = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key=sid, max_retries=0)
    try:
        kw: dict[str, Any] = {"model": "m", "messages": history, "max_tokens": 256}
        if stream:
            text = "".join(
                [
                    chunk.choices[0].delta.content or ""
                    async for chunk in await client.chat.completions.create(stream=True, **kw)
                    if chunk.choices
                ]
            )
        else:
            done = await client.chat.completions.create(**kw)
            text = done.choices[0].message.content or ""
    finally:
        await client.close()
    history.append({"role": "assistant", "content": text})
    return text


async def _wait_for_attempt(h: Harness, sid: str, turn: int) -> None:
    """Until the turn's GenerateAttempt is durable: its request is at the engine by then."""
    for _ in range(3000):
        if any(a.turn == turn for a in await h.payloads(sid, ev.GenerateAttempt)):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"turn {turn} never reached its engine")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


async def _exported(h: Harness, out: Path) -> dict[str, list[Sample]]:
    await export_samples(h.store, out, "jsonl", Rules())
    by_session: dict[str, list[Sample]] = {}
    for sample in read_samples(out, "jsonl"):
        by_session.setdefault(sample.session_id, []).append(sample)
    return by_session


@pytest.mark.parametrize("when", ["before", "during"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("dialect", ["anthropic", "openai"])
async def test_the_turn_whose_engine_dies_is_answered_by_a_live_one(
    tokenizer: Any,
    sqlite_url: str,
    live_engine: str,
    dying_engine: tuple[subprocess.Popen[bytes], str],
    tmp_path: Path,
    dialect: str,
    stream: bool,
    when: str,
) -> None:
    """SIGKILL just before a turn (a refused or dropped connection) or while the engine
    works on it (a reset): 200 from the live engine in the same request, the session
    re-pinned there, the samples exactly the answered tokens, live and exported."""
    proc, dying = dying_engine
    # No checks: only the turn can find its engine gone.
    h = await make_harness(
        tokenizer, sqlite_url, engine_urls=[dying, live_engine], engine_health_interval_s=0
    )
    try:
        sid = await _session_on(h, dying)
        history: list[Any] = [{"role": "user", "content": "hi"}]
        await _say(h, sid, dialect, stream, history)  # turn 0, on the engine that will die
        if when == "before":
            _kill(proc)
            history.append({"role": "user", "content": "go on"})
            answer = await _say(h, sid, dialect, stream, history)
        else:
            history.append({"role": "user", "content": f"go on {HANG}"})
            turn = asyncio.ensure_future(_say(h, sid, dialect, stream, history))
            await _wait_for_attempt(h, sid, 1)
            _kill(proc)
            answer = await asyncio.wait_for(turn, 60)

        attempts = await h.payloads(sid, ev.GenerateAttempt)
        assert [(a.turn, a.attempt, a.engine_url) for a in attempts] == [
            (0, 0, dying),
            (1, 0, dying),
            (1, 1, live_engine),
        ]
        (error,) = await h.payloads(sid, ev.EngineError)
        assert (error.turn, error.attempt, error.kind) == (1, 0, "unreachable")
        results = await h.payloads(sid, ev.GenerateResult)
        assert [(r.turn, r.attempt) for r in results] == [(0, 0), (1, 1)]
        rendered = (await h.payloads(sid, ev.RenderedInput))[1]
        # The live engine's own answer to exactly the turn's input (its default rule).
        prompt: list[int] = await h.array(rendered.input_ids)  # type: ignore[assignment]
        assert answer == default_reply_text(prompt, 12)
        emitted = (await turn_tokens(h.store, sid, 1)).emitted  # what `replay tito` reads
        assert emitted == await h.array(results[1].output_ids)
        status, state = await h.admin("GET", f"/sessions/{sid}")
        assert status == 200 and state["engine_url"] == live_engine  # re-pinned
        assert h.ctx.engine.down == {dying}

        samples = await samples_of(h, sid)
        exported = await _exported(h, tmp_path / "samples.jsonl")
        assert [msgspec.convert(s, Sample) for s in samples] == exported[sid]
        # Trained: exactly the answered attempts' tokens (the failed one has none).
        assert trained(samples) == await engine_outputs(h, sid)
    finally:
        await h.close()
