"""What both trainer hooks share: settings, the dataset row -> task, one rollout that never raises.

Settings (each hook reads them from its trainer's own config first, then from
the environment; see `SETTINGS`):

    name            env var             default
    recorder_url    TR_RECORDER_URL     required: the recorder as this worker reaches it
    agent_base_url  TR_AGENT_BASE_URL   recorder_url: the recorder as the sandbox reaches it
    admin_token     TR_ADMIN_TOKEN      the recorder's token file (TR_ADMIN_TOKEN_FILE)
    sandbox         TR_SANDBOX          "local"; a backend name or a JSON object of
                                        SandboxSpec fields ({"backend": "e2b", "template": ...})
    agent           TR_AGENT            {}; a JSON object of AgentSpec fields (command, env, ...)
    sandbox_env     TR_SANDBOX_ENV      {}; a JSON object of variables every sandbox command gets
    agent_env       TR_AGENT_ENV        {}; a JSON object of variables the agent alone gets
    wall_budget_s   TR_WALL_BUDGET_S    1800: the whole rollout's wall-clock budget
    turn_budget     TR_TURN_BUDGET      none: at most this many agent turns
    session_metadata TR_SESSION_METADATA {}; a JSON object added to every session's metadata

The row layout (`task_row`) is the same for both trainers: slime's
`Sample.metadata` and verl's `extra_info` hold it. Nothing here talks to the
recorder itself: `recorder.rollout.driver.run_rollout` does, over HTTP.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec

from recorder.rollout.sandbox.base import SandboxSpec
from recorder.rollout.tasks import DEFAULT_TEST_CMD
from replay.samples import Sample

log = logging.getLogger(__name__)


class HookConfigError(ValueError):
    """A hook setting is missing or malformed; the message names it and where to set it."""


class Setting(msgspec.Struct, frozen=True):
    name: str
    env: str
    kind: str  # "str" | "float" | "int" | "json" | "sandbox"
    default: Any = None


SETTINGS: tuple[Setting, ...] = (
    Setting("recorder_url", "TR_RECORDER_URL", "str"),
    Setting("agent_base_url", "TR_AGENT_BASE_URL", "str"),
    Setting("admin_token", "TR_ADMIN_TOKEN", "str"),
    Setting("sandbox", "TR_SANDBOX", "sandbox", "local"),
    Setting("agent", "TR_AGENT", "json", {}),
    Setting("sandbox_env", "TR_SANDBOX_ENV", "json", {}),
    Setting("agent_env", "TR_AGENT_ENV", "json", {}),
    Setting("wall_budget_s", "TR_WALL_BUDGET_S", "float", 1800.0),
    Setting("turn_budget", "TR_TURN_BUDGET", "int"),
    Setting("session_metadata", "TR_SESSION_METADATA", "json", {}),
)


class HookSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a hook needs besides the row: plain data, so it crosses Ray boundaries."""

    recorder_url: str
    agent_base_url: str | None = None
    admin_token: str | None = None
    sandbox: SandboxSpec = SandboxSpec()
    agent: dict[str, Any] = {}
    # Nothing of the worker's own environment reaches a sandbox (see
    # recorder.rollout.sandbox.environment): what the agent needs is passed here.
    sandbox_env: dict[str, str] = {}
    agent_env: dict[str, str] = {}
    wall_budget_s: float = 1800.0
    turn_budget: int | None = None
    session_metadata: dict[str, Any] = {}


def _parse(s: Setting, raw: Any, where: str) -> Any:
    try:
        if s.kind == "str":
            return str(raw)
        if s.kind == "float":
            return float(raw)
        if s.kind == "int":
            return int(raw)
        if isinstance(raw, SandboxSpec):
            return raw
        if s.kind == "sandbox" and isinstance(raw, str) and not raw.lstrip().startswith("{"):
            return SandboxSpec(backend=raw.strip())
        value = json.loads(raw) if isinstance(raw, str | bytes) else raw
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a JSON object, got {type(value).__name__}")
        if s.kind == "sandbox":
            return msgspec.convert(dict(value), SandboxSpec)
        return dict(value)
    except json.JSONDecodeError:
        raise HookConfigError(f"{s.name} ({where}) is not valid JSON: {str(raw)[:80]!r}") from None
    except (TypeError, ValueError, msgspec.ValidationError) as exc:
        raise HookConfigError(f"{s.name} ({where}) is malformed: {exc}") from None


