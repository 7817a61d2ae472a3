"""Real Claude Code request bodies through translation and token chains.

A scripted stand-in for the Anthropic API (SSE, as Claude Code expects)
captures every body the CLI sends while it dispatches one subagent; the bodies
then drive parse_request / plan_turn / commit_turn exactly as the server would.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web

from recorder.dialects.anthropic_wire import ContentBlock
from recorder.dialects.chat import find_dispatches
from recorder.dialects.translate import assistant_message, parse_request, response_message_digest
from recorder.model.tokenizer import Tokenizer
from recorder.model.tokens import SessionChains, commit_turn, note_dispatch, plan_turn
from tests.conftest import claude_code_binary

pytestmark = pytest.mark.claude


class _ScriptedAnthropic:
    """Main line: dispatch an Agent, then finish. Subagent: one Bash call, then answer."""

    def __init__(self) -> None:
        self.captured: list[tuple[bytes, list[dict[str, Any]]]] = []
        self.main_system: str | None = None

    def answer(self, req: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
        if not req.get("tools"):
            return [{"type": "text", "text": "Side answer."}], "end_turn"
        system = json.dumps(req.get("system", [])[1:])  # without the billing header
        self.main_system = self.main_system or system
        answered = any(
            isinstance(m["content"], list)
            and any(b.get("type") == "tool_result" for b in m["content"])
            for m in req["messages"]
        )
        if system == self.main_system and not answered:
            return [
                {"type": "thinking", "thinking": "Delegate it.", "signature": "c2ln"},
                {"type": "text", "text": "Delegating."},
                {
                    "type": "tool_use",
                    "id": "toolu_agent1",
                    "name": "Agent",
                    "input": {
                        "description": "Say hi",
                        "prompt": "Run echo hi and report the output.",
                        "subagent_type": "general-purpose",
                    },
                },
            ], "tool_use"
        if system == self.main_system:
            return [{"type": "text", "text": "Done: the subagent says hi."}], "end_turn"
        if not answered:
            return [
                {
                    "type": "tool_use",
                    "id": "toolu_sub1",
                    "name": "Bash",
                    "input": {"command": "echo hi", "description": "Say hi"},
                }
            ], "tool_use"
        return [{"type": "text", "text": "The output was hi."}], "end_turn"

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        req = json.loads(body)
        content, stop = self.answer(req)
        self.captured.append((body, content))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for event in _sse_events(content, stop, req.get("model", "")):
            await resp.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
        await resp.write_eof()
        return resp


def _sse_events(content: list[dict[str, Any]], stop: str, model: str) -> list[dict[str, Any]]:
    usage = {"input_tokens": 10, "output_tokens": 0}
    events: list[dict[str, Any]] = [
        {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage,
            },
        }
    ]
    for i, block in enumerate(content):
        if block["type"] == "text":
            start, deltas = (
                {"type": "text", "text": ""},
                [{"type": "text_delta", "text": block["text"]}],
            )
        elif block["type"] == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]},
            ]
        else:
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
        events.append({"type": "content_block_start", "index": i, "content_block": start})
        events += [{"type": "content_block_delta", "index": i, "delta": d} for d in deltas]
        events.append({"type": "content_block_stop", "index": i})
    events.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop, "stop_sequence": None},
            "usage": {"output_tokens": 5},
        }
    )
    events.append({"type": "message_stop"})
    return events


async def _empty(_: web.Request) -> web.Response:
    return web.json_response({})


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[_ScriptedAnthropic, str]]:
    api = _ScriptedAnthropic()
    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/messages", api.messages)
    app.router.add_route("*", "/{tail:.*}", _empty)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield api, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def _run_claude(binary: str, base_url: str, home: Path) -> None:
    env = {
        **os.environ,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": "session-d1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTO_COMPACT": "1",
    }
    proc = await asyncio.create_subprocess_exec(
        binary,
        "-p",
        "Use a subagent to run echo hi",
        "--output-format",
        "stream-json",
        "--verbose",
        "--allowedTools",
        "Bash(echo:*)",
        "Agent",
        cwd=home,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode == 0, (out[-2000:], err[-2000:])


def _model_output(tok: Tokenizer, content: list[dict[str, Any]]) -> list[int]:
    """Ids a model would have emitted for `content` (the template's rendering, up to EOS)."""
    message = assistant_message(msgspec.convert(content, list[ContentBlock]))
    head = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    start = tok.render(head, None, True)
    return tok.encode(tok.render([*head, message], None, False)[len(start) :].rstrip("\n"))


async def test_claude_code_subagent_session_chains(
    scripted: tuple[_ScriptedAnthropic, str], tok: Tokenizer, tmp_path: Path
) -> None:
    binary = claude_code_binary()
    api, base_url = scripted
    await _run_claude(binary, base_url, tmp_path)
    main_line = [(b, c) for b, c in api.captured if json.loads(b).get("tools")]
    assert len(main_line) == 4, [json.loads(b)["system"][1]["text"][:60] for b, _ in main_line]

    chains, plans = SessionChains(), []
    for body, content in main_line:
        req = parse_request(body)
        plan = plan_turn(chains, req, tok)
        plans.append(plan)
        commit_turn(chains, plan, _model_output(tok, content), response_message_digest(content))
        found = find_dispatches(content)
        note_dispatch(chains, [i for i, _ in found], [p for _, p in found])

    main, sub_start, sub_next, main_back = plans
    assert (main.action, main.reason) == ("new", "first")
    assert (sub_start.action, sub_start.reason) == ("new", "subagent")
    assert sub_start.dispatch_tool_use_id == "toolu_agent1"
    assert (sub_next.action, sub_next.chain_id) == ("extend", sub_start.chain_id)
    assert (main_back.action, main_back.chain_id) == ("extend", main.chain_id)
    assert main_back.returned_dispatch_ids == ("toolu_agent1",)
    assert main_back.new_tokens < len(main_back.input_ids) // 10
    assert chains.pending_dispatches == []
    bodies = [json.loads(b) for b, _ in main_line]
    assert bodies[0]["system"][0]["text"].startswith("x-anthropic-billing-header")
