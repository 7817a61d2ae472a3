"""The scripted test engine: SGLang's /generate subset, controls, script, CLI."""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path

import aiohttp
import pytest

from recorder.model.engine import EngineClient
from recorder.model.engine_wire import SamplingParams, new_rid
from tools.test_engine import (
    EngineCore,
    Fault,
    Reply,
    ScriptedBackend,
    ScriptedEngine,
    ThreadedEngine,
    hashed_logprob,
    load_script,
    start_subprocess,
)
from tools.test_engine.core import BadRequest

from .conftest import FIXTURE_TOKENIZER


@pytest.fixture
async def engine(tokenizer):
    async with ScriptedEngine(tokenizer, context_length=2048) as eng:
        yield eng


async def _post(url: str, path: str, body: dict) -> tuple[int, dict | None]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        text = await r.text()
        return r.status, json.loads(text) if text else None


async def _get(url: str, path: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        return r.status, await r.json()


async def test_bad_requests_are_400(engine) -> None:
    base = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
    status, body = await _post(
        engine.url, "/generate", {**base, "sampling_params": {"max_new_tokens": 4, "bogus": 1}}
    )
    assert status == 400 and "bogus" in body["error"]["message"]
    assert (await _post(engine.url, "/generate", {"text": "hi"}))[0] == 400
    assert (await _post(engine.url, "/generate", {**base, "stream": True}))[0] == 400
    assert (await _post(engine.url, "/generate", {"input_ids": "x"}))[0] == 400
    status, body = await _post(engine.url, "/generate", base)
    assert status == 200 and body["meta_info"]["completion_tokens"] == 4
    assert "output_token_logprobs" not in body["meta_info"]  # return_logprob not asked


async def test_script_matching_default_and_scripted_ids(engine, tokenizer) -> None:
    engine.push(Reply(text="for B", match="question B"), "first free reply")
    engine.push(Reply(ids=[10, 11, 12], logprobs=[-0.1, -0.2, -0.3], eos=False))
    async with EngineClient([engine.url]) as client:

        async def ask(text: str):
            ids = tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
            return await client.generate(
                engine.url, ids, SamplingParams(max_new_tokens=64), new_rid()
            )

        b = await ask("question B")
        a = await ask("question A")
        scripted = await ask("question C")
        default1 = await ask("question D")
        default2 = await ask("question D")
        other = await ask("question E")
    assert tokenizer.decode(b.output_ids) == "for B<|im_end|>"
    assert tokenizer.decode(a.output_ids) == "first free reply<|im_end|>"
    assert scripted.output_ids == [10, 11, 12] and scripted.logprobs == [-0.1, -0.2, -0.3]
    assert (scripted.finish_reason, scripted.finish_detail) == ("stop", "")
    assert default1.output_ids == default2.output_ids != other.output_ids
    assert tokenizer.decode(default1.output_ids).startswith("Scripted reply: ")


async def test_abort_request_matches_rid_prefix(tokenizer) -> None:
    async with ScriptedEngine(tokenizer, token_delay_s=0.02) as engine:
        engine.push("a b c d e f g h i j k l m n o p q r s t")
        rid = new_rid()
        async with EngineClient([engine.url]) as client:
            task = asyncio.create_task(
                client.generate(engine.url, [1, 2], SamplingParams(max_new_tokens=64), rid)
            )
            while not engine.core.running:
                await asyncio.sleep(0.005)
            await client.abort(engine.url, "ffff" if rid[:4] != "ffff" else "0000")
            await asyncio.sleep(0.05)
            assert engine.core.running  # a non-matching prefix aborts nothing
            await client.abort(engine.url, rid[:8])
            out = await task
    assert out.finish_reason == "abort"


async def test_http_pause_modes_and_weight_updates(tokenizer) -> None:
    async with ScriptedEngine(tokenizer, token_delay_s=0.01) as engine:
        url = engine.url
        async with EngineClient([url]) as client:
            # in_place: the running request waits, then finishes without an abort.
            engine.push("one two three four five six")
            task = asyncio.create_task(
                client.generate(url, [1, 2], SamplingParams(max_new_tokens=64), new_rid())
            )
            while not engine.core.running:
                await asyncio.sleep(0.005)
            assert (await _post(url, "/pause_generation", {"mode": "in_place"}))[0] == 200
            await asyncio.sleep(0.05)
            assert not task.done()
            assert (await _post(url, "/update_weights_from_disk", {"model_path": "x"}))[0] == 200
            assert (await _post(url, "/continue_generation", {}))[0] == 200
            out = await task
            assert out.finish_reason == "stop" and out.weight_version == "1"
            # abort mode: in-flight requests come back aborted.
            engine.push("one two three four five six")
            task = asyncio.create_task(
                client.generate(url, [1, 2], SamplingParams(max_new_tokens=64), new_rid())
            )
            while not engine.core.running:
                await asyncio.sleep(0.005)
            await _post(url, "/pause_generation", {"mode": "abort"})
            out = await task
            assert out.finish_reason == "abort" and out.finish_detail == "pause_generation (abort)"
            _, body = await _post(url, "/update_weight_version", {"new_version": "v9"})
            assert body["weight_version"] == "v9"
            await _post(url, "/continue_generation", {})
            assert (await _get(url, "/get_weight_version"))[1] == {"weight_version": "v9"}
            _, models = await _get(url, "/v1/models")
            assert models["data"][0]["max_model_len"] == 32768
    assert engine.aborts == []  # pauses are not /abort_request calls


async def test_resumed_request_continues_the_same_reply(engine, tokenizer) -> None:
    engine.push("The quick brown fox jumps over the lazy dog.")
    engine.inject(Fault(abort_after=3))
    async with EngineClient([engine.url]) as client:
        first = await client.generate(
            engine.url, [1, 5], SamplingParams(max_new_tokens=64), "a" * 32
        )
        second = await client.generate(
            engine.url, [1, 5, *first.output_ids], SamplingParams(max_new_tokens=61), "b" * 32
        )
    assert first.finish_reason == "abort" and len(first.output_ids) == 3
    ids = first.output_ids + second.output_ids
    assert tokenizer.decode(ids) == "The quick brown fox jumps over the lazy dog.<|im_end|>"
    assert second.logprobs == [hashed_logprob(2 + i, t) for i, t in enumerate(ids)][3:]


async def test_logprobs_are_float32_values_as_sglang_sends_them(engine) -> None:
    """SGLang's logprobs are float32s sent as JSON doubles (`log_softmax` of
    float32 logits); so are this engine's, or the log would store them at the
    bytes of arbitrary doubles (see `recorder.log.store.arrays`, codec 5)."""
    async with EngineClient([engine.url]) as client:
        out = await client.generate(
            engine.url, [1, 5, 9], SamplingParams(max_new_tokens=40), "c" * 32
        )
    assert len(out.logprobs) == len(out.output_ids) > 5
    f32 = struct.Struct("<f")
    assert all(f32.unpack(f32.pack(lp))[0] == lp for lp in out.logprobs)
    assert all(-5 <= lp < 0 for lp in out.logprobs)


async def test_http_parsers(engine) -> None:
    tools = [
        {"type": "function", "function": {"name": "a"}},
        {"type": "function", "function": {"name": "b"}},
    ]
    text = 'x<tool_call>\n{"name": "b", "arguments": {"k": 1}}\n</tool_call>'
    status, body = await _post(
        engine.url,
        "/parse_function_call",
        {"text": text, "tools": tools, "tool_call_parser": "qwen25"},
    )
    assert status == 200
    assert body == {
        "normal_text": "x",
        "calls": [{"tool_index": 1, "name": "b", "parameters": '{"k": 1}'}],
    }
    status, body = await _post(
        engine.url,
        "/separate_reasoning",
        {"text": "<think>r</think>t", "reasoning_parser": "qwen3"},
    )
    assert body == {"reasoning_text": "r", "text": "t"}
    status, body = await _post(
        engine.url, "/separate_reasoning", {"text": "x", "reasoning_parser": "nope"}
    )
    assert status == 400 and "unknown reasoning parser 'nope'" in body["error"]["message"]


def test_script_file_formats(tmp_path: Path) -> None:
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(["hello", {"ids": [3, 4], "eos": False}]))
    script = load_script(plain)
    assert script.replies == ["hello", Reply(ids=[3, 4], eos=False)]
    full = tmp_path / "full.json"
    full.write_text(json.dumps({"replies": ["x"], "faults": [{"status": 502}], "default_words": 3}))
    script = load_script(full)
    assert script.faults == [Fault(status=502)] and script.default_words == 3