def resolve_settings(
    explicit: Callable[[str], Any], *, where: str, env: Mapping[str, str] | None = None
) -> HookSettings:
    """Settings from `explicit(name)` (the trainer's config; None = unset), then `env`.

    `where` names the trainer's own place for a setting in error messages,
    e.g. "--recorder-url" or "the agent-loop YAML".
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for s in SETTINGS:
        raw = explicit(s.name)
        source = f"{where} {s.name}"
        if raw is None or raw == "":
            raw, source = env.get(s.env), f"${s.env}"
        if raw is None or raw == "":
            if s.default is not None:
                values[s.name] = (
                    s.default if s.kind != "sandbox" else SandboxSpec(backend=s.default)
                )
            continue
        values[s.name] = _parse(s, raw, source)
    if not values.get("recorder_url"):
        raise HookConfigError(
            f"no recorder URL: set recorder_url ({where}) or ${SETTINGS[0].env} to the "
            "recorder as this worker reaches it, e.g. http://recorder-host:8080"
        )
    for name in ("sandbox_env", "agent_env"):
        bad = [k for k, v in values.get(name, {}).items() if not isinstance(v, str)]
        if bad:
            raise HookConfigError(f"{name}: values are strings; {', '.join(bad)} are not")
    return HookSettings(**values)


# What a session's config may force on every turn (the recorder's session
# `config.sampling`, which rejects any other key). Everything else a trainer
# hands over (verl's `logprobs`, slime's `skip_special_tokens`, ...) is the
# recorder's own business: it always asks for logprobs and exact tokens.
SAMPLING_KEYS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "max_new_tokens",
        "stop_token_ids",
    }
)


def engine_sampling(params: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer's sampling params reduced to the keys the recorder forces on every turn."""
    return {k: v for k, v in params.items() if k in SAMPLING_KEYS and v is not None}


# -- the dataset row ------------------------------------------------------------------

# Task field <- keys looked up in the row (flat first), then in remote_env_info.
_ROW_KEYS: dict[str, tuple[str, ...]] = {
    "instance_id": ("instance_id",),
    "repo": ("repo",),
    "base_commit": ("base_commit",),
    "problem_statement": ("problem_statement",),
    "setup": ("setup", "pre_commands"),
    "eval_cmd": ("eval_cmd",),
    "eval_script": ("eval_script",),
    "FAIL_TO_PASS": ("FAIL_TO_PASS",),
    "PASS_TO_PASS": ("PASS_TO_PASS",),
    "test_cmd": ("test_cmd",),
    "test_patch": ("test_patch",),
    "f2p_script": ("f2p_script",),
    "reward": ("reward_mode",),
    "eval_timeout_s": ("eval_timeout_s",),
    "setup_timeout_s": ("setup_timeout_s",),
    "image": ("image", "image_url"),
    "workdir": ("workdir",),
}
_GITHUB_SLUG = re.compile(r"^[\w.-]+/[\w.-]+$")


def prompt_text(prompt: Any) -> str:
    """The user's text from a prompt that is a string or a list of chat messages."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        for m in prompt:
            if isinstance(m, Mapping) and m.get("role") == "user":
                content = m.get("content")
                if isinstance(content, str):
                    return content
                if isinstance(content, Sequence):
                    return "".join(
                        str(b.get("text", "")) for b in content if isinstance(b, Mapping)
                    )
    return ""


def _lookup(row: Mapping[str, Any]) -> dict[str, Any]:
    remote = row.get("remote_env_info")
    remote = remote if isinstance(remote, Mapping) else {}
    found: dict[str, Any] = {}
    for field, keys in _ROW_KEYS.items():
        for source in (row, remote):
            value = next((source[k] for k in keys if source.get(k) not in (None, "")), None)
            if value is not None:
                found[field] = value
                break
    return found


def _as_list(value: Any) -> list[str]:
    """A list of strings from a list, a JSON-encoded list (SWE-bench) or lines of text."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return [str(v) for v in json.loads(text)]
        return [line for line in text.replace("\\n", "\n").splitlines() if line.strip()]
    return [str(v) for v in value]


