"""The OpenAI dialects through the official `openai` SDK: what the agent sees, what replay makes.

A fixture parametrised over dialects runs the same scripted conversation
over /v1/messages, /v1/chat/completions and /v1/responses: the samples must
be byte-identical, and their trained tokens the engine's output tokens.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest

from recorder.dialects.chat import InvalidRequest
from recorder.log import events as ev
from tests.server.conftest import Harness, tool_call_text

SYSTEM = "You are a careful coding agent."
BASH_SCHEMA = {
    "type": "object",
    "properties": {"command": {"type": "string"}},
    "required": ["command"],
}
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "Bash",
            "description": "Run a shell command.",
            "parameters": BASH_SCHEMA,
        },
    }
]
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "Bash",
        "description": "Run a shell command.",
        "parameters": BASH_SCHEMA,
    }
]
ANTHROPIC_TOOLS = [
    {"name": "Bash", "description": "Run a shell command.", "input_schema": BASH_SCHEMA}
]
SCRIPT = (
    tool_call_text("Bash", {"command": "ls"}, preface="Let me look around.\n"),
    tool_call_text("Bash", {"command": "cat a.txt"}),
    "The file says hello. Done.",
)
RESULTS = ("a.txt", "hello")


def openai_client(h: Harness, sid: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=h.url + "/v1", api_key=sid, max_retries=0)


async def samples_of(h: Harness, sid: str) -> list[dict[str, Any]]:
    """The samples the live recorder gives when the session closes."""
    status, data = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    assert status == 200, data
    return data["samples"]


async def engine_outputs(h: Harness, sid: str) -> list[int]:
    out: list[int] = []
    for e in await h.payloads(sid, ev.GenerateResult):
        out.extend(await h.array(e.output_ids))  # type: ignore[arg-type]
    return out


def trained(samples: list[Any]) -> list[int]:
    tokens: list[int] = []
    for s in samples:
        response = s["tokens"][s["prompt_len"] :]
        tokens.extend(t for t, m in zip(response, s["loss_mask"], strict=True) if m)
    return tokens


# --------------------------------------------------------------------------
# One scripted conversation per dialect
# --------------------------------------------------------------------------


async def run_chat(h: Harness, sid: str, stream: bool) -> list[str]:
    client = openai_client(h, sid)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is in this repo?"},
    ]
    finishes = []
    for result in (*RESULTS, None):
        if stream:
            chunks = []
            stream_ = await client.chat.completions.create(
                model="m",
                messages=messages,
                tools=CHAT_TOOLS,
                stream=True,
                stream_options={"include_usage": True},
                max_tokens=256,
            )
            async for chunk in stream_:
                chunks.append(chunk)
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
            message, finish = _assemble(chunks)
        else:
            done = await client.chat.completions.create(
                model="m", messages=messages, tools=CHAT_TOOLS, max_tokens=256
            )
            message = done.choices[0].message.model_dump(exclude_none=True)
            finish = done.choices[0].finish_reason
            assert done.usage is not None and done.usage.completion_tokens > 0
        finishes.append(finish)
        message.pop("reasoning_content", None)
        messages.append(message)
        if result is not None:
            call = message["tool_calls"][0]
            assert call["function"]["name"] == "Bash"
            json.loads(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return finishes


def _assemble(chunks: list[Any]) -> tuple[dict[str, Any], str]:
    """The assistant message a streaming client builds from the chunks."""
    content, calls, finish = "", {}, ""
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or ():
                slot = calls.setdefault(
                    call.index,
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                slot["id"] += call.id or ""
                slot["function"]["name"] += call.function.name or ""
                slot["function"]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


async def run_responses(h: Harness, sid: str, stream: bool, chained: bool = False) -> list[str]:
    client = openai_client(h, sid)
    items: list[Any] = [{"role": "user", "content": "What is in this repo?"}]
    previous: str | None = None
    statuses = []
    for result in (*RESULTS, None):
        kwargs: dict[str, Any] = {
            "model": "m",
            "instructions": SYSTEM,
            "tools": RESPONSES_TOOLS,
            "max_output_tokens": 256,
            "input": items,
        }
        if previous is not None:
            kwargs["previous_response_id"] = previous
        if stream:
            kinds = []
            response = None
            async for event in await client.responses.create(stream=True, **kwargs):
                kinds.append(event.type)
                if event.type == "response.completed":
                    response = event.response
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            assert response is not None
        else:
            response = await client.responses.create(**kwargs)
        statuses.append(response.status)
        assert response.usage is not None and response.usage.output_tokens > 0
        output = [o.model_dump(exclude_none=True) for o in response.output if o.type != "reasoning"]
        calls = [o for o in output if o["type"] == "function_call"]
        if chained:
            previous, items = response.id, []
        else:
            items = items + output
        if result is not None:
            assert calls and calls[0]["name"] == "Bash"
            items.append(
                {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": result}
            )
        else:
            assert response.output_text.strip() == "The file says hello. Done."
    return statuses


async def run_anthropic(h: Harness, sid: str, stream: bool) -> list[str]:
    client = h.client(sid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is in this repo?"}]
    reasons = []
    for result in (*RESULTS, None):
        kw: dict[str, Any] = {
            "model": "m",
            "system": SYSTEM,
            "tools": ANTHROPIC_TOOLS,
            "max_tokens": 256,
            "messages": messages,
        }
        if stream:
            async with client.messages.stream(**kw) as s:
                reply = await s.get_final_message()
        else:
            reply = await client.messages.create(**kw)
        reasons.append(reply.stop_reason)
        blocks = [
            b.model_dump(exclude_none=True, exclude={"citations", "caller"}) for b in reply.content
        ]
        messages = [*messages, {"role": "assistant", "content": blocks}]
        if result is not None:
            call = next(b for b in reply.content if b.type == "tool_use")
            messages.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}],
                }
            )
    return reasons


DIALECT_RUNS = {
    "anthropic": run_anthropic,
    "openai-chat": run_chat,
    "openai-responses": run_responses,
}


@pytest.fixture(params=list(DIALECT_RUNS))
def dialect(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_tool_conversation_in_every_dialect(
    harness: Harness, dialect: str, stream: bool
) -> None:
    h = harness
    sid = await h.open_session(instance_id="repo-1")
    h.engine.push(*SCRIPT)
    ends = await DIALECT_RUNS[dialect](h, sid, stream)
    assert len(ends) == 3
    recorded = await h.payloads(sid, ev.MessagesRequest)
    assert {r.dialect for r in recorded} == {dialect}  # type: ignore[attr-defined]
    samples = await samples_of(h, sid)
    assert len(samples) == 1  # one chain: every turn spliced onto the earlier tokens
    assert trained(samples) == await engine_outputs(h, sid)


async def test_chat_finish_reasons(harness: Harness) -> None:
    h = harness
    sid = await h.open_session(instance_id="repo-1")
    h.engine.push(*SCRIPT)
    assert await run_chat(h, sid, stream=False) == ["tool_calls", "tool_calls", "stop"]


async def test_samples_identical_across_dialects(tokenizer: Any, sqlite_url: str) -> None:
    """The same conversation is the same trajectory, whatever the client spoke."""
    from tests.server.conftest import make_harness

    encoded = {}
    for name, run in DIALECT_RUNS.items():
        h = await make_harness(tokenizer, sqlite_url)
        try:
            sid = await h.open_session(instance_id="repo-1")
            h.engine.push(*SCRIPT)
            await run(h, sid, False)
            encoded[name] = [
                {k: s[k] for k in ("tokens", "prompt_len", "loss_mask", "rollout_logprobs")}
                for s in await samples_of(h, sid)
            ]
        finally:
            await h.close()
    assert encoded["openai-chat"] == encoded["anthropic"]
    assert encoded["openai-responses"] == encoded["anthropic"]


async def test_responses_previous_response_id_splices_like_a_resend(harness: Harness) -> None:
    h = harness
    resend, chained = await h.open_session(instance_id="a"), await h.open_session(instance_id="b")
    h.engine.push(*SCRIPT)
    await run_responses(h, resend, stream=False)
    h.engine.push(*SCRIPT)
    await run_responses(h, chained, stream=True, chained=True)
    a, b = await samples_of(h, resend), await samples_of(h, chained)
    assert len(b) == 1
    assert [s["tokens"] for s in a] == [s["tokens"] for s in b]
    chained = await h.open_session(instance_id="c")
    h.engine.push(*SCRIPT)
    await run_responses(h, chained, stream=False, chained=True)
    await h.restart()  # resolved from the log, not from memory
    h.engine.push("More.")
    last = (await h.payloads(chained, ev.MessagesRequest))[-1]
    client = openai_client(h, chained)
    more = await client.responses.create(
        model="m",
        instructions=SYSTEM,
        tools=RESPONSES_TOOLS,  # type: ignore[arg-type]
        previous_response_id=last.request_id,
        input="And now?",  # type: ignore[attr-defined]
    )
    assert more.output_text == "More."
    decisions = await h.payloads(chained, ev.ChainDecision)
    assert decisions[-1].action == "extend"  # type: ignore[attr-defined]


# --------------------------------------------------------------------------
# Bad input: OpenAI's error shape, status and param
# --------------------------------------------------------------------------

BAD_CHAT = [
    ({"n": 2}, 400, "n"),
    ({"messages": []}, 400, "messages"),
    ({"temperature": 3}, 400, "temperature"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    (
        {
            "messages": [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "Bash", "arguments": "{oops"},
                        }
                    ],
                },
            ]
        },
        400,
        "messages.1.tool_calls.0.function.arguments",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "tool", "tool_call_id": "nope", "content": "r"},
            ]
        },
        400,
        "messages.1",
    ),
    ({"tool_choice": "sometimes"}, 400, "tool_choice"),
]


@pytest.mark.parametrize(("patch", "status", "param"), BAD_CHAT)
async def test_chat_bad_input(
    harness: Harness, patch: dict[str, Any], status: int, param: str
) -> None:
    h = harness
    sid = await h.open_session(instance_id="x")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **patch}
    assert h.http is not None
    async with h.http.post(
        h.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {sid}"}
    ) as resp:
        data = await resp.json()
    assert resp.status == status, data
    assert data["error"]["param"] == param, data
    assert data["error"]["type"] == "invalid_request_error"
    rejected = await h.payloads(sid, ev.RequestRejected)
    assert len(rejected) == 1


BAD_RESPONSES = [
    ({"input": [{"type": "web_search_call"}]}, "input.0.type"),
    ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools.0.type"),
    ({"previous_response_id": "msg_nope"}, "previous_response_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "Bash"}]}, "input.0.arguments"),
]


@pytest.mark.parametrize(("patch", "param"), BAD_RESPONSES)
async def test_responses_bad_input(harness: Harness, patch: dict[str, Any], param: str) -> None:
    h = harness
    sid = await h.open_session(instance_id="x")
    body = {"model": "m", "input": "hi", **patch}
    client = openai_client(h, sid)
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(**body)
    assert info.value.status_code == 400
    assert info.value.param == param, info.value.body


async def test_unknown_session_is_openai_401(harness: Harness) -> None:
    client = openai_client(harness, "no-such-session")
    with pytest.raises(openai.AuthenticationError) as info:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "invalid_api_key"


async def test_sse_keepalive_is_a_comment(harness: Harness) -> None:
    """OpenAI clients read `data:` events only: the wait is bridged by SSE comments."""
    h = harness
    sid = await h.open_session(instance_id="x")
    from tools.test_engine.scripted import Reply

    h.engine.push(Reply(text="slow slow slow slow", token_delay_s=0.15))
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            h.url + "/v1/chat/completions",
            json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]},
            headers={"Authorization": f"Bearer {sid}"},
        ) as resp,
    ):
        raw = await resp.read()
    assert b": ping\n\n" in raw and b"event:" not in raw
    assert raw.endswith(b"data: [DONE]\n\n")


# --------------------------------------------------------------------------
# Subagents and compaction split the same way over Chat Completions
# --------------------------------------------------------------------------

AGENT_SCHEMA = {"type": "object", "properties": {"prompt": {"type": "string"}}}


class AnthropicTalker:
    """One dialect's side of a neutral conversation: (role, ...) entries -> its wire messages."""

    def __init__(self, h: Harness, sid: str) -> None:
        self.client = h.client(sid)

    async def ask(self, system: str, tools: list[str], history: list[Any]) -> tuple[Any, list[Any]]:
        messages: list[dict[str, Any]] = []
        for entry in history:
            if entry[0] == "user":
                messages.append({"role": "user", "content": entry[1]})
            elif entry[0] == "assistant":
                messages.append(entry[1])
            else:
                block = {"type": "tool_result", "tool_use_id": entry[1], "content": entry[2]}
                if messages[-1]["role"] == "user" and isinstance(messages[-1]["content"], list):
                    messages[-1]["content"].append(block)
                else:
                    messages.append({"role": "user", "content": [block]})
        schemas = {"Bash": BASH_SCHEMA, "Agent": AGENT_SCHEMA}
        reply = await self.client.messages.create(
            model="m",
            system=system,
            max_tokens=256,
            messages=messages,  # type: ignore[arg-type]
            tools=[{"name": t, "description": t, "input_schema": schemas[t]} for t in tools],  # type: ignore[misc]
        )
        blocks = [
            b.model_dump(exclude_none=True, exclude={"citations", "caller"}) for b in reply.content
        ]
        calls = [b.id for b in reply.content if b.type == "tool_use"]
        return ("assistant", {"role": "assistant", "content": blocks}), calls