async def test_threaded_engine(tokenizer) -> None:
    def make_core() -> EngineCore:
        return EngineCore(ScriptedBackend(tokenizer, ["threaded"]), tokenizer)

    with ThreadedEngine(make_core) as engine:
        async with EngineClient([engine.url]) as client:
            out = await client.generate(
                engine.url, [1], SamplingParams(max_new_tokens=8), new_rid()
            )
        assert tokenizer.decode(out.output_ids) == "threaded<|im_end|>"
        assert engine.call(lambda: engine.core.weight_version) == "0"


async def test_cli_subprocess_with_script(tmp_path: Path, tokenizer) -> None:
    script = tmp_path / "script.json"
    script.write_text(
        json.dumps({"replies": ["from the CLI"], "faults": [{"status": 503, "match": "fail me"}]})
    )
    proc, url = start_subprocess(
        ["--backend", "scripted", "--script", str(script), "--context-length", "512",
         "--tokenizer", str(FIXTURE_TOKENIZER)]
    )  # fmt: skip
    try:
        async with EngineClient([url]) as client:
            assert await client.context_length(url) == 512
            bad = tokenizer.encode("please fail me")
            with pytest.raises(Exception, match="HTTP 503"):
                await client.generate(url, bad, SamplingParams(max_new_tokens=8), new_rid())
            out = await client.generate(url, [1, 2], SamplingParams(max_new_tokens=8), new_rid())
            assert tokenizer.decode(out.output_ids) == "from the CLI<|im_end|>"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_lean_parse_reads_what_the_checked_parse_reads(tokenizer) -> None:
    """Benchmarks' engines skip SGLang's contract check (`check_contract=False`): their typed
    read must give the same request for valid bodies and still refuse what it cannot run."""
    checked = EngineCore(ScriptedBackend(tokenizer), tokenizer)
    lean = EngineCore(ScriptedBackend(tokenizer), tokenizer, check_contract=False)
    bodies = [
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "rid": "r1"},
        {
            "input_ids": list(range(500)),
            "rid": "r2",
            "return_logprob": True,
            "sampling_params": {"temperature": 0.5, "top_p": 0.9, "stop": ["x"], "top_k": 5},
        },
        {"input_ids": [7], "rid": "r3", "sampling_params": None, "return_routed_experts": True},
    ]
    for body in bodies:
        raw = json.dumps(body).encode()
        assert lean.parse_raw(raw) == checked.parse_raw(raw) == checked.parse_request(body)
    for bad in (
        {"input_ids": [1, "2"]},
        {"input_ids": [1.5]},
        {"text": "hi"},
        {"input_ids": [1], "stream": True},
    ):
        with pytest.raises(BadRequest):
            lean.parse_raw(json.dumps(bad).encode())
    with pytest.raises(BadRequest):
        lean.parse_raw(b"{not json")
