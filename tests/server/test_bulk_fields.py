"""A body's memory is bounded whatever field holds its bulk (issue 24, item 4).

The early length check once counted only user, tool-result and system text:
8 MB of assistant text, thinking, tool input, tool descriptions or OpenAI
history was rendered and tokenized whole before its 400 (~50x the body in
RSS, seconds of CPU). Each field kind is sent, 8 MB of it, to a fresh
`recorder serve` process (`tools/benchkit/bulk.py`: the kernel's own peak
RSS of that process, reset just before the body is sent); it must be
refused in its dialect's shape with how long it is, within `MAX_PEAK` times
the body. A body that fits is answered with the ids of the whole render.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import pytest

from recorder.dialects import dialect_named
from recorder.log import events as ev
from recorder.model.tokenizer import Tokenizer
from recorder.model.tokens import full_input_ids
from tests.server.conftest import Harness, make_harness
from tools.benchkit.bodies import ANTHROPIC, CHAT, KINDS, bulk_body
from tools.benchkit.bulk import measure
from tools.benchkit.engine import start_test_engine

CONTEXT = 8192
BODY_CHARS = 8 << 20
# Peak RSS the server may gain per byte of body. What stays: the body, its
# decoded text, the template's render (a template joins strings: one more
# copy while it renders); before issue 24 an 8 MB assistant text cost ~50x.
MAX_PEAK = 4.0
# What the process allocates meanwhile for anything but the body (a log record, a
# timer, SQLite's page cache): a few pages. Four 8 MB copies hit the bound exactly,
# so 3 kB of that churn failed a run at 4.0004x without a fifth copy.
CHURN_BYTES = 256 << 10
DIALECT_OF = {ANTHROPIC: "anthropic", CHAT: "openai-chat"}


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    proc, url = start_test_engine(CONTEXT)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("kind", KINDS)
def test_a_body_too_long_in_any_field_is_refused_within_bounded_memory(
    engine_url: str, kind: str
) -> None:
    [m] = asyncio.run(measure(engine_url, CONTEXT, [(kind, BODY_CHARS)]))
    print(f"\n{kind}: {m.status} in {m.seconds:.2f} s, peak +{m.peak_bytes / 2**20:.0f} MB")
    assert m.status == 400, m.message
    body = json.loads(m.message) if m.message.endswith("}") else {"error": {"message": m.message}}
    if bulk_body(kind, 0)[0] == ANTHROPIC:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    assert "prompt is too long: at least" in body["error"]["message"], body
    assert m.peak_bytes <= MAX_PEAK * m.body_bytes + CHURN_BYTES, (
        f"{kind}: peak RSS +{m.peak_bytes / 2**20:.0f} MB for a "
        f"{m.body_bytes / 2**20:.0f} MB body ({m.peak_bytes / m.body_bytes:.1f}x)"
    )


@pytest.fixture
async def wide_harness(tokenizer: Tokenizer, sqlite_url: str) -> AsyncIterator[Harness]:
    h = await make_harness(
        tokenizer,
        sqlite_url,
        context_length=1_000_000,
        engine_kwargs={"context_length": 1_000_000},
    )
    try:
        yield h
    finally:
        await h.close()


@pytest.mark.parametrize("kind", ["assistant text", "tool_use input", "chat assistant"])
async def test_a_long_body_that_fits_is_answered_token_exact(
    wide_harness: Harness, tokenizer: Tokenizer, kind: str
) -> None:
    """~230k tokens in one field, tokenized in pieces: the engine gets the whole render's ids."""
    h = wide_harness
    assert h.http is not None
    route, raw = bulk_body(kind, 1 << 20)
    sid = await h.open_session()
    headers = {"Authorization": f"Bearer {sid}", "Content-Type": "application/json"}
    async with h.http.post(h.url + route, data=raw, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    [rendered] = [r for r in await h.payloads(sid, ev.RenderedInput)]
    chat, _ = await dialect_named(DIALECT_OF[route]).parse(raw)
    expected = full_input_ids(chat, tokenizer)
    assert len(expected) > 200_000
    assert list(await h.array(rendered.input_ids)) == expected  # type: ignore[attr-defined]