class ChatTalker:
    def __init__(self, h: Harness, sid: str) -> None:
        self.client = openai_client(h, sid)

    async def ask(self, system: str, tools: list[str], history: list[Any]) -> tuple[Any, list[Any]]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for entry in history:
            if entry[0] == "user":
                messages.append({"role": "user", "content": entry[1]})
            elif entry[0] == "assistant":
                messages.append(entry[1])
            else:
                messages.append({"role": "tool", "tool_call_id": entry[1], "content": entry[2]})
        schemas = {"Bash": BASH_SCHEMA, "Agent": AGENT_SCHEMA}
        done = await self.client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=256,  # type: ignore[arg-type]
            tools=[
                {
                    "type": "function",
                    "function": {"name": t, "description": t, "parameters": schemas[t]},
                }
                for t in tools
            ],  # type: ignore[misc]
        )
        message = done.choices[0].message.model_dump(exclude_none=True)
        message.pop("reasoning_content", None)
        calls = [c["id"] for c in message.get("tool_calls", ())]
        return ("assistant", message), calls


async def agent_session(h: Harness, talker: Any) -> None:
    """Main line dispatches a subagent, takes its report, then restarts from a summary."""
    main, sub = "You are the main agent.", "You are a subagent. Report briefly."
    h.engine.push(
        tool_call_text("Agent", {"prompt": "Investigate module alpha"}),
        "alpha is fine",
        "Both checked. Done.",
        "Summary: alpha is fine.",
        "Continuing from the summary. Done.",
    )
    history: list[Any] = [("user", "Investigate alpha")]
    reply, calls = await talker.ask(main, ["Bash", "Agent"], history)
    report, _ = await talker.ask(sub, ["Bash"], [("user", "Investigate module alpha")])
    history += [
        reply,
        (
            "tool",
            calls[0],
            report[1]["content"]
            if isinstance(report[1]["content"], str)
            else report[1]["content"][0]["text"],
        ),
    ]
    reply, _ = await talker.ask(main, ["Bash", "Agent"], history)
    history += [reply, ("user", "Summarize the conversation so far.")]
    await talker.ask(main, ["Bash", "Agent"], history)
    await talker.ask(main, ["Bash", "Agent"], [("user", "This session continues from a summary.")])


