"""Tool search through the server: a deferred tool is callable once a tool_reference loaded it.

The real API shows a `defer_loading` tool's schema to the model only where a
`tool_reference` loads it, and from then on the model may call it. The
recorder renders the schema at the reference (README, "tool search"); these
tests attack the other half: the answer's parser must accept the call, and
a session that loads a tool mid-way must stay one chain with every token trained.
"""

from __future__ import annotations

import json
from typing import Any

from recorder.log import events as ev
from recorder.model.parsers import make_parser
from recorder.model.tokenizer import Tokenizer
from tests.server.conftest import Harness, make_harness, tool_call_text
from tools.test_engine.scripted import Reply

SEARCH_TOOL = {
    "name": "ToolSearch",
    "description": "search tools",
    "input_schema": {
        "type": "object",
        "properties": {"query": {"type": "string"}},
        "required": ["query"],
    },
}
CRON_LIST = {
    "name": "CronList",
    "description": "List cron jobs",
    "input_schema": {"type": "object", "properties": {}},
    "defer_loading": True,
}
# The issue's engine answer, exactly (the hermes parser reads it; qwen25 wants newlines).
ISSUE_CALL = '<tool_call>{"name": "CronList", "arguments": {}}</tool_call>'
CALL_CRON = tool_call_text("CronList", {})
SEARCH_USE = {
    "type": "tool_use",
    "id": "toolu_x1",
    "name": "ToolSearch",
    "input": {"query": "select:CronList"},
}


def _issue_body(reference: bool) -> dict[str, Any]:
    """Issue 20's reproduction; without `reference`, the search found nothing."""
    found = [{"type": "tool_reference", "tool_name": "CronList"}] if reference else "no match"
    return {
        "model": "m",
        "max_tokens": 300,
        "tools": [SEARCH_TOOL, CRON_LIST],
        "messages": [
            {"role": "user", "content": "please find the cron tool"},
            {"role": "assistant", "content": [SEARCH_USE]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_x1", "content": found},
                    {"type": "text", "text": "now list crons"},
                ],
            },
        ],
    }


async def _post(h: Harness, sid: str, body: dict[str, Any]) -> dict[str, Any]:
    assert h.http is not None
    async with h.http.post(
        h.url + "/v1/messages", json=body, headers={"Authorization": f"Bearer {sid}"}
    ) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        return dict(data)


async def test_issue_reproduction_calls_the_loaded_deferred_tool(
    tokenizer: Tokenizer, store_url: str
) -> None:
    h = await make_harness(tokenizer, store_url, parser=make_parser("hermes", None, "builtin"))
    try:
        sid = await h.open_session()
        h.engine.push(ISSUE_CALL)
        answer = await _post(h, sid, _issue_body(reference=True))
        prompt = h.tokenizer.decode(h.engine.requests[-1].input_ids)
    finally:
        await h.close()
    assert answer["stop_reason"] == "tool_use"
    (use,) = [b for b in answer["content"] if b["type"] == "tool_use"]
    assert use["name"] == "CronList" and use["input"] == {}
    # What the model saw: CronList's schema inside the tool result, not in the tool list.
    head, _, rest = prompt.partition("please find the cron tool")
    assert '"name": "ToolSearch"' in head and '"name": "CronList"' not in head
    assert '<tools>\n{"type": "function", "function": {"name": "CronList"' in rest


async def test_a_deferred_tool_never_loaded_stays_uncallable(any_harness: Harness) -> None:
    """As the real API: no tool_reference, no call; the text comes back as text."""
    h = any_harness
    sid = await h.open_session()
    h.engine.push(CALL_CRON)
    answer = await _post(h, sid, _issue_body(reference=False))
    assert answer["stop_reason"] == "end_turn"
    assert [b["type"] for b in answer["content"]] == ["text"]
    assert '"name": "CronList"' in answer["content"][0]["text"]
    prompt = h.tokenizer.decode(h.engine.requests[-1].input_ids)
    assert "List cron jobs" not in prompt  # its schema reached the model nowhere


async def test_loading_a_tool_mid_session_keeps_one_chain_and_trains_every_token(
    any_harness: Harness,
) -> None:
    """Search, load, call, done: the client lists the tool once loaded (as Claude Code 2.1.330
    does); the loaded schema sits at the reference, so the prefix never changes."""
    h = any_harness
    sid = await h.open_session()
    h.engine.push(
        Reply(text=tool_call_text("ToolSearch", {"query": "cron"})),
        Reply(text="Loaded it.\n" + CALL_CRON),
        Reply(text="There are no cron jobs."),
    )
    searchless = [SEARCH_TOOL, {"name": "Placeholder", "input_schema": {}, "defer_loading": True}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "list my cron jobs"}]
    first = await _post(h, sid, {"model": "m", "max_tokens": 200, "tools": searchless,
                                 "messages": messages})  # fmt: skip
    (search,) = [b for b in first["content"] if b["type"] == "tool_use"]
    messages += [
        {"role": "assistant", "content": first["content"]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": search["id"],
                    "content": [{"type": "tool_reference", "tool_name": "CronList"}],
                }
            ],
        },
    ]
    loaded = [*searchless, CRON_LIST]
    second = await _post(h, sid, {"model": "m", "max_tokens": 200, "tools": loaded,
                                  "messages": messages})  # fmt: skip
    (cron,) = [b for b in second["content"] if b["type"] == "tool_use"]
    assert cron["name"] == "CronList" and second["stop_reason"] == "tool_use"
    messages += [
        {"role": "assistant", "content": second["content"]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": cron["id"], "content": "none"}],
        },
    ]
    third = await _post(h, sid, {"model": "m", "max_tokens": 200, "tools": loaded,
                                 "messages": messages})  # fmt: skip
    assert third["content"][0]["text"] == "There are no cron jobs."

    decisions = await h.payloads(sid, ev.ChainDecision)
    assert [d.action for d in decisions] == ["new", "extend", "extend"]  # type: ignore[attr-defined]
    results = await h.payloads(sid, ev.GenerateResult)
    engine_tokens = sum(r.output_ids.length for r in results)  # type: ignore[attr-defined]
    status, closed = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    assert status == 200, closed
    assert [s["kind"] for s in closed["segments"]] == ["final"]
    assert sum(sum(s["loss_mask"]) for s in closed["samples"]) == engine_tokens > 0
    assert not any(s.get("dropped") for s in closed["segments"])
    # The loaded schema is at the reference in the last engine input, once.
    last = h.tokenizer.decode(h.engine.requests[-1].input_ids)
    assert last.count('"name": "CronList", "description"') == 1
    assert json.dumps(CRON_LIST["description"]) in last