def _grader(f: dict[str, Any]) -> dict[str, Any]:
    """Exactly one grader, by precedence: eval_cmd, eval_script, tests, f2p_script."""
    if f.get("eval_cmd"):
        return {"eval_cmd": str(f["eval_cmd"])}
    if f.get("eval_script"):
        return {"eval_script": str(f["eval_script"])}
    if f.get("FAIL_TO_PASS") or f.get("PASS_TO_PASS"):
        cmd = str(f.get("test_cmd") or DEFAULT_TEST_CMD)
        tests = {
            "tests": {
                "FAIL_TO_PASS": _as_list(f.get("FAIL_TO_PASS") or []),
                "PASS_TO_PASS": _as_list(f.get("PASS_TO_PASS") or []),
                "cmd": cmd,
            }
        }
        # SWE-bench's tests arrive as a patch: the driver applies it after the agent's
        # diff, its files restored from base_commit first (recorder.rollout.protect).
        return {**tests, "test_patch": str(f["test_patch"])} if f.get("test_patch") else tests
    if f.get("f2p_script"):
        # A self-contained pytest file ending in sys.exit(pytest.main(...)).
        return {"eval_script": f"python3 - <<'TR_F2P'\n{f['f2p_script']}\nTR_F2P\n"}
    return {}


def task_row(
    row: Mapping[str, Any] | None, *, prompt: Any = None, label: Any = None
) -> dict[str, Any]:
    """The task dict (`recorder.rollout.tasks.task_from_dict`'s input) from a dataset row.

    Three layouts, compatible with slime's coding-agent datasets:
    - `row["task"]`: a dict in task_from_dict's own layout, used as is;
    - flat: the fields at the row's top level (scaleswe shape): instance_id,
      repo, base_commit, problem_statement, setup | pre_commands, one grader
      (eval_cmd | eval_script | FAIL_TO_PASS + PASS_TO_PASS [+ test_cmd,
      test_patch]), image | image_url, workdir;
    - `row["remote_env_info"]`: the same fields one level down (SWE-bench
      shape; `f2p_script`, a self-contained pytest file, is a grader too).
    Flat keys win over remote_env_info. A missing problem statement falls back
    to the prompt's user text, a missing instance id to a short string label; a
    `owner/name` repo is a GitHub URL. `image` and `workdir` go to the task's
    metadata (`sandbox_template` picks the image up).
    """
    row = dict(row or {})
    if isinstance(row.get("task"), Mapping):
        out = dict(row["task"])
    else:
        f = _lookup(row)
        out = {
            k: f[k] for k in ("instance_id", "repo", "base_commit", "problem_statement") if k in f
        }
        out = {k: str(v) for k, v in out.items()}
        if _GITHUB_SLUG.match(out.get("repo", "")):
            out["repo"] = f"https://github.com/{out['repo']}.git"
        if "setup" in f:
            out["setup"] = _as_list(f["setup"])
        for k in ("reward", "eval_timeout_s", "setup_timeout_s"):
            if k in f:
                out[k] = f[k]
        out.update(_grader(f))
        out["metadata"] = {k: f[k] for k in ("image", "workdir") if k in f}
    if not out.get("problem_statement"):
        text = prompt_text(prompt)
        if text:
            out["problem_statement"] = text
    if not out.get("instance_id") and isinstance(label, str) and 0 < len(label) < 256:
        out["instance_id"] = label
    return out


def sandbox_for(settings: HookSettings, task: Mapping[str, Any]) -> SandboxSpec:
    """The settings' sandbox (with `sandbox_env`), booted from the row's own image when it
    names one."""
    spec = settings.sandbox
    if settings.sandbox_env:
        spec = msgspec.structs.replace(spec, env={**spec.env, **settings.sandbox_env})
    image = (task.get("metadata") or {}).get("image")
    if image and spec.backend != "local":
        return msgspec.structs.replace(spec, template=str(image))
    return spec


def agent_for(settings: HookSettings) -> Any:
    """The settings' AgentSpec, with `agent_env` on top of its own `env`."""
    from recorder.rollout.agent import AgentSpec

    agent = msgspec.convert(settings.agent, AgentSpec)
    if settings.agent_env:
        agent = msgspec.structs.replace(agent, env={**agent.env, **settings.agent_env})
    return agent