async def test_subagent_and_compaction_split_alike(tokenizer: Any, sqlite_url: str) -> None:
    from tests.server.conftest import make_harness

    seen = {}
    for name, talker in (("anthropic", AnthropicTalker), ("openai-chat", ChatTalker)):
        h = await make_harness(tokenizer, sqlite_url)
        try:
            sid = await h.open_session(instance_id="repo-1")
            await agent_session(h, talker(h, sid))
            decisions = [(d.action, d.reason) for d in await h.payloads(sid, ev.ChainDecision)]  # type: ignore[attr-defined]
            status, closed = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
            assert status == 200, closed
            kinds = sorted(s["metadata"]["segment_kind"] for s in closed["samples"])
            seen[name] = (decisions, kinds, [s["tokens"] for s in closed["samples"]])
        finally:
            await h.close()
    decisions, kinds, _ = seen["anthropic"]
    assert ("new", "subagent") in decisions and ("new", "compaction") in decisions
    assert "subagent" in kinds
    assert seen["openai-chat"] == seen["anthropic"]


# --------------------------------------------------------------------------
# The shared guarantees, in each OpenAI dialect
# --------------------------------------------------------------------------

OPENAI_PATHS = {"openai-chat": "/v1/chat/completions", "openai-responses": "/v1/responses"}


