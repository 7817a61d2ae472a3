"""Which chain and segment a request lands in, live and replayed (issue 16), on both stores.

Each test drives `recorder serve` with the official SDK and a scripted
engine, then reduces the recorded log offline: the live chain decisions and
the replayed segments must agree (the reducer notes any disagreement as a
"live decision was ..." diagnostic) and every engine output token must be
trained or masked for a reason the sample states.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from recorder.log import events as ev
from replay.load import load_session
from replay.reducer import reduce_session
from replay.rules import Rules
from replay.samples import SessionResult
from tests.server.conftest import Harness, tool_call_text
from tests.server.test_e2e import ask, echo, tool_result


async def replayed(h: Harness, sid: str, rules: Rules | None = None) -> SessionResult:
    log = await load_session(h.store, sid)
    return reduce_session(log.events, log.arrays, rules or Rules())


async def engine_output_tokens(h: Harness, sid: str) -> int:
    return sum(r.output_ids.length for r in await h.payloads(sid, ev.GenerateResult))


def assert_live_equals_offline(result: SessionResult) -> None:
    disagreements = [d for d in result.diagnostics if "live decision was" in d]
    assert not disagreements, disagreements


def returns(first: Any, results: dict[str, str]) -> list[dict[str, Any]]:
    """The main line's next messages: the answer that dispatched, then each dispatch's
    tool result (dispatch id -> its text)."""
    blocks = [{"type": "tool_result", "tool_use_id": i, "content": c} for i, c in results.items()]
    return [echo(first), {"role": "user", "content": blocks}]


async def closed_and_replayed(h: Harness, sid: str) -> SessionResult:
    await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    return await replayed(h, sid)


# (tool, input the model emitted, the input as the client re-sends it)
NORMALISATIONS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # Seen in Claude Code 2.1.197 and 2.1.330 traffic: the schema default first.
    (
        "Edit",
        {"file_path": "/w/a.py", "old_string": "helo", "new_string": "hello"},
        {"replace_all": False, "file_path": "/w/a.py", "old_string": "helo", "new_string": "hello"},
    ),
    (
        "MultiEdit",
        {"file_path": "/w/a.py", "edits": [{"old_string": "a", "new_string": "b"}]},
        {
            "file_path": "/w/a.py",
            "edits": [{"replace_all": False, "old_string": "a", "new_string": "b"}],
        },
    ),
    (
        "Write",
        {"file_path": "/w/b.py", "content": "x = 1\n"},
        {"content": "x = 1\n", "file_path": "/w/b.py"},
    ),
    (
        "Bash",
        {"command": "pytest -q", "description": "Run the tests"},
        {"description": "Run the tests", "command": "pytest -q", "timeout": 120000},
    ),
    (
        "Read",
        {"file_path": "/w/a.py", "offset": "10", "limit": "5"},
        {"file_path": "/w/a.py", "offset": 10, "limit": 5},
    ),
    (
        "Agent",
        {"description": "Count", "prompt": "Count the lines", "subagent_type": "general-purpose"},
        {
            "run_in_background": True,
            "description": "Count",
            "prompt": "Count the lines",
            "subagent_type": "general-purpose",
        },
    ),
    (
        "TodoWrite",
        {"todos": [{"content": "Fix", "status": "pending", "activeForm": "Fixing"}]},
        {"todos": [{"activeForm": "Fixing", "content": "Fix", "status": "pending", "id": "1"}]},
    ),
]


BUILT_IN_TOOLS = [
    {"name": name, "description": name, "input_schema": {"type": "object"}}
    for name in dict.fromkeys(n[0] for n in NORMALISATIONS)
]


@pytest.mark.parametrize(
    ("tool", "emitted", "resent"), NORMALISATIONS, ids=[n[0] for n in NORMALISATIONS]
)
async def test_a_normalised_tool_input_extends_the_chain(
    any_harness: Harness, tool: str, emitted: dict[str, Any], resent: dict[str, Any]
) -> None:
    """The client re-sends our tool call with its input normalised: still our answer."""
    h = any_harness
    sid = await h.open_session(instance_id="identity")
    client = h.client(sid)
    h.engine.push(tool_call_text(tool, emitted, preface="On it.\n"), "Done.")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the typo."}]
    first = await ask(client, messages, stream=False, tools=BUILT_IN_TOOLS)
    call = first.content[-1]
    assert call.type == "tool_use" and call.input == emitted
    echoed = echo(first)
    echoed["content"][-1]["input"] = copy.deepcopy(resent)
    echoed["content"][0]["text"] = "  " + echoed["content"][0]["text"] + "\n"
    messages += [echoed, tool_result(call.id, "ok")]
    await ask(client, messages, stream=False, tools=BUILT_IN_TOOLS)
    await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})

    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [(d.action, d.reason) for d in decisions] == [("new", "first"), ("extend", "extends")]
    result = await replayed(h, sid)
    assert_live_equals_offline(result)
    assert [s.kind for s in result.segments] == ["final"]
    assert not [d for d in result.diagnostics if "abandoned" in d]
    (sample,) = result.samples
    assert sum(sample.loss_mask) == await engine_output_tokens(h, sid)


async def test_another_answer_under_other_ids_still_forks(any_harness: Harness) -> None:
    """Only our own call ids are our answer: a different call is a real change of history."""
    h = any_harness
    sid = await h.open_session(instance_id="identity-fork")
    client = h.client(sid)
    h.engine.push(tool_call_text("Bash", {"command": "ls"}), "Done.")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Look around."}]
    first = await ask(client, messages, stream=False)
    other = echo(first)
    other["content"][-1]["id"] = "toolu_someone_else"
    messages += [other, tool_result("toolu_someone_else", "ok")]
    await ask(client, messages, stream=False)
    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [d.action for d in decisions] == ["new", "new"]


COMPACT = "CRITICAL: Respond with TEXT ONLY. Summarise the conversation so far."


async def test_compaction_right_after_a_tool_result_trains_the_last_answer(
    any_harness: Harness,
) -> None:
    """The summary request re-sends history without the last answer: not a fork of it."""
    h = any_harness
    sid = await h.open_session(instance_id="compact")
    client = h.client(sid)
    h.engine.push(
        tool_call_text("Bash", {"command": "echo compact-marker"}),
        "The marker was printed. Done.",
        "Summary: the user ran echo compact-marker.",
        "Continuing.",
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say the marker."}]
    first = await ask(client, messages, stream=False)
    messages += [echo(first), tool_result(first.content[-1].id, "compact-marker")]
    await ask(client, messages, stream=False)  # the last answer before compaction
    summary_request = copy.deepcopy(messages)
    summary_request[-1]["content"].append({"type": "text", "text": COMPACT})
    await ask(client, summary_request, stream=False)
    continued = [{"role": "user", "content": "This session continues from a summary: ..."}]
    await ask(client, continued, stream=False)
    await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})

    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [(d.action, d.reason) for d in decisions] == [
        ("new", "first"),
        ("extend", "extends"),
        ("new", "compaction"),
        ("new", "compaction"),
    ]
    result = await replayed(h, sid)
    assert_live_equals_offline(result)
    assert [(s.kind, s.turns) for s in result.segments] == [
        ("wipe", [0, 1]),
        ("wipe", [2]),
        ("final", [3]),
    ]
    assert not [d for d in result.diagnostics if "abandoned" in d]
    trained = sum(sum(s.loss_mask) for s in result.samples)
    assert trained == await engine_output_tokens(h, sid)


SUB_SYSTEM = "You are a subagent. Report briefly."


async def test_background_subagent_is_linked_to_its_dispatch(any_harness: Harness) -> None:
    """Claude Code 2.1.330: the dispatch's tool_result arrives before the subagent's request."""
    h = any_harness
    sid = await h.open_session(instance_id="background")
    client = h.client(sid)
    prompt = "SUBTASK: count the lines of hello.py"
    h.engine.push(
        tool_call_text("Agent", {"description": "Count lines", "prompt": prompt}),
        "The agent runs in the background; I will wait.",
        "SUBRESULT: 5 lines.",
        "hello.py has 5 lines. Done.",
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Count the lines."}]
    first = await ask(client, messages, stream=False)
    dispatch = first.content[-1].id
    launched = f"Async agent launched successfully. agentId: a1b2 (dispatch {dispatch})"
    messages += [echo(first), tool_result(dispatch, launched)]
    waiting = await ask(client, messages, stream=False)
    await ask(client, [{"role": "user", "content": prompt}], stream=False, system=SUB_SYSTEM)
    notification = (
        "<task-notification>agent a1b2 completed: SUBRESULT: 5 lines.</task-notification>"
    )
    messages += [echo(waiting), {"role": "user", "content": notification}]
    await ask(client, messages, stream=False)
    await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})

    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [(d.action, d.reason, d.dispatch_tool_use_id) for d in decisions] == [
        ("new", "first", None),
        ("extend", "extends", None),
        ("new", "subagent", dispatch),
        ("extend", "extends", None),
    ]
    result = await replayed(h, sid)
    assert_live_equals_offline(result)
    assert [(s.kind, s.dispatch_tool_use_id) for s in result.segments] == [
        ("subagent", dispatch),
        ("final", None),
    ]
    assert not [d for d in result.diagnostics if "foreign system prompt" in d]
    trained = sum(sum(s.loss_mask) for s in result.samples)
    assert trained == await engine_output_tokens(h, sid)


TITLE_SYSTEM = "Generate a concise, sentence-case title (3-7 words) for this coding session."


async def test_side_requests_are_their_own_kind_first_or_last(any_harness: Harness) -> None:
    """A title request before the main line and a check after it: `side`, never `final`."""
    h = any_harness
    sid = await h.open_session(instance_id="side")
    client = h.client(sid)
    h.engine.push(
        '{"title": "Say the marker"}',
        tool_call_text("Bash", {"command": "echo side-marker"}),
        "Printed side-marker. Done.",
        '{"safe": true}',
    )
    title = [{"role": "user", "content": "<session>\nSay the marker.\n</session>"}]
    await ask(client, title, stream=False, system=TITLE_SYSTEM, tools=[], max_tokens=64)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say the marker."}]
    first = await ask(client, messages, stream=False)
    messages += [echo(first), tool_result(first.content[-1].id, "side-marker")]
    await ask(client, messages, stream=False)
    check = [{"role": "user", "content": "Is `echo side-marker` safe?"}]
    await ask(client, check, stream=False, system="Classify commands.", tools=[], max_tokens=32)
    await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})

    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [(d.action, d.reason) for d in decisions] == [
        ("new", "first"),
        ("new", "first"),  # the main line begins: the first request was a side request
        ("extend", "extends"),
        ("new", "side"),
    ]
    result = await replayed(h, sid)
    assert_live_equals_offline(result)
    assert [(s.kind, s.turns, s.dropped is not None) for s in result.segments] == [
        ("side", [0], True),
        ("side", [3], True),
        ("final", [1, 2], False),
    ]
    (main,) = result.samples
    assert main.reward == 1.0
    trained = await replayed(h, sid, Rules(side_requests="train"))
    assert [s.metadata["segment_kind"] for s in trained.samples] == ["side", "side", "final"]
    total = sum(sum(s.loss_mask) for s in trained.samples)
    assert total == await engine_output_tokens(h, sid)


AGENT_SYSTEM = (
    "You are an interactive agent that helps users with software engineering tasks. "
    "Read the code before changing it, keep changes small, run the tests, and report "
    "what you did and what you could not do. Answer in the user's language."
)


async def test_without_tools_the_main_line_is_the_conversation_not_the_title(
    any_harness: Harness,
) -> None:
    """`claude -p ... --tools ""` with nonessential traffic: a title request comes first and no
    request offers tools. The agent's conversation (longer: its instructions and work) takes the
    main line; the title and a later check are `side`, never `final`."""
    h = any_harness
    sid = await h.open_session(instance_id="side-no-tools")
    client = h.client(sid)
    h.engine.push('{"title": "Greeting"}', "Hi there!", "Goodbye!", '{"safe": true}')
    title = [{"role": "user", "content": "<session>\nSay hi.\n</session>"}]
    await ask(client, title, stream=False, system=TITLE_SYSTEM, tools=[], max_tokens=64)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say hi."}]
    first = await ask(client, messages, stream=False, system=AGENT_SYSTEM, tools=[])
    messages += [echo(first), {"role": "user", "content": "Thanks, bye."}]
    await ask(client, messages, stream=False, system=AGENT_SYSTEM, tools=[])
    check = [{"role": "user", "content": "Is `echo hi` safe?"}]
    await ask(client, check, stream=False, system="Classify commands.", tools=[], max_tokens=32)
    await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})

    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [(d.action, d.reason) for d in decisions] == [  # type: ignore[attr-defined]
        ("new", "first"),
        ("new", "first"),  # the conversation takes the main line from the title request
        ("extend", "extends"),
        ("new", "side"),
    ]
    result = await replayed(h, sid)
    assert_live_equals_offline(result)
    assert [(s.kind, s.turns) for s in result.segments] == [
        ("side", [0]),
        ("side", [3]),
        ("final", [1, 2]),
    ]
    results = await h.payloads(sid, ev.GenerateResult)
    main_tokens = sum(r.output_ids.length for r in results if r.turn in (1, 2))  # type: ignore[attr-defined]
    assert sum(sum(s.loss_mask) for s in result.samples) == main_tokens


async def test_without_tools_a_title_after_the_answer_stays_side(any_harness: Harness) -> None:
    """The same two requests the other way round: the short title request takes nothing."""
    h = any_harness
    sid = await h.open_session(instance_id="side-no-tools-after")
    client = h.client(sid)
    h.engine.push("Hi there!", '{"title": "Greeting"}')
    await ask(client, [{"role": "user", "content": "Say hi."}], stream=False,
              system=AGENT_SYSTEM, tools=[])  # fmt: skip
    title = [{"role": "user", "content": "<session>\nSay hi.\n</session>"}]
    await ask(client, title, stream=False, system=TITLE_SYSTEM, tools=[], max_tokens=64)
    await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [d.reason for d in decisions] == ["first", "side"]  # type: ignore[attr-defined]
    result = await replayed(h, sid)
    assert_live_equals_offline(result)
    assert [(s.kind, s.turns) for s in result.segments] == [("side", [1]), ("final", [0])]


async def test_subagent_sharing_the_main_system_prompt_agrees_live_and_offline(
    any_harness: Harness,
) -> None:
    h = any_harness
    sid = await h.open_session(instance_id="same-system")
    client = h.client(sid)
    prompt = "SUBTASK: list the files"
    h.engine.push(
        tool_call_text("Agent", {"description": "List", "prompt": prompt}),
        "a.txt b.txt",
        "There are two files. Done.",
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What files are there?"}]
    first = await ask(client, messages, stream=False)
    dispatch = first.content[-1].id
    await ask(client, [{"role": "user", "content": prompt}], stream=False)
    messages += [echo(first), tool_result(dispatch, "a.txt b.txt")]
    await ask(client, messages, stream=False)
    await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})

    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [(d.reason, d.dispatch_tool_use_id) for d in decisions] == [
        ("first", None),
        ("subagent", dispatch),
        ("extends", None),
    ]
    result = await replayed(h, sid)
    assert_live_equals_offline(result)
    assert [(s.kind, s.dispatch_tool_use_id) for s in result.segments] == [
        ("subagent", dispatch),
        ("final", None),
    ]


async def test_the_same_task_dispatched_twice_in_parallel_is_two_subagents(
    any_harness: Harness,
) -> None:
    h = any_harness
    sid = await h.open_session(instance_id="twins")
    client = h.client(sid)
    task = {"description": "Check", "prompt": "SUBTASK: check the build"}
    h.engine.push(
        tool_call_text("Agent", task) + "\n" + tool_call_text("Agent", task),
        "The build is green.",
        "Green as well.",
        "Both checks agree. Done.",
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Check the build twice."}]
    first = await ask(client, messages, stream=False)
    d1, d2 = (b.id for b in first.content if b.type == "tool_use")
    sub = [{"role": "user", "content": task["prompt"]}]
    await ask(client, sub, stream=False, system=SUB_SYSTEM)
    await ask(client, sub, stream=False, system=SUB_SYSTEM)  # byte-identical first request
    messages += [
        echo(first),
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": d1, "content": "green"},
                {"type": "tool_result", "tool_use_id": d2, "content": "green"},
            ],
        },
    ]
    await ask(client, messages, stream=False)
    await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})

    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [(d.reason, d.dispatch_tool_use_id) for d in decisions] == [
        ("first", None),
        ("subagent", d1),
        ("subagent", d2),
        ("extends", None),
    ]
    result = await replayed(h, sid)
    assert_live_equals_offline(result)
    assert [(s.kind, s.dispatch_tool_use_id) for s in result.segments] == [
        ("subagent", d1),
        ("subagent", d2),
        ("final", None),
    ]
    trained = sum(sum(s.loss_mask) for s in result.samples)
    assert trained == await engine_output_tokens(h, sid)


async def test_a_resent_subagent_request_with_no_dispatch_waiting_is_a_retry(
    any_harness: Harness,
) -> None:
    h = any_harness
    sid = await h.open_session(instance_id="sub-retry")
    client = h.client(sid)
    task = {"description": "Check", "prompt": "SUBTASK: check the build"}
    h.engine.push(tool_call_text("Agent", task), "green (lost)", "green", "Done.")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Check the build."}]
    first = await ask(client, messages, stream=False)
    sub = [{"role": "user", "content": task["prompt"]}]
    await ask(client, sub, stream=False, system=SUB_SYSTEM)
    await ask(client, sub, stream=False, system=SUB_SYSTEM)  # the client retried
    messages += [echo(first), tool_result(first.content[-1].id, "green")]
    await ask(client, messages, stream=False)
    await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    result = await replayed(h, sid)
    assert_live_equals_offline(result)
    assert [s.kind for s in result.segments] == ["subagent", "final"]
    assert any("abandoned branch" in d for d in result.diagnostics)


async def assert_only_turn_1_is_abandoned(h: Harness, sid: str, result: SessionResult) -> None:
    """Every engine output token is trained but turn 1's, booked as an abandoned branch."""
    outputs = [r.output_ids.length for r in await h.payloads(sid, ev.GenerateResult)]
    assert sum(sum(s.loss_mask) for s in result.samples) == sum(outputs) - outputs[1]
    abandoned = "in no segment (abandoned branch, nested or orphan chain)"
    assert result.token_accounting[abandoned] == outputs[1]
    assert any("abandoned branch" in d for d in result.diagnostics)


