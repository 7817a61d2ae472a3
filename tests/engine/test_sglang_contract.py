"""SGLang's `/generate` request contract: the test engines refuse exactly what SGLang refuses.

The first tests run on whichever check the test engine has (SGLang's own, else
the mirror in tools/test_engine/contract.py); the `sglang` tier proves the
mirror equal to SGLang's check and that CI's test engines run SGLang's, so
every request the recorder sends in any test passes SGLang's real validator.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from recorder.model import sglang_compat
from recorder.model.engine import EngineClient
from recorder.model.engine_wire import SamplingParams, new_rid
from tools.test_engine import ScriptedEngine
from tools.test_engine.contract import (
    GenerateContract,
    SamplingContract,
    contract_error,
    contract_source,
    mirror_contract_error,
)

BASE: dict[str, Any] = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}


def _sampling(**params: Any) -> dict[str, Any]:
    return {**BASE, "sampling_params": {"max_new_tokens": 4, **params}}


@pytest.mark.parametrize(
    "body",
    [
        _sampling(max_new_tokens="1"),
        _sampling(max_new_tokens=1.5),
        _sampling(max_new_tokens=True),
        _sampling(temperature="0.7"),
        _sampling(ignore_eos=1),
        _sampling(stop=[1]),
        _sampling(bogus=1),
        _sampling(watermark={"enabled": True, "strength": 2}),
        {**BASE, "return_logprob": 1},
        {"input_ids": [1.5]},
        {"input_ids": "x"},
    ],
)
async def test_what_sglang_refuses_is_a_400(tokenizer, body: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    async with (
        ScriptedEngine(tokenizer) as engine,
        aiohttp.ClientSession() as http,
        http.post(engine.url + "/generate", json=body) as resp,
    ):
        assert resp.status == 400, await resp.text()
        assert (await resp.json())["error"]["message"] == contract_error(body)


@pytest.mark.parametrize(
    "body",
    [
        _sampling(beam_width=None, watermark={"enabled": False}, choice=["a", "b"]),
        _sampling(temperature=1, top_k=-1, stop="x", logit_bias={"5": -1}),
        _sampling(max_new_tokens=None, temperature=None),  # null means the default
        {**BASE, "return_routed_experts": True, "unknown_top_level": 1},
    ],
)
async def test_what_sglang_accepts_is_served(tokenizer, body: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    async with (
        ScriptedEngine(tokenizer, replies=["ok"]) as engine,
        aiohttp.ClientSession() as http,
        http.post(engine.url + "/generate", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()


# --------------------------------------------------------------------------
# The sglang tier
# --------------------------------------------------------------------------

VALUES: list[Any] = [
    "1", "a", 1.5, 1, 0, -1, 2**70, True, False, None, [], {}, [1], [1.5], ["a"], [[1]],
    {"enabled": True}, {"enabled": 1}, {"x": 1}, {"1": 2.0}, {"1": "a"},
]  # fmt: skip


def _bodies() -> list[Any]:
    bodies: list[Any] = [[1], "x", None, {}, {"text": "hi"}]
    for field in SamplingContract.__struct_fields__:
        bodies += [{"input_ids": [1], "sampling_params": {field: v}} for v in VALUES]
    for field in GenerateContract.__struct_fields__:
        bodies += [{"input_ids": [1], field: v} for v in VALUES]
    bodies += [{"input_ids": [1], "sampling_params": [{"n": 1}, {"n": "1"}]}]
    return bodies


@pytest.mark.sglang
@pytest.mark.usefixtures("sglang_version")
def test_the_mirror_refuses_exactly_what_sglang_refuses() -> None:
    bodies = _bodies()
    differences = [
        (json.dumps(b), real, mine)
        for b in bodies
        if ((real := sglang_compat.generate_contract_error(b)) is None)
        != ((mine := mirror_contract_error(b)) is None)
    ]
    assert differences == []
    assert sum(sglang_compat.generate_contract_error(b) is not None for b in bodies) > 100


@pytest.mark.sglang
@pytest.mark.usefixtures("sglang_version")
async def test_test_engines_run_sglangs_own_check_and_the_recorder_passes_it(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Under the sglang tier every engine test validates with SGLang itself; the requests
    the recorder's engine client builds, with every option it has, are admitted."""
    assert contract_source() == f"sglang {sglang_compat.version()}"
    params = SamplingParams(
        max_new_tokens=8, temperature=0.0, top_p=0.9, top_k=20, stop=("END",), stop_token_ids=(2,)
    )
    async with ScriptedEngine(tokenizer, replies=["a b END"] * 2) as engine:
        client = EngineClient([engine.url])
        await client.start()
        try:
            out = await client.generate(engine.url, [1, 2, 3], params, new_rid())
            routed = await client.generate(
                engine.url, [1, 2, 3], params, new_rid(), return_routed_experts=True
            )
        finally:
            await client.close()
    assert out.output_ids and routed.output_ids
