"""What a request asks for shapes the answer: tools, thinking, output format, images, logprobs.

Each case is the real API's behaviour (no tool call without tools, no thinking
block unless thinking was enabled, a JSON schema followed or refused), end to
end through the recorder and on both store backends.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from recorder.log import events as ev
from tests.server.conftest import SYSTEM, TOOLS, Harness, tool_call_text
from tools.claude_traffic import tiny_png
from tools.test_engine.scripted import Reply


async def _post(h: Harness, sid: str, **body: Any) -> tuple[int, dict[str, Any]]:
    assert h.http is not None
    full = {"model": "m", "max_tokens": 200, "system": SYSTEM, **body}
    async with h.http.post(
        h.url + "/v1/messages", json=full, headers={"Authorization": f"Bearer {sid}"}
    ) as resp:
        return resp.status, await resp.json()


async def test_no_tools_means_no_tool_calls(any_harness: Harness) -> None:
    h = any_harness
    sid = await h.open_session()
    call = tool_call_text("Bash", {"command": "ls"}, preface="Plan:\n")
    h.engine.push(call, call, call)
    messages = [{"role": "user", "content": "go"}]
    for tools in ([], None):
        extra = {} if tools is None else {"tools": tools}
        status, data = await _post(h, sid, messages=messages, **extra)
        assert status == 200, data
        assert data["stop_reason"] == "end_turn"
        assert data["content"] == [{"type": "text", "text": call}]
    status, data = await _post(h, sid, messages=messages, tools=TOOLS, tool_choice={"type": "none"})
    assert status == 200 and data["content"] == [{"type": "text", "text": call}]
    assert len(h.engine.requests) == 3


async def test_thinking_only_when_asked_and_recorded_either_way(any_harness: Harness) -> None:
    h = any_harness
    sid = await h.open_session()
    h.engine.push(*["<think>\nweigh it\n</think>\n\nAnswer."] * 3)
    messages = [{"role": "user", "content": "q"}]
    _, plain = await _post(h, sid, messages=messages)
    _, disabled = await _post(h, sid, messages=messages, thinking={"type": "disabled"})
    _, adaptive = await _post(h, sid, messages=messages, thinking={"type": "adaptive"})
    assert [b["type"] for b in plain["content"]] == ["text"]
    assert [b["type"] for b in disabled["content"]] == ["text"]
    assert [b["type"] for b in adaptive["content"]] == ["thinking", "text"]
    sent = await h.payloads(sid, ev.ResponseSent)
    assert [s.reasoning for s in sent] == ["weigh it", "weigh it", ""]  # type: ignore[union-attr]


async def test_output_format_reaches_the_engine_as_json_schema(any_harness: Harness) -> None:
    """Claude Code 2.1.197's title request: honoured by SGLang's constrained decoding."""
    h = any_harness
    sid = await h.open_session()
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    h.engine.push('{"title": "Fix the greeting"}')
    status, data = await _post(
        h,
        sid,
        messages=[{"role": "user", "content": "title this"}],
        output_config={"effort": "high", "format": {"type": "json_schema", "schema": schema}},
        thinking={"type": "disabled"},
    )
    assert status == 200, data
    assert json.loads(h.engine.requests[-1].json_schema or "null") == schema
    status, data = await _post(
        h, sid, messages=[{"role": "user", "content": "x"}], output_format={"type": "grammar"}
    )
    assert status == 400 and "output_format.type" in data["error"]["message"]


async def test_an_image_is_served_as_a_placeholder(any_harness: Harness) -> None:
    import base64

    h = any_harness
    sid = await h.open_session()
    h.engine.push("A red square.")
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(tiny_png())}
    image = {"type": "image", "source": {**source, "data": source["data"].decode()}}
    status, data = await _post(
        h, sid, messages=[{"role": "user", "content": [{"type": "text", "text": "What?"}, image]}]
    )
    assert status == 200, data
    (rendered,) = await h.payloads(sid, ev.RenderedInput)
    text = h.tokenizer.decode(await h.array(rendered.input_ids))  # type: ignore[arg-type,union-attr]
    assert "What?\n\n[image: image/png, " in text and "the model reads text only]" in text


async def test_logprobs_are_stored_as_the_engine_sent_them(any_harness: Harness) -> None:
    h = any_harness
    sid = await h.open_session()
    ids = [*h.tokenizer.encode("Exact."), h.tokenizer.eos_token_ids[0]]
    logprobs = [-0.1234567890123456 - i * 1e-12 for i in range(len(ids))]
    assert np.asarray(logprobs, np.float32).astype(np.float64).tolist() != logprobs
    h.engine.push(Reply(ids=ids, logprobs=logprobs))
    status, _ = await _post(h, sid, messages=[{"role": "user", "content": "q"}])
    assert status == 200
    (result,) = await h.payloads(sid, ev.GenerateResult)
    assert result.logprobs is not None and result.logprobs.dtype == "float64"  # type: ignore[union-attr]
    assert await h.array(result.logprobs) == logprobs  # type: ignore[union-attr]
    status, data = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    (sample,) = data["samples"]
    trained = zip(sample["rollout_logprobs"], sample["loss_mask"], strict=True)
    assert [lp for lp, m in trained if m] == logprobs
