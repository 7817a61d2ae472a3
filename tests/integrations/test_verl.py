"""RecorderAgentLoop inside verl 0.9.1's REAL agent-loop code (marker `verl`).

verl's workers are Ray actors built from a full trainer config; here the same
classes are built with `object.__new__` and the handful of attributes their
per-trajectory methods read (config, tokenizer, rollout lengths), and then
verl's own code runs: the registry lookup and `hydra.utils.instantiate` of
`_run_agent_loop`, the legacy per-trajectory `_agent_loop_postprocess` and
batch `_postprocess`, and the v1 (TransferQueue) `_agent_loop_postprocess` up
to the put into TransferQueue, whose client is the one thing captured.
The rollouts themselves come from the driver's result type built from real
reducer samples (the end-to-end run of the hook is tests/integrations/test_e2e.py).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest

from recorder.integrations.common import HookConfigError
from recorder.rollout.driver import RolloutResult
from replay.rules import Rules
from tests.conftest import missing
from tests.integrations.results import fan_out_log, infra_failure, result_of

pytestmark = pytest.mark.verl

TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "smollm2-tokenizer"
ROW = {
    "raw_prompt": [{"role": "user", "content": "Fix add() in calc.py."}],
    "extra_info": {
        "instance_id": "calc-add",
        "repo": "/srv/calc",
        "base_commit": "abc123",
        "eval_cmd": "pytest -q",
        "index": 3,
    },
    "index": 3,
}


@pytest.fixture(scope="module")
def verl() -> Any:
    try:
        agent_loop = importlib.import_module("verl.experimental.agent_loop.agent_loop")
        v1 = importlib.import_module("verl.trainer.ppo.v1.agent_loop_tq")
    except ImportError as exc:
        missing(f"verl 0.9.1 is not importable ({exc})", "bash tools/setup.sh installs .[verl]")
    importlib.import_module("recorder.integrations.verl")  # runs @register("recorder")
    return agent_loop, v1


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def config(
    *, use_v1: bool, prompt_length: int = 16, response_length: int = 8, routing: bool = False
) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "trainer": {"use_v1": use_v1},
            "actor_rollout_ref": {
                "rollout": {
                    "prompt_length": prompt_length,
                    "response_length": response_length,
                    "enable_rollout_routing_replay": routing,
                }
            },
            "data": {},
        }
    )


def worker(cls: type, cfg: Any, tokenizer: Any) -> Any:
    """A verl agent-loop worker with only what its per-trajectory methods read."""
    from verl.utils.dataset.rl_dataset import RLHFDataset

    w = object.__new__(cls)
    w.config = cfg
    w.llm_client = None
    w.teacher_client = None
    w.reward_loop_worker_handles = None
    w.rollout_config = cfg.actor_rollout_ref.rollout
    w.tokenizer = tokenizer
    w.processor = None
    w.hf_model_type = None
    w.dataset_cls = RLHFDataset
    w.tools = []
    w.mm_processor_kwargs = {}
    w.distillation_enabled = False
    return w


@pytest.fixture
def rollouts(monkeypatch: pytest.MonkeyPatch) -> dict[int, Any]:
    """The driver's answers by group index (the row's `index`)."""
    answers: dict[int, Any] = {}

    async def run_rollout(request: Any) -> RolloutResult:
        return answers[request.group_index]

    monkeypatch.setattr("recorder.rollout.driver.run_rollout", run_rollout)
    monkeypatch.setenv("TR_RECORDER_URL", "http://recorder.invalid:8080")
    return answers


def trajectory(i: int = 0) -> dict[str, Any]:
    return {"step": 1, "sample_index": i, "rollout_n": 0, "validate": False}


async def test_registered_and_resolved_through_verls_registry(verl: Any, tokenizer: Any) -> None:
    agent_loop, _ = verl
    entry = agent_loop._agent_loop_registry["recorder"]
    assert entry == {"_target_": "recorder.integrations.verl.RecorderAgentLoop"}


async def test_legacy_one_output_through_postprocess_and_batch(
    verl: Any, tokenizer: Any, rollouts: dict[int, Any]
) -> None:
    agent_loop, _ = verl
    cfg = config(use_v1=False, prompt_length=16, response_length=8)
    w = worker(agent_loop.AgentLoopWorker, cfg, tokenizer)
    rollouts[3] = result_of(fan_out_log("good"), reward=1.0)
    rollouts[4] = infra_failure("sandbox_boot")
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}

    good = await w._run_agent_loop(params, trajectory(0), agent_name="recorder", **ROW)
    bad = await w._run_agent_loop(
        params, trajectory(1), agent_name="recorder", **{**ROW, "index": 4}
    )
    batch = w._postprocess([good, bad])

    final = rollouts[3].samples[-1]
    n_prompt, n_resp = final.prompt_len, final.response_len
    assert batch.batch["prompts"].shape == (2, 16)
    assert batch.batch["responses"].shape == (2, 8)
    assert batch.batch["input_ids"].shape == (2, 24)
    assert batch.batch["prompts"][0, -n_prompt:].tolist() == final.tokens[:n_prompt]
    assert batch.batch["responses"][0, :n_resp].tolist() == final.tokens[n_prompt:]
    assert batch.batch["response_mask"][0, :n_resp].tolist() == final.loss_mask
    assert not batch.batch["response_mask"][0, n_resp:].any()
    assert batch.batch["rollout_log_probs"][0, :n_resp].tolist() == pytest.approx(
        final.rollout_logprobs
    )
    rm = batch.batch["rm_scores"]
    assert rm[0, n_resp - 1].item() == 1.0 and rm[0].sum().item() == 1.0  # task reward, last token
    assert rm[1].sum().item() == 0.0 and not batch.batch["response_mask"][1].any()
    assert list(batch.non_tensor_batch["recorder_failed"]) == [False, True]
    assert batch.non_tensor_batch["segment_kind"][0] == "final"
    assert batch.non_tensor_batch["recorder_dropped_segments"][0] == 2


async def test_legacy_clips_what_would_crash_verls_padding(
    verl: Any, tokenizer: Any, rollouts: dict[int, Any]
) -> None:
    agent_loop, _ = verl
    cfg = config(use_v1=False, prompt_length=2, response_length=3)
    w = worker(agent_loop.AgentLoopWorker, cfg, tokenizer)
    rollouts[3] = result_of(fan_out_log("long"), reward=1.0)
    out = await w._run_agent_loop({}, trajectory(), agent_name="recorder", **ROW)
    batch = w._postprocess([out])
    final = rollouts[3].samples[-1]
    assert (
        batch.batch["prompts"][0].tolist() == final.tokens[final.prompt_len - 2 : final.prompt_len]
    )
    assert batch.batch["responses"][0].tolist() == final.tokens[final.prompt_len :][:3]
    assert batch.batch["response_mask"][0].tolist() == [0, 0, 0]  # its prompt lost its head
    assert batch.non_tensor_batch["recorder_truncated"][0] is True
    assert batch.batch["rm_scores"][0, 2].item() == 1.0


async def test_legacy_routing_replay_rows_land_under_the_tokens(
    verl: Any, tokenizer: Any, rollouts: dict[int, Any]
) -> None:
    agent_loop, _ = verl
    agent_loop._agent_loop_registry["recorder-moe"] = {
        "_target_": "recorder.integrations.verl.RecorderAgentLoop",
        "routed_experts": [3, 2],
    }
    w = worker(agent_loop.AgentLoopWorker, config(use_v1=False, routing=True), tokenizer)
    rollouts[3] = result_of(fan_out_log("moe", routed=(3, 2)), rules=Rules(routed_experts=(3, 2)))
    rollouts[4] = infra_failure()
    good = await w._run_agent_loop({}, trajectory(0), agent_name="recorder-moe", **ROW)
    bad = await w._run_agent_loop(
        {}, trajectory(1), agent_name="recorder-moe", **{**ROW, "index": 4}
    )
    batch = w._postprocess([good, bad])

    final = rollouts[3].samples[-1]
    experts = batch.batch["routed_experts"]
    assert experts.shape == (2, 16 + 8, 3, 2)
    start = 16 - final.prompt_len  # left padding
    want = final.routed_experts.to_array()
    assert experts[0, start : start + len(final.tokens)].tolist() == want.tolist()
    assert not experts[0, :start].any() and not experts[1].any()


def v1_worker(
    verl: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, list[dict[str, Any]]]:
    """verl's v1 agent-loop worker, and the list its transfer-queue puts land in."""
    _, v1 = verl
    put: list[dict[str, Any]] = []

    async def async_kv_batch_put(**kw: Any) -> None:
        put.append(kw)

    monkeypatch.setattr(v1.tq, "async_kv_batch_put", async_kv_batch_put)
    cls = v1.AgentLoopWorkerTQ.__ray_metadata__.modified_class
    return worker(cls, config(use_v1=True, prompt_length=64, response_length=64), tokenizer), put


