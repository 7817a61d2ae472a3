"""What each `replay reclassify` summary projection in the log holds.

The Rules page answers "which rules version produced what": per summary
projection, its rules version (and options, when a known rules set has that
version: the log records only the version, a digest of the options), the log
position it covers, and its sessions, samples and segments by kind, summed
from the stored `SessionSummary` rows exactly as `replay stats` sums a fresh
reduction. They are re-read on each view, not cached: a `reclassify` still
writing its projection grows it between views (10,000 summaries decode in
well under a second).
"""

from __future__ import annotations

from collections import Counter

import msgspec

from recorder.log.store.base import EventStore
from replay.reclassify import SUMMARY_PREFIX, SessionSummary
from replay.rules import PRESETS, Rules


class ProjectionCounts(msgspec.Struct, kw_only=True):
    """One summary projection's totals (the numbers `replay stats` prints)."""

    name: str
    rules_version: str
    covers_position: int
    sessions: int = 0
    samples: int = 0
    trainable_tokens: int = 0
    placeholders: int = 0
    segment_kinds: dict[str, int] = {}  # kept segments (not dropped), as `replay stats`
    dropped_segments: dict[str, int] = {}  # dropped segments by reason
    sample_kinds: dict[str, int] = {}
    sample_statuses: dict[str, int] = {}
    session_statuses: dict[str, int] = {}


def parse_name(name: str) -> tuple[str, int]:
    """`summary/<rules version>@<position>` -> (version, position)."""
    tag = name.removeprefix(SUMMARY_PREFIX)
    version, _, position = tag.rpartition("@")
    try:
        return version, int(position)
    except ValueError:
        return tag, 0


def known_rules(version: str, viewer: Rules) -> Rules | None:
    """The rules set (the viewer's own, then the presets) whose version is `version`."""
    for rules in (viewer, *PRESETS.values()):
        if rules.version == version:
            return rules
    return None


def count(name: str, rows: dict[str, tuple[int, str, bytes]]) -> ProjectionCounts:
    """Sum a summary projection's rows (pure)."""
    decoder = msgspec.msgpack.Decoder(SessionSummary)
    version, position = parse_name(name)
    out = ProjectionCounts(name=name, rules_version=version, covers_position=position)
    kinds: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    sample_kinds: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    sessions: Counter[str] = Counter()
    for _covers, _digest, payload in rows.values():
        s = decoder.decode(payload)
        out.sessions += 1
        out.samples += len(s.sample_kinds)
        out.trainable_tokens += s.trainable_tokens
        out.placeholders += int(s.placeholder)
        for kind, _turns, why in s.segmentation:
            if why is None:
                kinds[kind] += 1
            else:
                dropped[why] += 1
        sample_kinds.update(s.sample_kinds)
        statuses.update(s.sample_statuses)
        sessions[s.status] += 1
    out.segment_kinds = dict(sorted(kinds.items()))
    out.dropped_segments = dict(sorted(dropped.items()))
    out.sample_kinds = dict(sorted(sample_kinds.items()))
    out.sample_statuses = dict(sorted(statuses.items()))
    out.session_statuses = dict(sorted(sessions.items()))
    return out


async def projection_counts(store: EventStore) -> list[ProjectionCounts]:
    """Every summary projection in the log with its totals, oldest first."""
    names = [n for n in await store.projection_names() if n.startswith(SUMMARY_PREFIX)]
    return [count(n, await store.load_projection(n)) for n in names]
