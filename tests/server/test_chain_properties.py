"""Property: generated agent sessions land in the right segments, the same live and replayed.

Hypothesis writes a session plan mixing main-line tool turns, client retries,
parallel / identical / background subagents, side requests and compactions;
the SDK plays it against `recorder serve` with a scripted engine. Then:
- the samples the server returned at close are the samples replayed from
  the log, byte for byte, and no live chain decision disagrees with replay;
- every dispatch has exactly one subagent segment (labelled with its id),
  every side request a `side` segment, the last main-line chain is `final`;
- every engine output token is trained or untrained for a stated reason,
  and only the reasons the plan allows (side requests, retried answers).
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recorder.model.tokenizer import Tokenizer
from tests.server.conftest import Harness, make_harness, tool_call_text
from tests.server.test_chain_identity import (
    COMPACT,
    SUB_SYSTEM,
    TITLE_SYSTEM,
    assert_live_equals_offline,
    engine_output_tokens,
    replayed,
)
from tests.server.test_e2e import ask, echo, tool_result


@dataclass(frozen=True)
class Dispatch:
    count: int  # Agent calls in one answer
    identical: bool  # the same prompt for each
    background: bool  # tool_results come back before the subagents run
    sub_turns: int


step = st.one_of(
    st.sampled_from(["tool", "retry", "side", "compact"]),
    st.builds(
        Dispatch,
        count=st.integers(1, 2),
        identical=st.booleans(),
        background=st.booleans(),
        sub_turns=st.integers(1, 2),
    ),
)
plans = st.lists(step, max_size=5)


class Player:
    """Plays one session plan through the SDK; the engine's reply is queued per request."""

    def __init__(self, h: Harness, sid: str) -> None:
        self.h = h
        self.client = h.client(sid)
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the bug."}]
        self.dispatched: list[str] = []
        self.sides = 0
        self.retries = 0
        self.n = 0

    async def request(self, reply: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
        self.h.engine.push(reply)
        return await ask(self.client, messages, stream=False, **kw)

    def bash(self) -> str:
        self.n += 1
        return tool_call_text("Bash", {"command": f"echo {self.n}"})

    async def main(self, reply: str) -> Any:
        return await self.request(reply, self.messages)

    async def step(self, s: str | Dispatch) -> None:
        if s == "tool":
            answer = await self.main(self.bash())
            self.messages += [echo(answer), tool_result(answer.content[-1].id, "ok")]
        elif s == "retry":  # the client never got the first answer and sends it again
            await self.main(self.bash())
            answer = await self.main(self.bash())
            self.retries += 1
            self.messages += [echo(answer), tool_result(answer.content[-1].id, "ok")]
        elif s == "side":
            self.sides += 1
            title = [{"role": "user", "content": "<session>Fix the bug.</session>"}]
            await self.request('{"title": "Fix"}', title, system=TITLE_SYSTEM, tools=[])
        elif s == "compact":
            await self.compact()
        elif isinstance(s, Dispatch):
            await self.dispatch(s)

    async def compact(self) -> None:
        last = self.messages[-1]
        answer = await self.main("Finished this part.")
        summary = copy.deepcopy(self.messages)
        if isinstance(last["content"], list):  # right after a tool result: no last answer
            summary[-1]["content"].append({"type": "text", "text": COMPACT})
        else:
            summary += [echo(answer), {"role": "user", "content": COMPACT}]
        await self.request("Summary: the bug is being fixed.", summary)
        self.n += 1  # each summary differs
        self.messages = [{"role": "user", "content": f"Continue from summary {self.n}: ..."}]

    async def dispatch(self, d: Dispatch) -> None:
        prompts = [
            f"SUBTASK {self.n}: check" + ("" if d.identical else f" part {i}")
            for i in range(d.count)
        ]
        self.n += 1
        calls = "\n".join(
            tool_call_text("Agent", {"description": "Check", "prompt": p}) for p in prompts
        )
        answer = await self.main(calls)
        ids = [b.id for b in answer.content if b.type == "tool_use"]
        self.dispatched += ids
        results = {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": i, "content": "ok"} for i in ids],
        }
        self.messages.append(echo(answer))
        if d.background:
            self.messages.append(results)
            waiting = await self.main("Waiting for the agents.")
            self.messages.append(echo(waiting))
        for prompt in prompts:
            await self.subagent(prompt, d.sub_turns)
        if d.background:
            note = "<task-notification>the agents completed</task-notification>"
            self.messages.append({"role": "user", "content": note})
        else:
            self.messages.append(results)

    async def subagent(self, prompt: str, turns: int) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        for _ in range(turns - 1):
            answer = await self.request(self.bash(), messages, system=SUB_SYSTEM)
            messages += [echo(answer), tool_result(answer.content[-1].id, "ok")]
        await self.request("SUBRESULT: fine.", messages, system=SUB_SYSTEM)


async def play(tokenizer: Tokenizer, url: str, plan: list[str | Dispatch]) -> None:
    h = await make_harness(tokenizer, url)
    try:
        sid = await h.open_session(session_id=f"prop-{uuid.uuid4().hex[:12]}")
        p = Player(h, sid)
        for s in plan:
            await p.step(s)
        await p.main("All done.")
        status, live = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
        assert status == 200, live
        result = await replayed(h, sid, h.ctx.rules)
        check(result, live, p, await engine_output_tokens(h, sid))
    finally:
        await h.close()


def check(result: Any, live: dict[str, Any], p: Player, engine_tokens: int) -> None:
    assert_live_equals_offline(result)
    assert msgspec.json.encode(result.samples) == msgspec.json.encode(live["samples"])
    segments = [(s.kind, s.dispatch_tool_use_id, s.dropped) for s in result.segments]
    assert sorted(d for k, d, _ in segments if k == "subagent") == sorted(p.dispatched)
    assert [k for k, _, dropped in segments if k == "side" and dropped] == ["side"] * p.sides
    assert [k for k, _, _ in segments].count("final") == 1 and segments[-1][0] == "final"
    acc = dict(result.token_accounting)
    assert acc.pop("engine output") == engine_tokens == sum(acc.values())
    allowed = {"trained", "masked: TITO failed"}
    if p.sides:
        allowed.add("side segment left out: side request (rules: side_requests = drop)")
    if p.retries:
        allowed.add("in no segment (abandoned branch, nested or orphan chain)")
    capped = {k for k in acc if k.endswith("left out: over max_segments=8")}  # the default cap
    assert set(acc) - capped <= allowed, acc


@settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=plans)
def test_generated_sessions_segment_the_same_live_and_replayed(
    tokenizer: Tokenizer, store_url: str, plan: list[str | Dispatch]
) -> None:
    asyncio.run(play(tokenizer, store_url, plan))
