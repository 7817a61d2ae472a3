"""Restart safety and shutdown: sessions and chains survive; SIGTERM exits cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anthropic
import pytest

from recorder.log import events as ev
from tests.server.conftest import FIXTURE_TOKENIZER, make_harness, tool_call_text
from tests.server.test_e2e import ask, echo, tool_result
from tools.test_engine import Fault
from tools.test_engine.scripted import ScriptedEngine


async def test_chains_survive_a_restart(tokenizer: Any, store_url: str) -> None:
    h = await make_harness(tokenizer, store_url)
    try:
        sid = await h.open_session(instance_id="r")
        closed = await h.open_session()
        await h.admin("POST", f"/sessions/{closed}/close", {})
        h.engine.push(
            tool_call_text("Bash", {"command": "ls"}),
            tool_call_text("Agent", {"prompt": "look at the tests"}),
        )
        messages: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
        first = await ask(h.client(sid), messages, stream=True)
        messages += [echo(first), tool_result(first.content[-1].id, "a.py b.py")]
        second = await ask(h.client(sid), messages, stream=False)

        await h.restart()  # nothing of the session is in memory now

        # The dispatch noted before the restart still classifies the subagent after it.
        h.engine.push("the tests look fine")
        await ask(
            h.client(sid),
            [{"role": "user", "content": "look at the tests"}],
            stream=False,
            system="You are a subagent.",
        )
        messages += [echo(second), tool_result(second.content[-1].id, "the tests look fine")]
        third = await ask(h.client(sid), messages, stream=True)
        assert third.stop_reason == "end_turn"
        decisions = await h.payloads(sid, ev.ChainDecision)
        assert [(d.action, d.reason, d.chain_id) for d in decisions] == [
            ("new", "first", 0),
            ("extend", "extends", 0),
            ("new", "subagent", 1),
            ("extend", "extends", 0),
        ]
        assert decisions[2].dispatch_tool_use_id == second.content[-1].id
        rendered = await h.payloads(sid, ev.RenderedInput)
        results = await h.payloads(sid, ev.GenerateResult)
        assert rendered[3].prefix_len == rendered[1].input_ids.length + results[1].output_ids.length
        assert [r.turn for r in await h.payloads(sid, ev.MessagesRequest)] == [0, 1, 2, 3]
        # Closed stays closed.
        with pytest.raises(anthropic.APIStatusError) as info:
            await ask(h.client(closed), [{"role": "user", "content": "x"}], stream=False)
        assert info.value.status_code == 409
        _status, state = await h.admin("GET", f"/sessions/{sid}")
        assert state["turns"] == 4 and state["metadata"] == {"instance_id": "r"}
    finally:
        await h.close()


async def test_shutdown_lets_in_flight_turns_finish(tokenizer: Any, sqlite_url: str) -> None:
    h = await make_harness(tokenizer, sqlite_url, engine_kwargs={"token_delay_s": 0.02})
    try:
        sid = await h.open_session()
        client = h.client(sid)
        turn = asyncio.create_task(ask(client, [{"role": "user", "content": "hi"}], stream=True))
        while not h.engine.core.running:
            await asyncio.sleep(0.01)
        await h.stop_server(grace_s=10)
        answer = await turn
        assert answer.stop_reason == "end_turn"
        assert (await h.types(sid))[-2:] == ["response_sent", "state_snapshot"]
    finally:
        await h.close()


async def test_shutdown_aborts_turns_after_the_grace_period(
    tokenizer: Any, sqlite_url: str
) -> None:
    h = await make_harness(tokenizer, sqlite_url)
    try:
        sid = await h.open_session()
        h.engine.inject(Fault(delay_s=30))
        turn = asyncio.create_task(
            ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=False)
        )
        while not h.engine.core.running:
            await asyncio.sleep(0.01)
        await h.stop_server(grace_s=0.2)
        with pytest.raises(anthropic.APIConnectionError):
            await turn
        (failed,) = await h.payloads(sid, ev.TurnFailed)
        assert "shutting down" in failed.reason
        (attempt,) = await h.payloads(sid, ev.GenerateAttempt)
        assert attempt.rid in h.engine.aborts
    finally:
        await h.close()


async def _start_serve(
    engine_url: str, db: Path | str, *extra: str
) -> tuple[asyncio.subprocess.Process, str]:
    """`recorder serve` in a child process (`extra`: more options), once healthy:
    (process, base URL)."""
    import aiohttp

    from recorder.server import free_port

    port = free_port()
    env = {**os.environ, "TR_ADMIN_TOKEN": "tok"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "recorder.cli", "serve",
        "--db", str(db), "--engine", engine_url, "--tokenizer", str(FIXTURE_TOKENIZER),
        "--chat-template", "chatml-tools", "--port", str(port), "--tool-parser", "qwen25",
        *extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(600):
            try:
                async with http.get(base + "/health") as resp:
                    if resp.status == 200:
                        return proc, base
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)
    proc.kill()
    raise RuntimeError("recorder serve did not become healthy")


async def _admin(base: str, method: str, path: str, body: Any = None) -> Any:
    import aiohttp

    async with (
        aiohttp.ClientSession() as http,
        http.request(method, base + path, json=body, headers={"Authorization": "Bearer tok"}) as r,
    ):
        return await r.json()


async def _until_recorded(db: Path, sid: str, kind: type, *, turn: int) -> None:
    """Until the server (another process) made an event of `kind` for `turn` durable."""
    from recorder.log.store import open_store

    store = await open_store(str(db))
    try:
        for _ in range(6000):
            events = await store.read_session(sid)
            if any(isinstance(r.event, kind) and r.event.turn == turn for r in events):
                return
            await asyncio.sleep(0.01)
    finally:
        await store.close()
    raise AssertionError(f"no {kind.__name__} of turn {turn} in the log")


async def test_serve_command_exits_cleanly_on_sigterm(tokenizer: Any, tmp_path: Path) -> None:
    from recorder.log.store import open_store

    db = tmp_path / "runs.db"
    async with ScriptedEngine(tokenizer, context_length=4096) as engine:
        proc, base = await _start_serve(engine.url, db)
        try:
            sid = (await _admin(base, "POST", "/sessions", {}))["session_id"]
            client = anthropic.AsyncAnthropic(base_url=base, api_key=sid, max_retries=0)
            answer = await client.messages.create(
                model="m", max_tokens=50, messages=[{"role": "user", "content": "hi"}]
            )
            await client.close()
            assert answer.stop_reason == "end_turn"
            proc.send_signal(signal.SIGTERM)
            output, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        log = output.decode()
        assert proc.returncode == 0, log
        assert "turn session=" in log and "stopped; the log is flushed" in log
        assert engine.url in log  # context length was read from the engine
    store = await open_store(str(db))
    try:
        types = [r.type for r in await store.read_session(sid)]
    finally:
        await store.close()
    assert types[-2:] == ["response_sent", "state_snapshot"]


async def test_kill_9_mid_turn_then_restart_and_go_on(tokenizer: Any, tmp_path: Path) -> None:
    """The server dies mid-generate; a new one picks the session up from the log."""
    from recorder.log.store import open_store

    db = tmp_path / "runs.db"
    async with ScriptedEngine(tokenizer, context_length=4096) as engine:
        proc, base = await _start_serve(engine.url, db)
        try:
            sid = (await _admin(base, "POST", "/sessions", {}))["session_id"]
            client = anthropic.AsyncAnthropic(base_url=base, api_key=sid, max_retries=0)
            engine.push(tool_call_text("Bash", {"command": "ls"}))
            messages: list[dict[str, Any]] = [{"role": "user", "content": "List files"}]
            first = await ask(client, messages, stream=False)
            messages += [echo(first), tool_result(first.content[-1].id, "a.txt")]
            engine.inject(Fault(delay_s=30))
            # Not streamed: an SSE stream opens after 1 s, and a kill after that ends it in
            # the SDK's stream reader (httpx's RemoteProtocolError), not APIConnectionError.
            in_flight = asyncio.ensure_future(ask(client, messages, stream=False))
            # Kill only once turn 1 is on record: the server hands the engine the request
            # first and stores it while the engine works, so the engine having it does not
            # mean the log has it (killed earlier, the retry would be turn 1, not 2).
            await _until_recorded(db, sid, ev.GenerateAttempt, turn=1)
            assert len(engine.requests) == 2  # the engine is working on turn 1
            proc.kill()  # SIGKILL: no shutdown code runs
            await proc.wait()
            with pytest.raises(anthropic.APIConnectionError):
                await in_flight
            await client.close()

            proc, base = await _start_serve(engine.url, db)
            client = anthropic.AsyncAnthropic(base_url=base, api_key=sid, max_retries=0)
            engine.push("Found a.txt.")
            again = await ask(client, messages, stream=False)  # the agent retries
            await client.close()
            assert again.content[0].text == "Found a.txt."
            closed = await _admin(base, "POST", f"/sessions/{sid}/close", {"reward": 1.0})
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    (sample,) = closed["samples"]
    assert sample["status"] == "completed" and sample["metadata"]["turns"] == [0, 2]
    store = await open_store(str(db))
    try:
        events = [r.event for r in await store.read_session(sid)]
    finally:
        await store.close()
    decisions = [(e.turn, e.action) for e in events if isinstance(e, ev.ChainDecision)]
    assert decisions == [(0, "new"), (1, "extend"), (2, "extend")]  # restored chains
    answered = [e.turn for e in events if isinstance(e, ev.ResponseSent)]
    assert answered == [0, 2]  # the killed turn never claims an answer


def test_startup_heap_is_frozen_out_of_full_collections() -> None:
    import gc

    from recorder.server.app import freeze_startup_heap

    before = gc.get_freeze_count()
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > max(before, 10_000)  # modules, tokenizer, ...
    finally:
        gc.unfreeze()


@pytest.mark.parametrize(
    ("flag", "rules_routing", "expected"),
    [(None, None, False), (None, (2, 2), True), (True, None, True), (False, (2, 2), False)],
)
def test_serve_records_routing_when_the_rules_replay_it(
    flag: bool | None, rules_routing: tuple[int, int] | None, expected: bool
) -> None:
    from recorder.server.commands import records_routing
    from replay.rules import Rules

    assert records_routing(flag, Rules(routed_experts=rules_routing)) is expected
