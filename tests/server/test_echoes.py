"""Clients echo our answers in their own way: every variant is the same answer, not an edit.

Many agent frameworks drop an assistant message's empty or whitespace text
beside its tool calls, some drop the text whole, some the reasoning; a
Responses client may send back the `function_call` item alone. Each must
extend the chain (live decision `extend`), and replay must agree: one
sample, every engine output token trained, nothing "in no segment".
Driven by the official `openai` SDK against the real server.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from recorder.log import events as ev
from tests.server.conftest import Harness, tool_call_text
from tests.server.test_openai import (
    CHAT_TOOLS,
    RESPONSES_TOOLS,
    RESULTS,
    SYSTEM,
    engine_outputs,
    openai_client,
    trained,
)

REASONED = (
    "<think>I should list the files.</think>"
    + tool_call_text("Bash", {"command": "ls"}, preface="Let me look around.\n"),
    "<think>Now read it.</think>"
    + tool_call_text("Bash", {"command": "cat a.txt"}, preface="Reading it now.\n"),
    "The file says hello. Done.",
)

Echo = Callable[[dict[str, Any]], dict[str, Any]]


def _without(key: str) -> Echo:
    return lambda m: {k: v for k, v in m.items() if k != key}


CHAT_ECHOES: dict[str, Echo] = {
    "content null": lambda m: {**m, "content": None},
    "content empty": lambda m: {**m, "content": ""},
    "content whitespace": lambda m: {**m, "content": " \n "},
    "content missing": _without("content"),
    "reasoning dropped": _without("reasoning_content"),
    "text and reasoning dropped": lambda m: {
        **_without("reasoning_content")(m),
        "content": None,
    },
}


async def _close(h: Harness, sid: str) -> dict[str, Any]:
    status, data = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    assert status == 200, data
    return data


async def _check_one_chain(h: Harness, sid: str) -> None:
    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [d.action for d in decisions] == ["new", "extend", "extend"]  # type: ignore[attr-defined]
    result = await _close(h, sid)
    assert len(result["samples"]) == 1, result["diagnostics"]
    assert trained(result["samples"]) == await engine_outputs(h, sid)
    acc = result["token_accounting"]
    assert acc["trained"] == acc["engine output"], acc
    assert not [d for d in result["diagnostics"] if "abandoned" in d or "live decision" in d]


@pytest.mark.parametrize("echo", list(CHAT_ECHOES))
async def test_chat_echo_variants_extend_the_chain(harness: Harness, echo: str) -> None:
    h = harness
    sid = await h.open_session(instance_id="echo")
    h.engine.push(*REASONED)
    client = openai_client(h, sid)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is in this repo?"},
    ]
    for result in (*RESULTS, None):
        done = await client.chat.completions.create(
            model="m", messages=messages, tools=CHAT_TOOLS, max_tokens=256
        )
        message = done.choices[0].message.model_dump(exclude_none=True)
        if result is None:
            break
        assert message["content"].strip() and message.get("reasoning_content")
        messages.append(CHAT_ECHOES[echo](message))
        call = message["tool_calls"][0]
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    await _check_one_chain(h, sid)


@pytest.mark.parametrize("keep", ["function_call only", "reasoning dropped", "all items"])
async def test_responses_echo_variants_extend_the_chain(harness: Harness, keep: str) -> None:
    h = harness
    sid = await h.open_session(instance_id="echo")
    h.engine.push(*REASONED)
    client = openai_client(h, sid)
    items: list[Any] = [{"role": "user", "content": "What is in this repo?"}]
    kept = {
        "function_call only": {"function_call"},
        "reasoning dropped": {"function_call", "message"},
        "all items": {"function_call", "message", "reasoning"},
    }[keep]
    for result in (*RESULTS, None):
        response = await client.responses.create(
            model="m",
            instructions=SYSTEM,
            tools=RESPONSES_TOOLS,
            max_output_tokens=256,
            input=items,
        )
        output = [o.model_dump(exclude_none=True) for o in response.output]
        if result is None:
            break
        assert {o["type"] for o in output} == {"reasoning", "message", "function_call"}
        items += [o for o in output if o["type"] in kept]
        call = next(o for o in output if o["type"] == "function_call")
        items.append({"type": "function_call_output", "call_id": call["call_id"], "output": result})
    await _check_one_chain(h, sid)


async def test_an_echo_with_other_text_is_still_an_edit(harness: Harness) -> None:
    """Dropping text is an echo; changing it is not: the chain forks, as before."""
    h = harness
    sid = await h.open_session(instance_id="echo")
    h.engine.push(*REASONED)
    client = openai_client(h, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is in this repo?"}]
    done = await client.chat.completions.create(
        model="m", messages=messages, tools=CHAT_TOOLS, max_tokens=256
    )
    message = done.choices[0].message.model_dump(exclude_none=True)
    call = message["tool_calls"][0]
    messages += [
        {**message, "content": "Something I never said."},
        {"role": "tool", "tool_call_id": call["id"], "content": "a.txt"},
    ]
    await client.chat.completions.create(
        model="m", messages=messages, tools=CHAT_TOOLS, max_tokens=256
    )
    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [d.action for d in decisions] == ["new", "new"]  # type: ignore[attr-defined]
