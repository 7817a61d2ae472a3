"""The tiny real model (SmolLM2-135M GGUF on CPU) behind the SGLang /generate protocol."""

from __future__ import annotations

import math

import pytest

from recorder.model.engine import EngineClient
from recorder.model.engine_wire import SamplingParams, new_rid
from recorder.model.resume import generate_with_resume
from recorder.model.tokenizer import load_tokenizer
from tools.test_engine import Fault

from .conftest import FIXTURE_TOKENIZER, smollm2_gguf_or_skip

pytestmark = pytest.mark.tiny

PROMPTS = [
    "Write a haiku about the sea.",
    "Give me a random word.",
    "Say hello in French.",
    "Tell me a fact about cats.",
    "List three prime numbers.",
    "Write one line of JSON.",
]


@pytest.fixture(scope="module")
def tiny():
    gguf = smollm2_gguf_or_skip()
    from tools.test_engine.tiny import start_tiny_engine

    engine = start_tiny_engine(gguf=gguf, tokenizer_path=str(FIXTURE_TOKENIZER), seed=1234)
    yield engine
    engine.stop()


def _prompt(tokenizer, text: str) -> list[int]:
    """The model's own chat template (plain ChatML with its default system prompt)."""
    own = load_tokenizer(str(FIXTURE_TOKENIZER))
    return own.encode(own.render([{"role": "user", "content": text}]))


async def test_real_sampling_has_a_logprob_per_token(tiny, tokenizer) -> None:
    async with EngineClient([tiny.url]) as client:
        out = await client.generate(
            tiny.url, _prompt(tokenizer, PROMPTS[0]), SamplingParams(max_new_tokens=16), new_rid()
        )
        assert out.logprobs is not None and len(out.logprobs) == len(out.output_ids) > 0
        assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs)
        assert len(set(out.logprobs)) > 1
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            assert out.output_ids[-1] in tokenizer.eos_token_ids
        # Greedy decoding is deterministic and stops on EOS.
        greedy = SamplingParams(max_new_tokens=48, temperature=0)
        prompt = _prompt(tokenizer, "What is 2+2?")
        a = await client.generate(tiny.url, prompt, greedy, new_rid())
        b = await client.generate(tiny.url, prompt, greedy, new_rid())
        assert a.output_ids == b.output_ids
        assert a.finish_reason == "stop" and a.output_ids[-1] == 2
        assert b.cached_tokens >= len(prompt)


async def test_decode_reencode_mismatch_happens(tiny, tokenizer) -> None:
    """DESIGN.md: about 1 sample in 10 at temperature 1 does not survive decode -> encode."""
    async with EngineClient([tiny.url]) as client:
        for i in range(40):
            prompt = _prompt(tokenizer, PROMPTS[i % len(PROMPTS)])
            out = await client.generate(
                tiny.url, prompt, SamplingParams(max_new_tokens=24), new_rid()
            )
            if tokenizer.encode(tokenizer.decode(out.output_ids)) != out.output_ids:
                return
    pytest.fail("no decode->re-encode mismatch in 40 samples at temperature 1")


async def test_resume_after_weight_update_pause(tiny, tokenizer) -> None:
    prompt = _prompt(tokenizer, "Count from one to ten in words.")
    params = SamplingParams(max_new_tokens=24, temperature=0)
    tiny.call(tiny.core.inject, Fault(pause_after=3, pause_s=0.01))
    calls: list[str] = []

    async def on_attempt(attempt) -> None:
        calls.append("attempt")

    async def on_result(attempt, out) -> None:
        calls.append(out.finish_reason)

    async with EngineClient([tiny.url]) as client:
        turn = await generate_with_resume(
            client, tiny.url, prompt, params, on_attempt=on_attempt, on_result=on_result
        )
        ref = await client.generate(tiny.url, prompt, params, new_rid())
    assert calls[:2] == ["attempt", "abort"] and len(turn.attempts) >= 2
    assert turn.output_ids[:3] == ref.output_ids[:3]
    assert len(turn.output_ids) == len(turn.logprobs) == len(turn.weight_versions)
    assert turn.weight_versions[0] != turn.weight_versions[-1]
