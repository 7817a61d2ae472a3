"""Settings, dataset rows -> tasks, sampling: what both hooks share."""

from __future__ import annotations

import json

import pytest

from recorder.integrations.common import (
    HookConfigError,
    agent_for,
    engine_sampling,
    resolve_settings,
    run_one,
    sandbox_for,
    task_row,
)
from recorder.rollout.sandbox.base import SandboxSpec
from recorder.rollout.tasks import task_from_dict


def test_trainer_config_wins_over_the_environment() -> None:
    env = {
        "TR_RECORDER_URL": "http://from-env:1",
        "TR_ADMIN_TOKEN": "tok",
        "TR_SANDBOX": '{"backend": "e2b", "template": "t", "options": {"api_url": "http://e2b"}}',
        "TR_AGENT": '{"version": "2.1.330"}',
        "TR_WALL_BUDGET_S": "60",
        "TR_TURN_BUDGET": "7",
        "TR_SESSION_METADATA": '{"run": "r1"}',
    }
    explicit = {"recorder_url": "http://from-args:2", "wall_budget_s": 30}
    s = resolve_settings(explicit.get, where="args", env=env)
    assert s.recorder_url == "http://from-args:2" and s.wall_budget_s == 30.0
    assert s.admin_token == "tok" and s.turn_budget == 7
    assert s.sandbox == SandboxSpec(backend="e2b", template="t", options={"api_url": "http://e2b"})
    assert s.agent == {"version": "2.1.330"} and s.session_metadata == {"run": "r1"}
    plain = resolve_settings(
        {}.get, where="args", env={"TR_RECORDER_URL": "http://r", "TR_SANDBOX": "e2b"}
    )
    assert plain.sandbox.backend == "e2b" and plain.wall_budget_s == 1800.0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "TR_RECORDER_URL"),
        (
            {"TR_RECORDER_URL": "http://r", "TR_TURN_BUDGET": "many"},
            "turn_budget ($TR_TURN_BUDGET)",
        ),
        (
            {"TR_RECORDER_URL": "http://r", "TR_AGENT": "{nope"},
            "agent ($TR_AGENT) is not valid JSON",
        ),
        ({"TR_RECORDER_URL": "http://r", "TR_SANDBOX": '{"backend": 3}'}, "sandbox ($TR_SANDBOX)"),
    ],
)
def test_bad_settings_name_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(HookConfigError) as info:
        resolve_settings({}.get, where="args", env=env)
    assert message in str(info.value)


def test_only_what_a_session_may_force_is_passed() -> None:
    slime = {"temperature": 0.8, "top_p": 1.0, "top_k": -1, "max_new_tokens": 512,
             "stop_token_ids": [2], "skip_special_tokens": False, "no_stop_trim": True}  # fmt: skip
    verl = {
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": None,
        "repetition_penalty": 1.0,
        "logprobs": 1,
    }
    assert engine_sampling(slime) == {
        "temperature": 0.8,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 512,
        "stop_token_ids": [2],
    }
    assert engine_sampling(verl) == {"temperature": 1.0, "top_p": 0.9, "repetition_penalty": 1.0}


def test_flat_row() -> None:
    row = {
        "instance_id": "calc-1",
        "repo": "/srv/calc",
        "base_commit": "abc",
        "problem_statement": "fix add",
        "pre_commands": "pip install -e .\\ngit status",
        "eval_cmd": "pytest -q",
        "image": "registry/calc:1",
        "workdir": "/workspace/calc",
    }
    task = task_from_dict(task_row(row))
    assert task.setup == ["pip install -e .", "git status"] and task.eval_cmd == "pytest -q"
    assert task.metadata == {"image": "registry/calc:1", "workdir": "/workspace/calc"}
    spec = sandbox_for(
        resolve_settings({"recorder_url": "u", "sandbox": "e2b"}.get, where="a"), task_row(row)
    )
    assert spec.template == "registry/calc:1"


def test_swe_bench_row_under_remote_env_info() -> None:
    remote = {
        "instance_id": "astropy__astropy-12907",
        "repo": "astropy/astropy",
        "base_commit": "d16bfe05",
        "FAIL_TO_PASS": json.dumps(["t.py::test_a"]),
        "PASS_TO_PASS": "[]",
        "test_patch": "diff --git a/t.py b/t.py\n",
        "image_url": "swebench/astropy:1",
    }
    prompt = [{"role": "system", "content": "x"}, {"role": "user", "content": "The bug is ..."}]
    task = task_from_dict(task_row({"remote_env_info": remote}, prompt=prompt))
    assert task.repo == "https://github.com/astropy/astropy.git"
    assert task.problem_statement == "The bug is ..."
    assert task.tests is not None and task.tests.fail_to_pass == ["t.py::test_a"]
    # The driver applies the test_patch (after restoring its files), not the test command.
    assert task.test_patch == "diff --git a/t.py b/t.py\n"
    assert task.tests.cmd.endswith("{tests}") and "git apply" not in task.tests.cmd
    assert task.metadata["image"] == "swebench/astropy:1"


def test_flat_keys_win_and_f2p_script_grades() -> None:
    row = {
        "instance_id": "flat-id",
        "repo": "/srv/r",
        "base_commit": "c",
        "remote_env_info": {"instance_id": "remote-id", "f2p_script": "import sys\nsys.exit(0)"},
    }
    task = task_from_dict(task_row(row, prompt="statement", label="label-id"))
    assert task.instance_id == "flat-id" and task.problem_statement == "statement"
    assert task.eval_script == "python3 - <<'TR_F2P'\nimport sys\nsys.exit(0)\nTR_F2P\n"


def test_task_layout_and_label_fallback() -> None:
    inner = {"repo": "/srv/r", "base_commit": "c", "eval_script": "true"}
    task = task_from_dict(task_row({"task": inner}, prompt="do it", label="from-label"))
    assert (task.instance_id, task.problem_statement) == ("from-label", "do it")


async def test_a_row_the_task_format_rejects_is_a_failure_not_an_exception() -> None:
    settings = resolve_settings({"recorder_url": "http://r"}.get, where="args")
    got = await run_one(settings, {"repo": "/srv/r"}, sample_index=0, group_index=0, sampling={},
                        session_metadata={})  # fmt: skip
    assert got.outcome == "infra_error" and got.samples == []
    assert got.infra_cause is not None and got.infra_cause.startswith("TaskError")


def test_sandbox_and_agent_env_reach_the_specs_and_nothing_else_does() -> None:
    env = {
        "TR_RECORDER_URL": "http://r",
        "TR_SANDBOX": '{"backend": "local", "env": {"A": "from-sandbox"}}',
        "TR_AGENT": '{"env": {"B": "from-agent"}}',
        "TR_SANDBOX_ENV": '{"PIP_INDEX_URL": "http://mirror/simple"}',
        "TR_AGENT_ENV": '{"MAX_THINKING_TOKENS": "0"}',
        "CLAUDE_CONFIG_DIR": "/host/claude",  # the worker's own: not a setting, not passed
    }
    s = resolve_settings({}.get, where="args", env=env)
    spec = sandbox_for(s, {})
    assert spec.env == {"A": "from-sandbox", "PIP_INDEX_URL": "http://mirror/simple"}
    assert agent_for(s).env == {"B": "from-agent", "MAX_THINKING_TOKENS": "0"}
    with pytest.raises(HookConfigError) as info:
        resolve_settings({}.get, where="args", env={**env, "TR_AGENT_ENV": '{"N": 1}'})
    assert "agent_env" in str(info.value)