def openai_body(dialect: str, text: str, **kw: Any) -> dict[str, Any]:
    if dialect == "openai-chat":
        return {"model": "m", "messages": [{"role": "user", "content": text}], **kw}
    return {"model": "m", "input": text, **kw}


@pytest.mark.parametrize("dialect", list(OPENAI_PATHS))
async def test_disconnect_mid_stream_aborts_the_engine(
    tokenizer: Any, sqlite_url: str, dialect: str
) -> None:
    import asyncio

    from tests.server.conftest import make_harness

    h = await make_harness(tokenizer, sqlite_url, engine_kwargs={"token_delay_s": 0.05})
    try:
        sid = await h.open_session()
        h.engine.push(" ".join(["word"] * 200))
        assert h.http is not None
        resp = await h.http.post(
            h.url + OPENAI_PATHS[dialect],
            json=openai_body(dialect, "talk a lot", stream=True),
            headers={"Authorization": f"Bearer {sid}"},
        )
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the opening frame
        while not h.engine.core.running:
            await asyncio.sleep(0.01)
        resp.close()
        for _ in range(200):
            if await h.payloads(sid, ev.ClientDisconnected):
                break
            await asyncio.sleep(0.05)
        (gone,) = await h.payloads(sid, ev.ClientDisconnected)
        (attempt,) = await h.payloads(sid, ev.GenerateAttempt)
        assert gone.rid == attempt.rid  # type: ignore[attr-defined]
        assert attempt.rid in h.engine.aborts  # type: ignore[attr-defined]
    finally:
        await h.close()


