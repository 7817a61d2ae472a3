"""The real tiny model (SmolLM2-135M on CPU) behind the recorder, at temperature 1.

What the log says each turn's engine input and output were must be exactly
what the engine received and returned (ids and logprobs), chains must carry
the model's raw tokens even where decode -> re-encode disagrees, and such
turns must be recorded as TITO failures.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from recorder.log import events as ev
from recorder.model.engine_wire import GenerateOutput
from recorder.model.parsers import make_parser
from tests.conftest import smollm2_gguf
from tests.server.conftest import FIXTURE_TOKENIZER, make_harness

pytestmark = pytest.mark.tiny

PROMPTS = [
    "Write a haiku about the sea.",
    "Give me a random word.",
    "Tell me a fact about cats.",
    "List three prime numbers.",
    "Say something in French.",
    "Describe a sunset in one sentence.",
]
MAX_TURNS = 36


@pytest.fixture(scope="module")
def tiny() -> Iterator[Any]:
    gguf = smollm2_gguf()
    from tools.test_engine.tiny import start_tiny_engine

    engine = start_tiny_engine(gguf=gguf, tokenizer_path=str(FIXTURE_TOKENIZER), seed=20261122)
    yield engine
    engine.stop()


async def test_recorded_tokens_are_what_the_engine_saw(
    tiny: Any, tokenizer: Any, sqlite_url: str
) -> None:
    h = await make_harness(
        tokenizer, sqlite_url, engine_urls=[tiny.url], parser=make_parser(None, None, "builtin")
    )
    returned: dict[str, GenerateOutput] = {}
    generate = h.ctx.engine.generate

    async def spy(url: str, input_ids: Any, params: Any, rid: str, **kw: Any) -> GenerateOutput:
        out = await generate(url, input_ids, params, rid, **kw)
        returned[rid] = out
        return out

    h.ctx.engine.generate = spy  # type: ignore[method-assign]
    try:
        sessions: list[str] = []
        turns = 0
        tito_failures = 0
        while turns < MAX_TURNS and (tito_failures == 0 or turns < 12):
            sid = await h.open_session()
            sessions.append(sid)
            client = h.client(sid)
            messages: list[dict[str, Any]] = []
            for k in range(3):
                prompt = PROMPTS[(len(sessions) + k) % len(PROMPTS)]
                messages.append({"role": "user", "content": prompt})
                answer = await client.messages.create(
                    model="smollm2",
                    max_tokens=20,
                    messages=messages,  # type: ignore[arg-type]
                    extra_body={"temperature": 1.0},
                )
                text = "".join(b.text for b in answer.content if b.type == "text")
                messages.append({"role": "assistant", "content": text or "..."})
                turns += 1
            verdicts = await h.payloads(sid, ev.TitoVerdict)
            tito_failures += sum(1 for v in verdicts if not v.ok)

        requests = {r.rid: r for r in tiny.core.requests}
        for sid in sessions:
            inputs: list[list[int]] = []
            outputs: list[list[int]] = []
            for e in await h.payloads(sid):
                if isinstance(e, ev.RenderedInput):
                    inputs.append(np.asarray(await h.array(e.input_ids)).tolist())
                elif isinstance(e, ev.GenerateResult):
                    engine_out = returned[e.rid]
                    ids = np.asarray(await h.array(e.output_ids)).tolist()
                    assert e.logprobs is not None
                    logprobs = await h.array(e.logprobs)
                    assert ids == engine_out.output_ids
                    assert logprobs == pytest.approx(engine_out.logprobs, abs=1e-6)
                    assert requests[e.rid].input_ids == inputs[-1]
                    outputs.append(ids)
                elif isinstance(e, ev.TitoVerdict):
                    out = outputs[-1]
                    assert e.ok == (tokenizer.encode(tokenizer.decode(out)) == out)
                    if not e.ok:
                        assert e.reencoded_ids is not None
                        assert await h.array(e.reencoded_ids) != out
            # The next turn's input starts with the model's raw tokens, even after a TITO failure.
            for i in range(1, len(inputs)):
                prefix = inputs[i - 1] + outputs[i - 1]
                assert inputs[i][: len(prefix)] == prefix
        assert tito_failures >= 1, f"no decode->re-encode mismatch in {turns} turns"
    finally:
        await h.close()
