"""Sample-construction rules: every choice the reducer makes is a named option here.

A `Rules` value is frozen and hashable; its `digest` covers every field except
the display `name`, so two configs that build the same samples share a
digest, and any change of any option changes it. `version` ties the digest to
the reducer's own semantics version (bumped when the code changes meaning).

Rules come from a preset name (`default`, `collapse-final`, ...) or a TOML /
JSON file whose keys are `Rules` fields; a file may name a `preset` to start
from and override only some fields.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

# Bump when the reducer changes what it builds from the same log and rules.
# 5: a turn sampled under a grammar (json_schema, regex) is masked
# 6: a request never extends the repeat of an answer it carries a twin of (a retry answered
#    alike) and of equal chains takes the one whose answer it carries; a re-sent first
#    subagent request starts another subagent only as the recorder decided
REDUCER_VERSION = "6"
# 4: acted-on answers of a branch left are trained; without tools,
# the main line is the conversation carrying the work (replay.chains)
# 3: no false forks, side segments, final never dropped (replay.chains)

SampleMode = Literal["fan_out", "collapse_to_final"]
RewardMode = Literal["uniform", "copy", "final_only"]
StaleWeightTokens = Literal["keep", "mask"]
OverCap = Literal["drop", "truncate"]
OrphanChains = Literal["main", "drop"]
SideRequests = Literal["drop", "train"]


class Rules(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How samples are built from a session's events."""

    name: str = "default"
    # Turns whose output failed decode -> re-encode get loss_mask 0.
    mask_tito_failed: bool = True
    # Tokens of an aborted + resumed turn produced under an older weight
    # version than the turn's last attempt: keep them trainable or mask them.
    stale_weight_tokens: StaleWeightTokens = "keep"
    # One sample per segment, or only the final main-line segment.
    sample_mode: SampleMode = "fan_out"
    # How the session reward is spread over the K samples of a session:
    # uniform = reward / K each, copy = reward each, final_only = the final
    # segment's sample gets the reward, the others 0.
    reward_mode: RewardMode = "uniform"
    # At most this many samples per session: the first (cap - 1) in
    # chronological order plus the final one. None = no cap.
    max_segments: int | None = 8
    # Per-segment total-token cap: drop the segment or truncate its tail.
    max_segment_tokens: int | None = None
    over_segment_cap: OverCap = "drop"
    # Context budget for one sample's total length. None = the session's
    # recorded context length (SessionOpened.context_length), if any.
    context_length: int | None = None
    # MoE routing replay: (num_layers, top_k) of the model, or None for off.
    routed_experts: tuple[int, int] | None = None
    # Pad id for placeholders. None = the session tokenizer's pad id, then its
    # first EOS id, then 0.
    pad_token_id: int | None = None
    # Tool names whose tool_use on the main line dispatches a subagent.
    dispatch_tool_names: tuple[str, ...] = ("Agent", "Task")
    # A new chain with a foreign system prompt and no pending dispatch:
    # treat it as main line (seed 004's fallback) or leave it out.
    orphan_chains: OrphanChains = "main"
    # Side requests (a title or classification request: no tools, its own
    # system prompt) are `side` segments: left out, or trained like the rest.
    side_requests: SideRequests = "drop"
    # Sessions without SessionClosed (crashed server, still open at the end of
    # the log) yield placeholders when True; otherwise they are reduced as is.
    placeholder_unclosed: bool = True

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def digest(self) -> str:
        """Hash of every option but `name` (16 hex chars)."""
        fields = msgspec.structs.asdict(self)
        fields.pop("name")
        payload = msgspec.msgpack.Encoder(order="deterministic").encode(fields)
        return hashlib.blake2b(payload, digest_size=8).hexdigest()

    @property
    def version(self) -> str:
        """Reducer semantics version + config digest, e.g. `r2-0123abcd...`."""
        return f"r{REDUCER_VERSION}-{self.digest}"

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


class RulesError(ValueError):
    """A rules file or name could not be used."""


def _validate(rules: Rules) -> None:
    if rules.max_segments is not None and rules.max_segments < 1:
        raise RulesError(f"max_segments must be >= 1 or null, got {rules.max_segments}")
    if rules.max_segment_tokens is not None and rules.max_segment_tokens < 2:
        raise RulesError(
            f"max_segment_tokens must be >= 2 (one prompt + one response token) or null, "
            f"got {rules.max_segment_tokens}"
        )
    if rules.context_length is not None and rules.context_length < 2:
        raise RulesError(f"context_length must be >= 2 or null, got {rules.context_length}")
    if rules.routed_experts is not None and min(rules.routed_experts) < 1:
        raise RulesError(
            f"routed_experts must be (num_layers, top_k) with both >= 1, got {rules.routed_experts}"
        )
    if rules.pad_token_id is not None and rules.pad_token_id < 0:
        raise RulesError(f"pad_token_id must be >= 0, got {rules.pad_token_id}")


PRESETS: dict[str, Rules] = {
    "default": Rules(),
    # One sample per session (the final chain): bounded trainer batch size.
    "collapse-final": Rules(name="collapse-final", sample_mode="collapse_to_final"),
    # Strictly on-policy tokens: mask tokens from an older weight version.
    "strict-onpolicy": Rules(name="strict-onpolicy", stale_weight_tokens="mask"),
    # Fan out, but only the final segment carries the reward.
    "final-reward": Rules(name="final-reward", reward_mode="final_only"),
}


def load_rules(spec: str | None) -> Rules:
    """Rules from a preset name or a `.toml` / `.json` file path (None = default)."""
    if spec is None or spec == "":
        return PRESETS["default"]
    path = Path(spec)
    if path.suffix.lower() in (".toml", ".json") or path.exists():
        return rules_from_file(path)
    try:
        return PRESETS[spec]
    except KeyError:
        raise RulesError(
            f"unknown rules {spec!r}: give a preset name ({', '.join(PRESETS)}) "
            "or a path to a .toml/.json rules file"
        ) from None


def rules_from_file(path: Path) -> Rules:
    try:
        text = path.read_text()
    except OSError as exc:
        raise RulesError(f"cannot read rules file {path}: {exc}") from None
    try:
        raw = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise RulesError(
            f"rules file {path} is not valid {path.suffix[1:] or 'TOML'}: {exc}"
        ) from None
    return rules_from_mapping(raw, source=str(path))


def rules_from_mapping(raw: dict[str, Any], *, source: str = "<mapping>") -> Rules:
    """Rules from a dict; key `preset` picks the base, other keys override it."""
    raw = dict(raw)
    base_name = raw.pop("preset", "default")
    if base_name not in PRESETS:
        raise RulesError(f"{source}: unknown preset {base_name!r} (known: {', '.join(PRESETS)})")
    merged = PRESETS[base_name].to_dict()
    merged.setdefault("name", base_name)
    if "name" not in raw:
        raw["name"] = Path(source).stem if source != "<mapping>" else base_name
    merged.update(raw)
    try:
        return msgspec.convert(merged, Rules)
    except msgspec.ValidationError as exc:
        raise RulesError(f"{source}: {exc}") from None
