"""Rules: defaults, digests, presets and files."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from replay.rules import PRESETS, REDUCER_VERSION, Rules, RulesError, load_rules

# A different value for every option: each must change the digest.
CHANGED = {
    "mask_tito_failed": False,
    "stale_weight_tokens": "mask",
    "sample_mode": "collapse_to_final",
    "reward_mode": "copy",
    "max_segments": 3,
    "max_segment_tokens": 1000,
    "over_segment_cap": "truncate",
    "context_length": 4096,
    "routed_experts": (48, 8),
    "pad_token_id": 7,
    "dispatch_tool_names": ("Agent",),
    "orphan_chains": "drop",
    "placeholder_unclosed": False,
    "side_requests": "train",
}


def test_defaults() -> None:
    r = Rules()
    assert r.mask_tito_failed is True
    assert r.stale_weight_tokens == "keep"
    assert r.sample_mode == "fan_out"
    assert r.reward_mode == "uniform"
    assert r.max_segments == 8
    assert r.max_segment_tokens is None and r.over_segment_cap == "drop"
    assert r.context_length is None and r.routed_experts is None and r.pad_token_id is None
    assert r.dispatch_tool_names == ("Agent", "Task")
    assert r.orphan_chains == "main" and r.placeholder_unclosed is True
    assert r.side_requests == "drop"


def test_every_option_is_covered_by_this_test() -> None:
    fields = set(Rules.__struct_fields__) - {"name"}
    assert fields == set(CHANGED)


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_every_option_changes_the_digest(field: str) -> None:
    base = Rules()
    changed = msgspec.structs.replace(base, **{field: CHANGED[field]})
    assert changed.digest != base.digest
    assert changed.version != base.version


def test_name_does_not_change_the_digest_and_version_carries_reducer_version() -> None:
    assert Rules(name="x").digest == Rules(name="y").digest
    assert Rules().version == f"r{REDUCER_VERSION}-{Rules().digest}"
    assert len(Rules().digest) == 16


def test_rules_are_frozen_and_hashable() -> None:
    r = Rules()
    with pytest.raises(AttributeError):
        r.max_segments = 2  # type: ignore[misc]
    assert hash(r) == hash(Rules())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_segments": 0},
        {"max_segment_tokens": 1},
        {"context_length": 1},
        {"routed_experts": (0, 8)},
        {"pad_token_id": -1},
    ],
)
def test_invalid_values_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(RulesError):
        Rules(**kwargs)  # type: ignore[arg-type]


def test_presets_load_by_name() -> None:
    assert load_rules(None) == PRESETS["default"]
    assert load_rules("collapse-final").sample_mode == "collapse_to_final"
    assert load_rules("strict-onpolicy").stale_weight_tokens == "mask"
    assert load_rules("final-reward").reward_mode == "final_only"
    assert len({p.digest for p in PRESETS.values()}) == len(PRESETS)


def test_unknown_preset_names_the_presets() -> None:
    with pytest.raises(RulesError, match="collapse-final"):
        load_rules("nope")


def test_toml_file_overrides_a_preset(tmp_path: Path) -> None:
    f = tmp_path / "mine.toml"
    f.write_text('preset = "collapse-final"\nreward_mode = "copy"\nrouted_experts = [48, 8]\n')
    r = load_rules(str(f))
    assert r.name == "mine"
    assert r.sample_mode == "collapse_to_final" and r.reward_mode == "copy"
    assert r.routed_experts == (48, 8)


def test_json_file(tmp_path: Path) -> None:
    f = tmp_path / "r.json"
    f.write_text('{"max_segments": 2, "name": "two"}')
    r = load_rules(str(f))
    assert r.name == "two" and r.max_segments == 2


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("max_segmnets = 3\n", "max_segmnets"),
        ('reward_mode = "half"\n', "reward_mode"),
        ("max_segments = 0\n", "max_segments"),
        ('preset = "zzz"\n', "unknown preset"),
        ("this is not toml", "not valid"),
    ],
)
def test_bad_rules_files_say_what_is_wrong(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(RulesError, match=match):
        load_rules(str(f))


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RulesError, match="cannot read"):
        load_rules(str(tmp_path / "absent.toml"))
