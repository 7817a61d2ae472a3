"""The lean engine `bench_server` measures the recorder against: the test engine's
answer shape, read off a request it never decodes whole."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from tools.benchkit.engine import fixture_tokenizer
from tools.benchkit.lean_engine import REPLY, lean_app, split_input_ids
from tools.test_engine.scripted import hashed_logprob


async def generate(client: TestClient, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with client.post("/generate", data=orjson.dumps(body)) as resp:
        return resp.status, orjson.loads(await resp.read())


async def test_the_lean_engine_answers_as_the_test_engine_does() -> None:
    tok = fixture_tokenizer()
    reply = [*tok.encode(REPLY), tok.eos_token_ids[0]]
    async with TestClient(TestServer(lean_app(tok, context_length=1000))) as client:
        ids = list(range(100, 340))
        status, answer = await generate(
            client,
            {"rid": "r1", "input_ids": ids, "return_logprob": True, "sampling_params": {}},
        )
        assert status == 200
        assert answer["output_ids"] == reply and answer["text"] == tok.decode(reply)
        meta = answer["meta_info"]
        assert (meta["id"], meta["prompt_tokens"], meta["completion_tokens"]) == (
            "r1",
            240,
            len(reply),
        )
        assert meta["finish_reason"] == {"type": "stop", "matched": reply[-1]}
        assert meta["output_token_logprobs"] == [
            [hashed_logprob(240 + i, t), t, None] for i, t in enumerate(reply)
        ]
        # Cut by max_new_tokens, or at a stop id the request names; no logprobs unasked.
        _, cut = await generate(
            client, {"input_ids": [5], "sampling_params": {"max_new_tokens": 3}}
        )
        assert cut["output_ids"] == reply[:3] and "output_token_logprobs" not in cut["meta_info"]
        assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        stop = {"max_new_tokens": 64, "stop_token_ids": [reply[1]]}
        _, stopped = await generate(client, {"input_ids": [], "sampling_params": stop})
        assert stopped["output_ids"] == reply[:2] and stopped["meta_info"]["prompt_tokens"] == 0
        # Past the context length, and a body that is no /generate request: 400.
        status, _ = await generate(
            client, {"input_ids": ids * 4, "sampling_params": {"max_new_tokens": 64}}
        )
        assert status == 400
        async with client.post("/generate", data=b"[1, 2]") as resp:
            assert resp.status == 400
        # Every other route is the test engine's.
        async with client.get("/model_info") as resp:
            assert (await resp.json())["context_length"] == 1000


def test_input_ids_are_counted_as_a_decoder_would_count_them() -> None:
    """The ids are counted off their JSON, never decoded: every spelling a JSON encoder
    may send counts as `len(json.loads(...)["input_ids"])`; what is no flat array is refused."""
    for body in (
        orjson.dumps({"rid": "a", "input_ids": list(range(1000)), "return_logprob": True}),
        json.dumps({"input_ids": [3, 1, 2], "rid": "b"}, indent=2).encode(),
        json.dumps({"input_ids": [7]}).encode(),
        b'{"input_ids": [ ] , "rid": "c"}',
        b'{"rid": "d"}',
    ):
        rest, n = split_input_ids(body)
        assert n == len(json.loads(body).get("input_ids", []))
        expected = {k: v for k, v in json.loads(body).items() if k != "input_ids"}
        assert {k: v for k, v in json.loads(rest).items() if k != "input_ids"} == expected
    with pytest.raises(ValueError):
        split_input_ids(b'{"input_ids": null}')
    rest, _ = split_input_ids(b'{"input_ids": [[1, 2], [3]]}')
    with pytest.raises(msgspec.DecodeError):
        msgspec.json.decode(rest)