async def test_a_retried_subagent_request_keeps_its_dispatch_while_another_waits(
    any_harness: Harness,
) -> None:
    """Alpha's first request is retried while Beta's dispatch still waits: a retry, not
    Beta's subagent. The lost answer is abandoned, each subagent keeps its own label."""
    h = any_harness
    sid = await h.open_session(instance_id="sub-retry-beside")
    client = h.client(sid)
    alpha = {"description": "Alpha", "prompt": "SUBTASK: inspect module alpha"}
    beta = {"description": "Beta", "prompt": "SUBTASK: inspect module beta"}
    h.engine.push(
        tool_call_text("Agent", alpha) + "\n" + tool_call_text("Agent", beta),
        "alpha: looking (answer lost in a timeout)",
        tool_call_text("Bash", {"command": "cat alpha.py"}),
        "alpha is fine.",
        "beta has a bug.",
        "Beta needs a fix. Done.",
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Inspect both modules."}]
    first = await ask(client, messages, stream=False)
    d_alpha, d_beta = (b.id for b in first.content if b.type == "tool_use")
    sub_a: list[dict[str, Any]] = [{"role": "user", "content": alpha["prompt"]}]
    await ask(client, sub_a, stream=False, system=SUB_SYSTEM)  # the client timed out
    retried = await ask(client, sub_a, stream=False, system=SUB_SYSTEM)  # the same body
    sub_a += [echo(retried), tool_result(retried.content[-1].id, "def f(): pass")]
    await ask(client, sub_a, stream=False, system=SUB_SYSTEM)
    sub_b = [{"role": "user", "content": beta["prompt"]}]
    await ask(client, sub_b, stream=False, system=SUB_SYSTEM)
    messages += returns(first, {d_alpha: "fine", d_beta: "bug"})
    await ask(client, messages, stream=False)
    result = await closed_and_replayed(h, sid)
    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [(d.reason, d.dispatch_tool_use_id) for d in decisions][4] == ("subagent", d_beta)
    assert all(d.dispatch_tool_use_id != d_beta for d in decisions[:4])
    assert_live_equals_offline(result)
    assert [(s.kind, s.dispatch_tool_use_id, s.turns) for s in result.segments] == [
        ("subagent", d_alpha, [2, 3]),
        ("subagent", d_beta, [4]),
        ("final", None, [0, 5]),
    ]
    await assert_only_turn_1_is_abandoned(h, sid, result)


async def test_an_answer_repeated_by_a_retry_trains_once_on_the_branch_the_client_kept(
    any_harness: Harness,
) -> None:
    """A re-sent request answered with the same tokens: two chains hold the same tokens.
    The next request answers the first answer's tool call, so it extends that chain; the
    repeat is an abandoned branch, not a second sample nor a compaction."""
    h = any_harness
    sid = await h.open_session(instance_id="retry-same-answer")
    client = h.client(sid)
    same = tool_call_text("Bash", {"command": "ls"})
    h.engine.push(same, same, "done")  # a low-entropy answer sampled twice alike
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Go"}]
    kept = await ask(client, messages, stream=False)
    await ask(client, messages, stream=False)  # the same body again
    messages += [echo(kept), tool_result(kept.content[-1].id, "a.txt")]
    await ask(client, messages, stream=False)
    status, closed = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    assert status == 200
    samples = [(s["metadata"]["segment_kind"], s["metadata"]["turns"], s["reward"])
               for s in closed["samples"]]  # fmt: skip
    assert samples == [("final", [0, 2], 1.0)]
    result = await replayed(h, sid)
    assert_live_equals_offline(result)
    await assert_only_turn_1_is_abandoned(h, sid, result)


# (Alpha's prompt, Beta's): a prompt inside the other's must not take the other's dispatch.
PROMPT_PAIRS = [
    ("SUBTASK: inspect module alpha", "SUBTASK: inspect module beta"),
    ("SUBTASK: run the tests", "SUBTASK: run the tests and fix what fails"),
]


@pytest.mark.parametrize("prompts", PROMPT_PAIRS, ids=["apart", "one-inside-the-other"])
async def test_parallel_subagents_starting_out_of_order_keep_their_dispatch_labels(
    any_harness: Harness, prompts: tuple[str, str]
) -> None:
    h = any_harness
    sid = await h.open_session(instance_id="out-of-order")
    client = h.client(sid)
    alpha = {"description": "Alpha", "prompt": prompts[0]}
    beta = {"description": "Beta", "prompt": prompts[1]}
    h.engine.push(
        tool_call_text("Agent", alpha) + "\n" + tool_call_text("Agent", beta),
        "beta has a bug.",
        "alpha is fine.",
        "Beta needs a fix. Done.",
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Inspect both modules."}]
    first = await ask(client, messages, stream=False)
    d_alpha, d_beta = (b.id for b in first.content if b.type == "tool_use")
    for task in (beta, alpha):  # beta's subagent asks first
        await ask(
            client, [{"role": "user", "content": task["prompt"]}], stream=False, system=SUB_SYSTEM
        )
    messages += returns(first, {d_alpha: "fine", d_beta: "bug"})
    await ask(client, messages, stream=False)
    result = await closed_and_replayed(h, sid)
    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [d.dispatch_tool_use_id for d in decisions][1:3] == [d_beta, d_alpha]
    assert_live_equals_offline(result)
    assert [(s.kind, s.dispatch_tool_use_id, s.turns) for s in result.segments] == [
        ("subagent", d_beta, [1]),
        ("subagent", d_alpha, [2]),
        ("final", None, [0, 3]),
    ]


async def test_compaction_with_the_altered_system_prompt_of_2_1_197_trains_the_last_answer(
    any_harness: Harness,
) -> None:
    """Claude Code 2.1.197's summary request drops "(1M context)" from the system prompt."""
    h = any_harness
    sid = await h.open_session(instance_id="compact-197")
    client = h.client(sid)
    h.engine.push(
        tool_call_text("Bash", {"command": "echo compact-marker"}),
        "The marker was printed. Done.",
        "Summary: the user ran echo compact-marker.",
        "Continuing.",
    )
    system_1m = "You are a careful coding agent. You are powered by model-x (1M context)."
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say the marker."}]
    first = await ask(client, messages, stream=False, system=system_1m)
    messages += [echo(first), tool_result(first.content[-1].id, "compact-marker")]
    await ask(client, messages, stream=False, system=system_1m)
    summary_request = copy.deepcopy(messages)
    summary_request[-1]["content"].append({"type": "text", "text": COMPACT})
    system = system_1m.replace(" (1M context)", "")
    await ask(client, summary_request, stream=False, system=system)
    continued = [{"role": "user", "content": "This session continues from a summary: ..."}]
    await ask(client, continued, stream=False, system=system_1m)
    await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})

    result = await replayed(h, sid)
    assert_live_equals_offline(result)
    assert [(s.kind, s.turns) for s in result.segments] == [
        ("wipe", [0, 1]),
        ("wipe", [2]),
        ("final", [3]),
    ]
    acc = result.token_accounting
    assert acc["trained"] == acc["engine output"] == await engine_output_tokens(h, sid)