@pytest.mark.parametrize("dialect", list(OPENAI_PATHS))
async def test_abort_resume_and_engine_errors(harness: Harness, dialect: str) -> None:
    """A paused engine is resumed (one turn, two attempts); an engine error mid-stream is the
    dialect's error, and the session goes on."""
    from tools.test_engine import Fault

    h = harness
    sid = await h.open_session()
    client = openai_client(h, sid)
    h.engine.push("one two three four five six seven eight")
    h.engine.inject(Fault(pause_after=3))
    if dialect == "openai-chat":
        done = await client.chat.completions.create(**openai_body(dialect, "count"))
        assert done.choices[0].message.content == "one two three four five six seven eight"
    else:
        done = await client.responses.create(**openai_body(dialect, "count"))
        assert done.output_text == "one two three four five six seven eight"
    assert len(await h.payloads(sid, ev.TurnResumed)) == 1
    assert trained(await samples_of(h, sid)) == await engine_outputs(h, sid)

    sid = await h.open_session()
    client = openai_client(h, sid)
    h.engine.inject(Fault(logprobs="missing", delay_s=0.3))
    with pytest.raises(openai.APIError) as info:
        if dialect == "openai-chat":
            async for _ in await client.chat.completions.create(
                **openai_body(dialect, "hi", stream=True)
            ):
                pass
        else:
            async for _ in await client.responses.create(**openai_body(dialect, "hi", stream=True)):
                pass
    assert "logprobs" in info.value.message
    (failed,) = await h.payloads(sid, ev.TurnFailed)
    assert failed.reason.startswith("missing_logprobs")  # type: ignore[attr-defined]