async def test_v1_list_final_last_reward_copied_to_all(
    verl: Any, tokenizer: Any, rollouts: dict[int, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    w, put = v1_worker(verl, tokenizer, monkeypatch)
    rollouts[3] = result_of(fan_out_log("v1"), reward=1.0, rules=Rules(reward_mode="final_only"))
    rollouts[4] = infra_failure("recorder_unreachable")
    kw = {"uid": "u-3", "global_steps": 1}
    await w._run_agent_loop({}, trajectory(0), agent_name="recorder", session_id=0, **kw, **ROW)
    await w._run_agent_loop(
        {}, trajectory(1), agent_name="recorder", session_id=1, **kw, **{**ROW, "index": 4}
    )

    (call,) = put  # the failed rollout put nothing: verl drops it, the group stays
    assert call["keys"] == ["u-3_0_0", "u-3_0_1", "u-3_0_2"]
    fields = call["fields"]
    samples = rollouts[3].samples
    for i, s in enumerate(samples):
        assert fields["prompts"][i].tolist() == s.tokens[: s.prompt_len]
        assert fields["responses"][i].tolist() == s.tokens[s.prompt_len :]
        assert fields["response_mask"][i].tolist() == s.loss_mask
        rm = fields["rm_scores"][i]
        assert rm[-1].item() == 1.0 and rm.sum().item() == 1.0  # the final's reward, copied
    assert [t["status"] for t in call["tags"]] == ["success"] * 3
    kinds = [fields["extra_fields"][i]["segment_kind"] for i in range(3)]
    assert kinds == ["subagent", "wipe", "final"]


async def test_configured_from_the_agent_loop_yaml(
    verl: Any, tokenizer: Any, rollouts: dict[int, Any], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The YAML entry goes through verl's own registry + hydra.utils.instantiate."""
    from omegaconf import OmegaConf

    agent_loop, _ = verl
    monkeypatch.delenv("TR_RECORDER_URL")
    seen: list[Any] = []

    async def run_rollout(request: Any) -> RolloutResult:
        seen.append(request)
        return rollouts[3]

    monkeypatch.setattr("recorder.rollout.driver.run_rollout", run_rollout)
    rollouts[3] = result_of(fan_out_log("yaml"), reward=1.0)
    path = tmp_path / "agent_loops.yaml"
    path.write_text(
        "- name: recorder-e2b\n"
        "  _target_: recorder.integrations.verl.RecorderAgentLoop\n"
        "  recorder_url: http://recorder-host:8080\n"
        "  agent_base_url: http://10.0.0.5:8080\n"
        "  sandbox: {backend: e2b, template: swe-base, timeout_s: 900}\n"
        "  wall_budget_s: 600\n"
        "  turn_budget: 40\n"
        "  sampling: {max_new_tokens: 512}\n"
    )
    for entry in OmegaConf.load(path):  # what AgentLoopWorker.__init__ does with the path
        agent_loop._agent_loop_registry[entry.name] = entry
    w = worker(agent_loop.AgentLoopWorker, config(use_v1=False), tokenizer)
    params = {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "logprobs": True}
    await w._run_agent_loop(params, trajectory(), agent_name="recorder-e2b", **ROW)

    (req,) = seen
    assert req.recorder_url == "http://recorder-host:8080"
    assert req.agent_base_url == "http://10.0.0.5:8080"
    assert (req.sandbox.backend, req.sandbox.template, req.sandbox.timeout_s) == (
        "e2b",
        "swe-base",
        900.0,
    )
    assert (req.wall_budget_s, req.turn_budget) == (600.0, 40)
    assert req.sampling == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 512}
    assert req.group_index == 3 and req.task.instance_id == "calc-add"
    assert req.task.problem_statement == "Fix add() in calc.py."
    assert req.session_metadata["trainer"] == "verl"


async def test_a_trainer_mode_contradicting_the_config_is_a_clear_error(
    verl: Any, tokenizer: Any, rollouts: dict[int, Any]
) -> None:
    agent_loop, _ = verl
    agent_loop._agent_loop_registry["recorder-legacy"] = {
        "_target_": "recorder.integrations.verl.RecorderAgentLoop",
        "trainer_mode": "legacy",
    }
    w = worker(agent_loop.AgentLoopWorker, config(use_v1=True), tokenizer)
    with pytest.raises(
        Exception, match=re.escape("trainer.use_v1=True runs the v1 trainer")
    ) as info:
        await w._run_agent_loop({}, trajectory(), agent_name="recorder-legacy", **ROW)
    assert isinstance(info.value, HookConfigError) or isinstance(
        info.value.__cause__, HookConfigError
    )


@pytest.mark.slow
async def test_end_to_end_group_against_a_remote_recorder(
    verl: Any, tokenizer: Any, stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl's legacy worker runs a group (rollout.n = 3, one broken row) through the real driver."""
    import asyncio

    import msgspec

    agent_loop, _ = verl
    for k, v in stack.env().items():
        monkeypatch.setenv(k, v)
    w = worker(agent_loop.AgentLoopWorker, config(use_v1=False, prompt_length=1024,
                                                  response_length=512), tokenizer)  # fmt: skip
    task = msgspec.to_builtins(stack.tasks["greet-punctuation"])
    row = {
        "raw_prompt": [{"role": "user", "content": "-"}],
        "extra_info": {"task": task},
        "index": 0,
    }
    broken = {**row, "extra_info": {"task": {**task, "repo": "/nonexistent/repo"}}}
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
              "logprobs": True}  # fmt: skip  # exactly what verl's worker passes
    outs = await asyncio.gather(
        *(w._run_agent_loop(params, trajectory(i), agent_name="recorder", **row) for i in range(2)),
        w._run_agent_loop(params, trajectory(2), agent_name="recorder", **broken),
    )
    batch = w._postprocess(list(outs))
    assert batch.batch["responses"].shape == (3, 512)
    assert batch.batch["rm_scores"].sum(dim=1).tolist() == [1.0, 1.0, 0.0]
    assert list(batch.non_tensor_batch["recorder_failed"]) == [False, False, True]
    assert batch.batch["response_mask"][:2].sum().item() > 0
    assert not batch.batch["response_mask"][2].any()
    sessions = set(batch.non_tensor_batch["recorder_session_id"][:2])
    assert len(sessions) == 2


YAML_URL = "http://recorder-from-yaml:8080"


@pytest.mark.parametrize("env_url", [None, "http://recorder-from-env.invalid:8080"])
@pytest.mark.parametrize("use_v1", [False, True], ids=["legacy", "v1"])
async def test_yaml_entry_survives_the_import_by_the_first_trajectory(
    verl: Any, tokenizer: Any, rollouts: dict[int, Any], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, use_v1: bool, env_url: str | None,
) -> None:  # fmt: skip
    """verl's real order: the YAML fills the registry, then instantiate imports the hook.

    `AgentLoopWorker.__init__` loads the YAML into `_agent_loop_registry` while
    this module is not imported yet; the first trajectory's instantiate imports
    it. Importing it must not replace the YAML's "recorder" entry, else the
    next trajectories of the worker run without the YAML's settings (no URL:
    an exception outside `run`; a `TR_*` URL: silently other settings).
    """
    import sys

    from omegaconf import OmegaConf

    import recorder.integrations

    agent_loop, v1 = verl
    # A fresh worker process: the hook module not imported, "recorder" not registered.
    monkeypatch.delitem(sys.modules, "recorder.integrations.verl")
    monkeypatch.delattr(recorder.integrations, "verl", raising=False)
    monkeypatch.delitem(agent_loop._agent_loop_registry, "recorder")
    if env_url is None:
        monkeypatch.delenv("TR_RECORDER_URL")
    else:
        monkeypatch.setenv("TR_RECORDER_URL", env_url)
    seen: list[Any] = []

    async def run_rollout(request: Any) -> RolloutResult:
        seen.append(request)
        return result_of(fan_out_log(f"order-{len(seen)}"), reward=1.0)

    monkeypatch.setattr("recorder.rollout.driver.run_rollout", run_rollout)
    path = tmp_path / "recorder_agent_loop.yaml"
    path.write_text(
        "- name: recorder\n"
        "  _target_: recorder.integrations.verl.RecorderAgentLoop\n"
        f"  recorder_url: {YAML_URL}\n"
        "  sampling: {max_new_tokens: 777}\n"
    )
    for entry in OmegaConf.load(path):  # what AgentLoopWorker.__init__ does with the path
        agent_loop._agent_loop_registry[entry.name] = entry
    yaml_entry = agent_loop._agent_loop_registry["recorder"]

    put: list[dict[str, Any]] = []
    if use_v1:

        async def async_kv_batch_put(**kw: Any) -> None:
            put.append(kw)

        monkeypatch.setattr(v1.tq, "async_kv_batch_put", async_kv_batch_put)
        cls = v1.AgentLoopWorkerTQ.__ray_metadata__.modified_class
        cfg = config(use_v1=True, prompt_length=64, response_length=64)
    else:
        cls = agent_loop.AgentLoopWorker
        cfg = config(use_v1=False, prompt_length=64, response_length=64)
    w = worker(cls, cfg, tokenizer)

    outs = []
    for i in range(3):  # several trajectories in one worker
        kw = {"uid": f"u-{i}", "global_steps": 1, "session_id": 0} if use_v1 else {}
        out = await w._run_agent_loop({}, trajectory(i), agent_name="recorder", **kw, **ROW)
        outs.append(out)
        if i == 0:
            assert "recorder.integrations.verl" in sys.modules  # imported by instantiate

    assert agent_loop._agent_loop_registry["recorder"] is yaml_entry
    assert [r.recorder_url for r in seen] == [YAML_URL] * 3
    assert [r.sampling.get("max_new_tokens") for r in seen] == [777] * 3
    if use_v1:
        assert len(put) == 3
        assert all(t["status"] == "success" for call in put for t in call["tags"])
    else:
        batch = w._postprocess(outs)
        assert list(batch.non_tensor_batch["recorder_failed"]) == [False] * 3