# -- MoE routing replay ------------------------------------------------------------

Routing = tuple[int, int]  # (num_layers, top_k)


def routing_problem(samples: Sequence[Sample], routing: Routing | None) -> str | None:
    """Why these samples cannot feed a trainer that replays routing (None: they can)."""
    if routing is None:
        return None
    for s in samples:
        if s.routed_experts is None and s.status not in ("aborted", "failed"):
            return (
                "routing replay is on but the recorder returned no routed experts: "
                f"start it with rules routed_experts = [{routing[0]}, {routing[1]}]"
            )
        if s.routed_experts is not None and tuple(s.routed_experts.shape[1:]) != routing:
            return (
                f"routed experts shape {s.routed_experts.shape} does not match "
                f"(num_layers, top_k) = {routing}: fix the recorder's rules"
            )
    return None


# -- one rollout --------------------------------------------------------------------


class RolloutOutcome(Protocol):
    """What a hook reads of a `recorder.rollout.driver.RolloutResult`."""

    session_id: str | None
    outcome: str  # "passed" | "failed" | "infra_error"
    reward: float
    samples: list[Sample]
    infra_cause: str | None
    evidence: dict[str, Any]
    turns: int
    timings: dict[str, float]


class HookFailure(msgspec.Struct, frozen=True, kw_only=True):
    """A rollout that could not even be run by the driver (bad row, bad config, a bug)."""

    session_id: str | None = None
    outcome: str = "infra_error"
    reward: float = 0.0
    samples: list[Sample] = []
    infra_cause: str | None = None
    evidence: dict[str, Any] = {}
    turns: int = 0
    timings: dict[str, float] = {}


def is_infra_failure(result: RolloutOutcome) -> bool:
    """True when the trainer must not learn from this rollout (no usable samples).

    That includes a rollout that passed or failed its task but whose samples are
    all the recorder's placeholders (the reducer found no usable turn, or failed):
    its reward has no trained token behind it, and must not enter its group."""
    return (
        result.outcome == "infra_error"
        or not result.samples
        or all("placeholder" in s.metadata for s in result.samples)
    )


def describe_failure(result: RolloutOutcome) -> str:
    if result.outcome != "infra_error" and result.samples:
        return f"placeholder samples: {result.samples[0].metadata.get('placeholder')}"
    cause = result.infra_cause or ("no samples" if not result.samples else result.outcome)
    return str(cause)


async def run_one(
    settings: HookSettings,
    task: Mapping[str, Any],
    *,
    sample_index: int,
    group_index: int,
    sampling: Mapping[str, Any],
    session_metadata: Mapping[str, Any],
    run: Callable[[Any], Any] | None = None,
) -> RolloutOutcome:
    """One rollout through the driver (a new session every call); never raises.

    Anything the driver cannot be asked to do (a row `task_from_dict` rejects,
    an agent spec that does not convert) and any exception escaping the driver
    becomes a `HookFailure` naming the cause. `asyncio.CancelledError` passes:
    the trainer cancelled us. `run` replaces `run_rollout` (tests only).
    """
    try:
        from recorder.rollout.driver import RolloutRequest
        from recorder.rollout.tasks import task_from_dict

        request = RolloutRequest(
            task=task_from_dict(dict(task)),
            sample_index=sample_index,
            group_index=group_index,
            sampling=engine_sampling(sampling),
            recorder_url=settings.recorder_url,
            agent_base_url=settings.agent_base_url,
            admin_token=settings.admin_token,
            sandbox=sandbox_for(settings, task),
            agent=agent_for(settings),
            wall_budget_s=settings.wall_budget_s,
            turn_budget=settings.turn_budget,
            session_metadata={**settings.session_metadata, **session_metadata},
        )
        if run is None:
            from recorder.rollout.driver import run_rollout as run
        return await run(request)
    except Exception as exc:  # a hook must never raise into the trainer
        cause = f"{type(exc).__name__}: {exc}"[:500]
        log.warning("rollout not run (%s); returning an infrastructure failure", cause)
        return HookFailure(infra_cause=cause)