async def test_a_session_may_switch_dialects_and_stay_on_its_chain(harness: Harness) -> None:
    """The translation is one, so a Chat Completions echo of a Messages answer extends it."""
    h = harness
    sid = await h.open_session()
    h.engine.push(SCRIPT[0], "Done.")
    first = await h.client(sid).messages.create(
        model="m", system=SYSTEM, max_tokens=256, tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "What is in this repo?"}],
    )  # fmt: skip
    call = next(b for b in first.content if b.type == "tool_use")
    text = "".join(b.text for b in first.content if b.type == "text")
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is in this repo?"},
        {
            "role": "assistant",
            "content": text,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "Bash", "arguments": json.dumps(call.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "a.txt"},
    ]
    await openai_client(h, sid).chat.completions.create(
        model="m",
        messages=messages,
        tools=CHAT_TOOLS,  # type: ignore[arg-type]
    )
    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [(d.action, d.reason) for d in decisions] == [("new", "first"), ("extend", "extends")]  # type: ignore[attr-defined]
    requests = await h.payloads(sid, ev.MessagesRequest)
    assert [r.dialect for r in requests] == ["anthropic", "openai-chat"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_chat_logprobs_are_the_engines(harness: Harness, stream: bool) -> None:
    h = harness
    sid = await h.open_session()
    h.engine.push("Hello there, world.")
    client = openai_client(h, sid)
    body = openai_body("openai-chat", "hi", logprobs=True)
    if stream:
        got = []
        async for chunk in await client.chat.completions.create(stream=True, **body):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    got.extend(choice.logprobs.content or [])
    else:
        done = await client.chat.completions.create(**body)
        assert done.choices[0].logprobs is not None
        got = done.choices[0].logprobs.content or []
    (result,) = await h.payloads(sid, ev.GenerateResult)
    engine = await h.array(result.logprobs)  # type: ignore[attr-defined]
    assert [g.logprob for g in got] == engine[: len(got)]
    assert len(got) == len(engine) - 1  # the EOS that ended the answer is not text
    assert "".join(g.token for g in got) == "Hello there, world."
    plain = await client.chat.completions.create(**openai_body("openai-chat", "hi"))
    assert plain.choices[0].logprobs is None


async def test_reasoning_comes_back_in_each_openai_dialect(harness: Harness) -> None:
    h = harness
    sid = await h.open_session()
    client = openai_client(h, sid)
    think = "<think>\nThe user greets me.\n</think>\n\nHello!"
    h.engine.push(think, think)
    chat = await client.chat.completions.create(**openai_body("openai-chat", "hi"))
    message = chat.choices[0].message
    assert message.content == "Hello!"
    assert (message.model_extra or {})["reasoning_content"] == "The user greets me."
    response = await client.responses.create(**openai_body("openai-responses", "hi"))
    kinds = [o.type for o in response.output]
    assert kinds == ["reasoning", "message"]
    assert response.output[0].summary[0].text == "The user greets me."  # type: ignore[union-attr]
    assert response.output_text == "Hello!"


async def test_models_list_reads_in_the_openai_sdk(harness: Harness) -> None:
    sid = await harness.open_session()
    models = await openai_client(harness, sid).models.list()
    (model,) = models.data
    assert model.object == "model" and model.owned_by == "trajectory-recorder"


async def test_chat_parse_through_the_session_caches_equals_a_fresh_parse() -> None:
    from recorder.dialects import OPENAI_CHAT
    from recorder.dialects.parse_cache import ParseCache

    cache = ParseCache()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "What is in this repo?"},
    ]
    for turn in range(4):
        body = json.dumps({"model": "m", "messages": messages, "tools": CHAT_TOOLS}).encode()
        cached, _ = await OPENAI_CHAT.parse(body, cache=cache)
        fresh, _ = await OPENAI_CHAT.parse(body)
        assert cached == fresh
        call = {"id": f"c{turn}", "type": "function",
                "function": {"name": "Bash", "arguments": json.dumps({"command": "ls"})}}  # fmt: skip
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{turn}", "content": "a.txt"},
            {"role": "system", "content": "A reminder mid-conversation."},
        ]
    bad = json.dumps({"model": "m", "messages": [*messages, {"role": "tool", "tool_call_id": "zz",
                                                              "content": "x"}]}).encode()  # fmt: skip
    with pytest.raises(InvalidRequest) as info:
        await OPENAI_CHAT.parse(bad, cache=cache)
    assert info.value.field == f"messages.{len(messages)}"


