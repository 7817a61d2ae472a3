"""The real Claude Code CLI as the client: a tool-using turn pair, recorded and reduced."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from recorder.log import events as ev
from tests.conftest import claude_code_binary
from tests.server.conftest import make_harness, tool_call_text

pytestmark = pytest.mark.claude


async def test_claude_code_tool_use_round_trip(
    tokenizer: Any, sqlite_url: str, tmp_path: Path
) -> None:
    claude = claude_code_binary()
    h = await make_harness(
        tokenizer, sqlite_url, context_length=200_000, engine_kwargs={"context_length": 200_000}
    )
    try:
        h.engine.push(
            tool_call_text(
                "Bash",
                {"command": "echo recorder-smoke", "description": "print a marker"},
                preface="I will run a command.\n",
            ),
            "The command printed recorder-smoke. Done.",
        )
        sid = await h.open_session(instance_id="claude-smoke")
        home = tmp_path / "home"
        home.mkdir()
        env = {
            **os.environ,
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": h.url,
            "ANTHROPIC_AUTH_TOKEN": sid,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
        }
        env.pop("ANTHROPIC_API_KEY", None)
        proc = await asyncio.create_subprocess_exec(
            claude, "-p", "Run the echo command", "--allowedTools", "Bash",
            "--output-format", "stream-json", "--verbose",
            cwd=tmp_path, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=180)
        lines = [json.loads(x) for x in out.decode().splitlines() if x.startswith("{")]
        assert proc.returncode == 0, out.decode()[-2000:]
        result = lines[-1]
        assert result["type"] == "result" and not result["is_error"], result
        assert "recorder-smoke" in result["result"]

        requests = await h.payloads(sid, ev.MessagesRequest)
        assert len(requests) == 2 and all(r.stream for r in requests)
        decisions = await h.payloads(sid, ev.ChainDecision)
        assert [(d.action, d.reason) for d in decisions] == [
            ("new", "first"),
            ("extend", "extends"),
        ]
        rendered = await h.payloads(sid, ev.RenderedInput)
        assert rendered[1].input_ids.length - rendered[1].prefix_len < 100  # only the tool result
        sent = await h.payloads(sid, ev.ResponseSent)
        assert [s.stop_reason for s in sent] == ["tool_use", "end_turn"]
        assert requests[1].tool_result_ids == (sent[0].content[-1]["id"],)
        body = bytes(await h.array(requests[0].body))  # type: ignore[arg-type]
        assert b"x-anthropic-billing-header" in body  # kept whole in the log...
        status, data = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
        assert status == 200 and not data["placeholder"]
        (sample,) = data["samples"]
        results = await h.payloads(sid, ev.GenerateResult)
        emitted = sum(r.output_ids.length for r in results)  # type: ignore[union-attr]
        assert sum(sample["loss_mask"]) == emitted  # every model token trainable, nothing else
    finally:
        await h.close()
