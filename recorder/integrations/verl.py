"""verl hook (0.9.1): `RecorderAgentLoop`, registered as agent_name "recorder".

Select it per dataset row with `agent_name: recorder` (or make it
`actor_rollout_ref.rollout.agent.default_agent_loop`). Configure it in verl's
agent-loop YAML (`actor_rollout_ref.rollout.agent.agent_loop_config_path`),
whose entries verl hands to `hydra.utils.instantiate`; loading that YAML also
imports this module in every agent-loop worker (at the first trajectory, through
`hydra.utils.instantiate`), which registers "recorder" only if verl's registry
does not hold that name yet: an entry the YAML already put there keeps its
fields (see `register_unless_held`):

    - name: recorder
      _target_: recorder.integrations.verl.RecorderAgentLoop
      recorder_url: http://recorder-host:8080     # or $TR_RECORDER_URL
      sandbox: '{"backend": "e2b", "template": "swe-base"}'
      wall_budget_s: 1800
      trainer_mode: auto                          # auto | v1 | legacy
      routed_experts: null                        # [num_layers, top_k] with routing replay
      sampling: {max_new_tokens: 8192}            # forced on every turn

Every other setting of `recorder.integrations.common.SETTINGS` may appear
there too, else comes from its `TR_*` environment variable.

`run` does one recorded rollout (a new recorder session per call) and converts
its samples with `recorder.integrations.verl_outputs` (see there for the field
mapping, clipping and what each trainer mode gets). The trainer mode is
`trainer.use_v1` of verl's own config unless `trainer_mode` says otherwise; a
`trainer_mode` that contradicts `trainer.use_v1` is a configuration error
raised when verl builds the loop. `run` itself never raises: an
infrastructure failure is `[]` under v1 and one fully masked output with
`extra_fields["recorder_failed"] = True` under the legacy trainer.

The task comes from the row's `extra_info` (the layout of
`recorder.integrations.common.task_row`), the problem statement falling back
to the row's `raw_prompt`. Group members (verl's `rollout.n` copies of a row)
share the row's `index` as the recorder's group index.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    _agent_loop_registry,
    register,
)

from recorder.integrations.common import (
    HookConfigError,
    HookSettings,
    resolve_settings,
    run_one,
    task_row,
)
from recorder.integrations.verl_outputs import (
    Limits,
    Mode,
    OutputFields,
    Routing,
    failed_fields,
    outputs_for,
)

log = logging.getLogger(__name__)

AGENT_NAME = "recorder"


def detect_mode(config: Any, option: str) -> Mode:
    """v1 or legacy, from verl's `trainer.use_v1` and the loop's `trainer_mode` option."""
    use_v1 = (config.get("trainer") or {}).get("use_v1", True)
    detected: Mode = "v1" if use_v1 else "legacy"
    if option in ("", "auto"):
        return detected
    if option not in ("v1", "legacy"):
        raise HookConfigError(f"trainer_mode must be auto, v1 or legacy, got {option!r}")
    if option != detected:
        raise HookConfigError(
            f"trainer_mode: {option} in the agent-loop YAML, but trainer.use_v1={bool(use_v1)} "
            f"runs the {detected} trainer: set trainer_mode: auto (or {detected})"
        )
    return detected


def routing_option(config: Any, option: Any) -> Routing | None:
    """(num_layers, top_k) when verl replays MoE routing; then the YAML must name them."""
    rollout = config.actor_rollout_ref.rollout
    if not rollout.get("enable_rollout_routing_replay", False):
        return None
    if option is None or len(option) != 2:
        raise HookConfigError(
            "rollout.enable_rollout_routing_replay is on: set routed_experts: "
            "[num_layers, top_k] in the recorder's agent-loop YAML entry (the recorder's "
            "rules need the same routed_experts)"
        )
    return int(option[0]), int(option[1])


def _plain(value: Any) -> Any:
    """YAML values arrive as OmegaConf containers; the settings parser wants plain data."""
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _group_index(kwargs: Mapping[str, Any]) -> int:
    extra = kwargs.get("extra_info") or {}
    for value in (kwargs.get("index"), extra.get("index")):
        try:
            return int(value)
        except (TypeError, ValueError):
            continue
    key = str(kwargs.get("uid", "")).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=6).digest(), "big")


def _sample_index(kwargs: Mapping[str, Any]) -> int:
    """v1 passes the rollout's position among the row's `rollout.n` copies as `session_id`."""
    try:
        return int(kwargs.get("session_id", 0))
    except (TypeError, ValueError):
        return 0


class RecorderAgentLoop(AgentLoopBase):
    """One recorded coding-agent rollout per call, as verl agent-loop outputs."""

    def __init__(
        self,
        trainer_config: Any,
        server_manager: Any,
        tokenizer: Any,
        processor: Any,
        dataset_cls: Any,
        data_config: Any,
        hf_model_type: str | None = None,
        *,
        trainer_mode: str = "auto",
        routed_experts: Any = None,
        sampling: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(
            trainer_config,
            server_manager,
            tokenizer,
            processor,
            dataset_cls,
            data_config,
            hf_model_type=hf_model_type,
        )
        self.mode: Mode = detect_mode(self.config, str(trainer_mode))
        self.routing = routing_option(self.config, routed_experts)
        self.sampling = dict(_plain(sampling) or {})
        plain = {k: _plain(v) for k, v in options.items()}
        self.settings: HookSettings = resolve_settings(
            lambda name: plain.get(name), where="the agent-loop YAML entry"
        )
        self.limits = Limits(
            prompt_length=int(self.rollout_config.prompt_length),
            response_length=int(self.rollout_config.response_length),
        )
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.pad_token_id = int(pad or 0)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        """One rollout: v1 -> list[AgentLoopOutput] (final last), legacy -> one output."""
        steps = kwargs.get("global_steps")
        steps = int(steps) if steps is not None else None
        try:
            return self._outputs(await self._rollout(sampling_params, kwargs), steps)
        except Exception as exc:  # never raise into verl's gather
            log.exception("recorder agent loop failed")
            reason = f"{type(exc).__name__}: {exc}"[:500]
            if self.mode == "v1":
                return []
            fields = failed_fields(
                reason, pad_token_id=self.pad_token_id, routing=self.routing, global_steps=steps
            )
            return self._output(fields)

    async def _rollout(self, sampling_params: Mapping[str, Any], kwargs: Mapping[str, Any]) -> Any:
        extra = kwargs.get("extra_info") or {}
        row = task_row(extra, prompt=kwargs.get("raw_prompt"))
        metadata = {
            "trainer": "verl",
            "trainer_mode": self.mode,
            "verl_uid": str(kwargs["uid"]) if kwargs.get("uid") is not None else None,
            "verl_index": kwargs.get("index"),
        }
        return await run_one(
            self.settings,
            row,
            sample_index=_sample_index(kwargs),
            group_index=_group_index(kwargs),
            sampling={**sampling_params, **self.sampling},
            session_metadata={k: v for k, v in metadata.items() if v is not None},
        )

    def _outputs(self, result: Any, global_steps: int | None) -> Any:
        fields = outputs_for(
            result,
            mode=self.mode,
            limits=self.limits,
            pad_token_id=self.pad_token_id,
            routing=self.routing,
            global_steps=global_steps,
        )
        outputs = [self._output(f) for f in fields]
        return outputs if self.mode == "v1" else outputs[0]

    @staticmethod
    def _output(f: OutputFields) -> AgentLoopOutput:
        return AgentLoopOutput(
            prompt_ids=f.prompt_ids,
            response_ids=f.response_ids,
            response_mask=f.response_mask,
            response_logprobs=f.response_logprobs,
            routed_experts=f.routed_experts,
            reward_score=f.reward_score,
            num_turns=f.num_turns,
            metrics=AgentLoopMetrics(**f.metrics),
            extra_fields=f.extra_fields,
        )


def register_unless_held(name: str = AGENT_NAME) -> None:
    """Add the bare `{_target_: ...}` entry for `name` unless verl already holds one.

    verl's `AgentLoopWorker.__init__` loads the agent-loop YAML into its registry
    before the first trajectory, and only that trajectory's `instantiate`
    imports this module; verl's `@register` would then replace the YAML entry
    with a bare one, so every later trajectory of the worker would run without
    the YAML's settings (no recorder URL, other sampling). The entry verl holds
    is the user's configuration: it always wins.
    """
    if name not in _agent_loop_registry:
        register(name)(RecorderAgentLoop)


register_unless_held()