async def test_responses_parse_through_the_session_caches_equals_a_fresh_parse() -> None:
    from recorder.dialects import OPENAI_RESPONSES
    from recorder.dialects.anthropic_wire import Message
    from recorder.dialects.parse_cache import ParseCache

    earlier = [Message(role="user", content="Earlier question"),
               Message(role="assistant", content="Earlier answer")]  # fmt: skip

    async def history(response_id: str) -> list[Message]:
        assert response_id == "resp_1"
        return earlier

    cache = ParseCache()
    items: list[dict[str, Any]] = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is in this repo?"}]},
    ]
    for turn in range(4):
        for previous in (None, "resp_1"):
            body = json.dumps({"model": "m", "instructions": SYSTEM, "input": items,
                               "tools": RESPONSES_TOOLS,
                               "previous_response_id": previous}).encode()  # fmt: skip
            cached, _ = await OPENAI_RESPONSES.parse(body, cache=cache, history=history)
            fresh, _ = await OPENAI_RESPONSES.parse(body, history=history)
            assert cached == fresh
        items += [
            {"type": "reasoning", "id": f"r{turn}", "summary": []},
            {"type": "function_call", "call_id": f"c{turn}", "name": "Bash",
             "arguments": json.dumps({"command": "ls"})},
            {"type": "function_call_output", "call_id": f"c{turn}", "output": "a.txt"},
            {"role": "system", "content": "A reminder mid-conversation."},
        ]  # fmt: skip
    plain = json.dumps({"model": "m", "input": "just text"}).encode()
    assert (await OPENAI_RESPONSES.parse(plain, cache=cache))[0] == (
        await OPENAI_RESPONSES.parse(plain)
    )[0]
    bad = json.dumps({"model": "m", "input": [*items, {"type": "function_call_output",
                                                       "call_id": "zz", "output": 3}]}).encode()  # fmt: skip
    with pytest.raises(InvalidRequest) as info:
        await OPENAI_RESPONSES.parse(bad, cache=cache)
    assert info.value.field.startswith(f"input.{len(items)}"), info.value.field
