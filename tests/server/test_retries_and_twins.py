"""Retries answered with the same tokens, and subagent retries beside other dispatches.

From two audits of the reducer's chain choice: a request re-sent and answered alike
leaves two chains with the same tokens, and every later request must land on the one
the client kept, or fork from it, never on the repeat; a subagent's retried first
request is a retry unless a dispatch of the same task waits (one prompt may hold
another; an Agent call without a prompt is no task). Every test checks that live and
replayed decisions agree and which engine output tokens are trained.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from recorder.log import events as ev
from tests.server.conftest import Harness, tool_call_text
from tests.server.test_chain_identity import (
    COMPACT,
    SUB_SYSTEM,
    assert_live_equals_offline,
    closed_and_replayed,
    returns,
)
from tests.server.test_e2e import ask, echo, tool_result
from tests.server.test_echoes import REASONED
from tests.server.test_openai import CHAT_TOOLS, openai_client


async def outputs(h: Harness, sid: str) -> list[int]:
    return [r.output_ids.length for r in await h.payloads(sid, ev.GenerateResult)]


async def test_a_repeated_answer_then_a_timeout_retry_trains_each_answer_once(
    harness: Harness,
) -> None:
    h = harness
    sid = await h.open_session(instance_id="repeat-then-retry")
    client = h.client(sid)
    same = tool_call_text("Bash", {"command": "ls"})
    h.engine.push(
        same,
        same,  # the retry of turn 0 sampled alike
        tool_call_text("Bash", {"command": "cat a.txt"}),  # lost in a timeout
        tool_call_text("Bash", {"command": "cat b.txt"}),  # the retry's answer, kept
        "done",
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Go"}]
    kept = await ask(client, messages, stream=False)
    await ask(client, messages, stream=False)  # the same body again
    messages += [echo(kept), tool_result(kept.content[-1].id, "a.txt b.txt")]
    await ask(client, messages, stream=False)  # answer lost: the client times out
    second = await ask(client, messages, stream=False)  # the same body again
    messages += [echo(second), tool_result(second.content[-1].id, "B")]
    await ask(client, messages, stream=False)
    result = await closed_and_replayed(h, sid)
    out = await outputs(h, sid)
    assert_live_equals_offline(result)
    # turns 1 and 2 are unused; 0, 3, 4 trained once each
    assert sum(sum(s.loss_mask) for s in result.samples) == out[0] + out[3] + out[4]


async def test_a_repeated_answer_then_compaction_right_after_a_tool_result(
    harness: Harness,
) -> None:
    """As test_compaction_right_after_a_tool_result_trains_the_last_answer, but the first
    request was retried and answered alike: every engine output token but the repeat's
    must be trained once."""
    h = harness
    sid = await h.open_session(instance_id="repeat-then-compact")
    client = h.client(sid)
    same = tool_call_text("Bash", {"command": "echo compact-marker"})
    h.engine.push(
        same,
        same,  # the retry, sampled alike
        "The marker was printed. Done.",
        "Summary: the user ran echo compact-marker.",
        "Continuing.",
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say the marker."}]
    first = await ask(client, messages, stream=False)
    await ask(client, messages, stream=False)  # the same body again
    messages += [echo(first), tool_result(first.content[-1].id, "compact-marker")]
    await ask(client, messages, stream=False)  # the last answer before compaction
    summary_request = copy.deepcopy(messages)
    summary_request[-1]["content"].append({"type": "text", "text": COMPACT})
    await ask(client, summary_request, stream=False)
    continued = [{"role": "user", "content": "This session continues from a summary: ..."}]
    await ask(client, continued, stream=False)
    result = await closed_and_replayed(h, sid)
    out = await outputs(h, sid)
    assert_live_equals_offline(result)
    assert [(s.kind, s.turns) for s in result.segments] == [
        ("wipe", [0, 2]),
        ("wipe", [3]),
        ("final", [4]),
    ]
    assert sum(sum(s.loss_mask) for s in result.samples) == sum(out) - out[1]


async def test_a_repeated_first_answer_does_not_capture_a_retry_many_turns_later(
    harness: Harness,
) -> None:
    """One coincidental repeat at turn 0; three ordinary tool turns; then an ordinary
    timeout retry of turn 4. The retry extends the repeat's one-turn chain."""
    h = harness
    sid = await h.open_session(instance_id="repeat-far")
    client = h.client(sid)
    same = tool_call_text("Bash", {"command": "ls"})
    h.engine.push(
        same,
        same,
        tool_call_text("Bash", {"command": "cat a.txt"}),
        tool_call_text("Bash", {"command": "cat b.txt"}),
        tool_call_text("Bash", {"command": "pytest -q"}),  # turn 4: lost in a timeout
        tool_call_text("Bash", {"command": "pytest -x"}),  # turn 5: the retry's answer
        "done",
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Go"}]
    a = await ask(client, messages, stream=False)
    await ask(client, messages, stream=False)  # the same body again, answered alike
    for out in ("a.txt b.txt", "A", "B"):
        messages += [echo(a), tool_result(a.content[-1].id, out)]
        a = await ask(client, messages, stream=False)
    retry = await ask(client, messages, stream=False)  # turn 4's answer was lost
    messages += [echo(retry), tool_result(retry.content[-1].id, "ok")]
    await ask(client, messages, stream=False)
    result = await closed_and_replayed(h, sid)
    out = await outputs(h, sid)
    assert_live_equals_offline(result)
    assert [(s.kind, s.turns) for s in result.segments] == [("final", [0, 2, 3, 5, 6])]
    assert sum(sum(s.loss_mask) for s in result.samples) == sum(out) - out[1] - out[4]


ALPHA = {"description": "Tests", "prompt": "SUBTASK: run the tests"}
BETA = {"description": "Fix", "prompt": "SUBTASK: run the tests and fix what fails"}


async def test_a_retried_subagent_request_beside_a_prompt_inside_its_own(
    harness: Harness,
) -> None:
    """Beta's first request is retried (timeout) while Alpha's dispatch waits; Alpha's prompt
    is a substring of Beta's. Then Alpha's subagent asks: its answers must be trained."""
    h = harness
    sid = await h.open_session(instance_id="prefix-prompts-retry")
    client = h.client(sid)
    h.engine.push(
        tool_call_text("Agent", ALPHA) + "\n" + tool_call_text("Agent", BETA),
        "beta: looking (lost)",
        "beta: fixed one failure.",
        "alpha: all tests pass.",
        "Done.",
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Test and fix."}]
    first = await ask(client, messages, stream=False)
    d_alpha, d_beta = (b.id for b in first.content if b.type == "tool_use")
    sub_b = [{"role": "user", "content": BETA["prompt"]}]
    await ask(client, sub_b, stream=False, system=SUB_SYSTEM)  # the client timed out
    await ask(client, sub_b, stream=False, system=SUB_SYSTEM)  # the same body
    await ask(client, [{"role": "user", "content": ALPHA["prompt"]}], stream=False,
              system=SUB_SYSTEM)  # fmt: skip
    messages += returns(first, {d_alpha: "pass", d_beta: "fixed"})
    await ask(client, messages, stream=False)
    result = await closed_and_replayed(h, sid)
    out = await outputs(h, sid)
    assert_live_equals_offline(result)
    assert sum(sum(s.loss_mask) for s in result.samples) == sum(out) - out[1]
    assert [(s.kind, s.dispatch_tool_use_id, s.turns) for s in result.segments] == [
        ("subagent", d_beta, [2]),
        ("subagent", d_alpha, [3]),
        ("final", None, [0, 4]),
    ]


@pytest.mark.parametrize("kept", [0, 1, 2])
async def test_three_identical_answers_the_client_keeps_one(harness: Harness, kept: int) -> None:
    h = harness
    sid = await h.open_session(instance_id=f"three-{kept}")
    client = h.client(sid)
    same = tool_call_text("Bash", {"command": "ls"})
    h.engine.push(same, same, same, "done", "bye")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Go"}]
    answers = [await ask(client, messages, stream=False) for _ in range(3)]
    a = answers[kept]
    messages += [echo(a), tool_result(a.content[-1].id, "a.txt")]
    b = await ask(client, messages, stream=False)
    messages += [echo(b), {"role": "user", "content": "thanks"}]
    await ask(client, messages, stream=False)
    result = await closed_and_replayed(h, sid)
    out = await outputs(h, sid)
    assert_live_equals_offline(result)
    assert [(s.kind, s.turns) for s in result.segments] == [("final", [kept, 3, 4])]
    assert sum(sum(s.loss_mask) for s in result.samples) == out[kept] + out[3] + out[4]


@pytest.mark.parametrize("order", ["interleaved", "sequential"])
async def test_twin_subagents_answering_alike(harness: Harness, order: str) -> None:
    h = harness
    sid = await h.open_session(instance_id=f"twins-alike-{order}")
    client = h.client(sid)
    task = {"description": "Check", "prompt": "SUBTASK: check the build"}
    same = tool_call_text("Bash", {"command": "make"})
    if order == "interleaved":
        h.engine.push(
            tool_call_text("Agent", task) + "\n" + tool_call_text("Agent", task),
            same, same, "green one.", "green two.", "Both agree. Done.",
        )  # fmt: skip
    else:
        h.engine.push(
            tool_call_text("Agent", task) + "\n" + tool_call_text("Agent", task),
            same, "green one.", same, "green two.", "Both agree. Done.",
        )  # fmt: skip
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Check the build twice."}]
    first = await ask(client, messages, stream=False)
    d1, d2 = (b.id for b in first.content if b.type == "tool_use")
    subs = [[{"role": "user", "content": task["prompt"]}] for _ in range(2)]

    async def step1(s: list[dict[str, Any]]) -> None:
        r = await ask(client, s, stream=False, system=SUB_SYSTEM)
        s += [echo(r), tool_result(r.content[-1].id, "ok")]

    async def step2(s: list[dict[str, Any]]) -> None:
        await ask(client, s, stream=False, system=SUB_SYSTEM)

    if order == "interleaved":
        await step1(subs[0])
        await step1(subs[1])
        await step2(subs[0])
        await step2(subs[1])
    else:
        await step1(subs[0])
        await step2(subs[0])
        await step1(subs[1])
        await step2(subs[1])
    messages += returns(first, {d1: "green", d2: "green"})
    await ask(client, messages, stream=False)
    result = await closed_and_replayed(h, sid)
    out = await outputs(h, sid)
    assert_live_equals_offline(result)
    assert sum(sum(s.loss_mask) for s in result.samples) == sum(out)
    kinds = sorted((s.dispatch_tool_use_id or "", len(s.turns)) for s in result.segments)
    assert kinds == sorted([(d1, 2), (d2, 2), ("", 2)])


async def test_a_retry_beside_a_malformed_dispatch_stays_a_retry(
    harness: Harness,
) -> None:
    """The policy emits Alpha, Beta and a malformed Agent call (no prompt; the client
    rejects it, its error result comes back with the others). Alpha's first request is
    retried: a retry, not Beta's subagent."""
    h = harness
    sid = await h.open_session(instance_id="retry-beside-no-prompt")
    client = h.client(sid)
    alpha = {"description": "Alpha", "prompt": "SUBTASK: inspect module alpha"}
    beta = {"description": "Beta", "prompt": "SUBTASK: inspect module beta"}
    broken = {"description": "Gamma"}
    h.engine.push(
        "\n".join(tool_call_text("Agent", x) for x in (alpha, beta, broken)),
        "alpha: looking (answer lost in a timeout)",
        "alpha is fine.",
        "beta has a bug.",
        "Beta needs a fix. Done.",
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Inspect both modules."}]
    first = await ask(client, messages, stream=False)
    d_alpha, d_beta, d_broken = (b.id for b in first.content if b.type == "tool_use")
    sub_a: list[dict[str, Any]] = [{"role": "user", "content": alpha["prompt"]}]
    await ask(client, sub_a, stream=False, system=SUB_SYSTEM)  # the client timed out
    await ask(client, sub_a, stream=False, system=SUB_SYSTEM)  # the same body
    await ask(client, [{"role": "user", "content": beta["prompt"]}], stream=False,
              system=SUB_SYSTEM)  # fmt: skip
    messages += [
        echo(first),
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": d_alpha, "content": "fine"},
            {"type": "tool_result", "tool_use_id": d_beta, "content": "bug"},
            {"type": "tool_result", "tool_use_id": d_broken, "is_error": True,
             "content": "InputValidationError: prompt is required"},
        ]},
    ]  # fmt: skip
    await ask(client, messages, stream=False)
    result = await closed_and_replayed(h, sid)
    out = await outputs(h, sid)
    assert_live_equals_offline(result)
    assert [(s.kind, s.dispatch_tool_use_id, s.turns) for s in result.segments] == [
        ("subagent", d_alpha, [2]),
        ("subagent", d_beta, [3]),
        ("final", None, [0, 4]),
    ]
    assert sum(sum(s.loss_mask) for s in result.samples) == sum(out) - out[1]


async def test_a_client_that_rewrites_tool_call_ids_is_named_in_the_diagnostics(
    harness: Harness,
) -> None:
    """A Chat Completions client that answers our calls under ids of its own (an audit:
    96 of 104 output tokens untrained) cannot be followed; the reducer says why, once,
    beside the tokens booked as abandoned."""
    h = harness
    sid = await h.open_session(instance_id="rewritten-ids")
    h.engine.push(*REASONED)  # thinking, then a call: the re-rendered history differs
    client = openai_client(h, sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is in this repo?"}]
    for n, output in enumerate(("a.txt", "hello", None)):
        done = await client.chat.completions.create(
            model="m", messages=messages, tools=CHAT_TOOLS, max_tokens=256
        )
        if output is None:
            break
        message = done.choices[0].message.model_dump(exclude_none=True)
        message["tool_calls"][0]["id"] = own = f"call_{n}"  # the client's own id
        messages += [message, {"role": "tool", "tool_call_id": own, "content": output}]
    result = await closed_and_replayed(h, sid)
    named = [d for d in result.diagnostics if "rewrites tool-call ids" in d]
    assert len(named) == 1 and "call_0" in named[0], result.diagnostics
    assert result.token_accounting["in no segment (abandoned branch, nested or orphan chain)"]
