"""What an agent may choose of its own sampling, and what is trained when it does.

Found in an audit: in a session whose trainer forced only `temperature` (the
README's `recorder rollout --temperature 1.0`), the agent's request set `top_k:
1`, `top_p: 0.01` and a `const` JSON schema, all three reached the engine, and
the answer's tokens were trained as the policy's. Now the trainer owns the
distribution of such a session (the request's temperature, top_p and top_k are
not taken; what the trainer left unset is neutral), and a turn sampled under a
grammar is kept for the client but never trained, in any session.
"""

from __future__ import annotations

from typing import Any

import pytest

from recorder.log import events as ev
from tests.server.conftest import Harness
from tests.server.test_e2e import ask

SCHEMA = {"type": "object", "properties": {"a": {"const": "chosen by the agent"}}}


async def closed(h: Harness, sid: str) -> dict[str, Any]:
    status, data = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    assert status == 200, data
    return data


async def test_a_trainer_session_samples_the_trainers_distribution(guarded: Harness) -> None:
    h = guarded
    sid = await h.open_session(config={"sampling": {"temperature": 1.0}})
    body = {"top_k": 1, "top_p": 0.01, "temperature": 0.1}
    await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=False, extra_body=body)
    (attempt,) = await h.payloads(sid, ev.GenerateAttempt)
    params = attempt.sampling_params
    assert (params["temperature"], params["top_p"], params["top_k"]) == (1.0, 1.0, -1)
    assert sum(sum(s["loss_mask"]) for s in (await closed(h, sid))["samples"]) > 0


async def test_a_session_without_forced_sampling_keeps_the_requests(guarded: Harness) -> None:
    h = guarded
    sid = await h.open_session()
    await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=False,
              extra_body={"top_k": 5, "top_p": 0.5})  # fmt: skip
    (attempt,) = await h.payloads(sid, ev.GenerateAttempt)
    assert (attempt.sampling_params["top_p"], attempt.sampling_params["top_k"]) == (0.5, 5)


@pytest.mark.parametrize("forced", [True, False])
async def test_a_turn_sampled_under_a_grammar_is_not_trained(
    guarded: Harness, forced: bool
) -> None:
    h = guarded
    sid = await h.open_session(**({"config": {"sampling": {"temperature": 1.0}}} if forced else {}))
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}
    await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=False, extra_body=fmt)
    (attempt,) = await h.payloads(sid, ev.GenerateAttempt)
    assert "json_schema" in attempt.sampling_params  # the client still gets its format
    data = await closed(h, sid)
    assert sum(sum(s["loss_mask"]) for s in data["samples"]) == 0
    (result,) = await h.payloads(sid, ev.GenerateResult)
    accounting = data["token_accounting"]
    label = "masked: constrained decoding (a grammar: json_schema, regex, ...)"
    assert accounting[label] == result.output_ids.length == accounting["engine output"]
