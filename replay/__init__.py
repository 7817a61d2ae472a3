"""Replay: rebuild training samples from the event log with a deterministic reducer.

The live server calls `close_session_samples` when a session closes; `replay
reclassify` runs the same load + reduce path over a whole log, so live samples
equal offline samples byte for byte.

The storage side (`load_session`, `iter_session_logs`, `SessionLog`) is imported
on first use: a trainer's worker that only reads `replay.samples` or runs the
reducer never loads SQLAlchemy and the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from replay.reducer import reduce_session
from replay.rules import PRESETS, Rules, RulesError, load_rules
from replay.samples import (
    Sample,
    SessionResult,
    check_invariants,
    decode_result,
    encode_result,
    result_bytes,
    result_digest,
)

if TYPE_CHECKING:
    from recorder.log.store.base import EventStore
    from replay.load import SessionLog, iter_session_logs, load_session

_LAZY = {"SessionLog", "iter_session_logs", "load_session"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from replay import load

        return getattr(load, name)
    raise AttributeError(f"module 'replay' has no attribute {name!r}")


__all__ = [
    "PRESETS",
    "Rules",
    "RulesError",
    "Sample",
    "SessionLog",
    "SessionResult",
    "check_invariants",
    "close_session_samples",
    "decode_result",
    "encode_result",
    "iter_session_logs",
    "load_rules",
    "load_session",
    "reduce_log",
    "reduce_session",
    "result_bytes",
    "result_digest",
]


def reduce_log(log: SessionLog, rules: Rules) -> SessionResult:
    """Reduce a loaded session (the one code path for live and offline)."""
    return reduce_session(log.events, log.arrays, rules)


async def close_session_samples(
    store: EventStore, session_id: str, rules: Rules | None = None
) -> SessionResult:
    """Samples for a session, from its events in the store (call after SessionClosed
    and RewardAssigned are appended: a session without SessionClosed yields
    placeholders under the default rules)."""
    from replay.load import load_session

    rules = rules or Rules()
    log = await load_session(store, session_id, routed_experts=rules.routed_experts is not None)
    return reduce_log(log, rules)
