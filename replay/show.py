"""`replay show`: one session's timeline, readable in a terminal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table
from rich.text import Text

from recorder.log.events import (
    ChainDecision,
    ClampApplied,
    ClientDisconnected,
    EngineError,
    GenerateAttempt,
    GenerateResult,
    MessagesRequest,
    RecordedEvent,
    RenderedInput,
    RequestRejected,
    ResponseSent,
    RewardAssigned,
    SandboxEvent,
    SessionClosed,
    SessionFailed,
    SessionOpened,
    TitoVerdict,
    TurnAborted,
    TurnFailed,
    TurnResumed,
)
from replay.samples import SessionResult

_STYLES = {
    "session_opened": "bold cyan",
    "session_closed": "bold cyan",
    "messages_request": "bold",
    "generate_result": "green",
    "turn_aborted": "yellow",
    "turn_resumed": "yellow",
    "tito_verdict": "magenta",
    "turn_failed": "red",
    "engine_error": "red",
    "session_failed": "bold red",
    "client_disconnected": "red",
    "request_rejected": "red",
    "reward_assigned": "bold green",
}


def _short(text: str, n: int = 12) -> str:
    return text if len(text) <= n else text[:n] + "…"


def describe(ev: Any) -> str:
    """A one-line summary of an event's payload."""
    match ev:
        case SessionOpened():
            meta = ", ".join(f"{k}={v}" for k, v in sorted(ev.metadata.items()))
            return f"attempt {ev.attempt}; context {ev.context_length}; {meta}"
        case SessionClosed():
            return f"{ev.status} {ev.reason}".strip()
        case SessionFailed():
            return f"{ev.where}: {ev.error_type}: {ev.message}"
        case MessagesRequest():
            results = f"; tool_results {list(ev.tool_result_ids)}" if ev.tool_result_ids else ""
            return f"{ev.n_messages} messages; system {_short(ev.system_digest, 8)}{results}"
        case ChainDecision():
            parent = f" from {ev.parent_chain_id}" if ev.parent_chain_id is not None else ""
            dispatch = f" dispatch {ev.dispatch_tool_use_id}" if ev.dispatch_tool_use_id else ""
            return f"{ev.action} chain {ev.chain_id} ({ev.reason}){parent}{dispatch}"
        case ClampApplied():
            return f"max_new_tokens {ev.requested} -> {ev.clamped_to} (context {ev.context_length})"
        case RenderedInput():
            n = ev.input_ids.length
            return f"{n} input tokens ({ev.prefix_len} reused, {n - ev.prefix_len} new)"
        case GenerateAttempt():
            resumed = f"; resumes {ev.resumed_tokens} tokens" if ev.resumed_tokens else ""
            return f"attempt {ev.attempt}; max_new_tokens {ev.max_new_tokens}{resumed}"
        case GenerateResult():
            lp = "" if ev.logprobs is not None else "; NO LOGPROBS"
            return (
                f"attempt {ev.attempt}: {ev.output_ids.length} tokens, {ev.finish_reason}; "
                f"weights {ev.weight_version or '?'}; cached {ev.cached_tokens}{lp}"
            )
        case TurnAborted():
            return f"attempt {ev.attempt} aborted after {ev.partial_tokens} tokens {ev.message}"
        case TurnResumed():
            return f"attempt {ev.attempt}: +{ev.resumed_tokens} resumed, {ev.remaining_new_tokens} left"
        case TurnFailed():
            return ev.reason
        case EngineError():
            return f"{ev.kind} {ev.status} {ev.message}".strip()
        case ClientDisconnected():
            return f"rid {ev.rid}" if ev.rid else ""
        case TitoVerdict():
            return "ok" if ev.ok else f"MISMATCH at output token {ev.first_divergence}"
        case ResponseSent():
            blocks = ", ".join(
                f"tool_use {b.get('name')}" if b.get("type") == "tool_use" else str(b.get("type"))
                for b in ev.content
            )
            parser = f"; parser {ev.parser}" if ev.parser else ""
            return f"{ev.stop_reason}: [{blocks}]{parser}"
        case RequestRejected():
            return f"{ev.status} {ev.error_type}: {ev.message}"
        case RewardAssigned():
            return f"{ev.reward}"
        case SandboxEvent():
            return f"{ev.kind} {ev.detail}" if ev.detail else ev.kind
    return ""


def timeline_table(events: Sequence[RecordedEvent], session_id: str) -> Table:
    table = Table(title=f"session {session_id}", show_lines=False)
    table.add_column("seq", justify="right")
    table.add_column("turn", justify="right")
    table.add_column("event")
    table.add_column("detail", overflow="fold")
    for rec in sorted(events, key=lambda e: e.seq):
        turn = getattr(rec.event, "turn", None)
        table.add_row(
            str(rec.seq),
            "" if turn is None else str(turn),
            rec.type,
            Text(describe(rec.event)),
            style=_STYLES.get(rec.type, ""),
        )
    return table


def segments_table(result: SessionResult) -> Table:
    table = Table(title=f"samples under rules {result.rules_version} ({result.status})")
    for col in ("#", "kind", "turns", "tokens", "trainable", "status", "reward", "note"):
        table.add_column(col, justify="right" if col in ("#", "tokens", "trainable") else "left")
    for i, s in enumerate(result.samples):
        meta = s.metadata
        turns = meta.get("turns", [])
        span = f"{turns[0]}–{turns[-1]}" if turns else ""
        note = meta.get("placeholder") or ", ".join(meta.get("truncated", []))
        table.add_row(
            str(i),
            str(meta.get("segment_kind", "placeholder")),
            span,
            str(len(s.tokens)),
            str(sum(s.loss_mask)),
            s.status,
            f"{s.reward:g}",
            Text(str(note or "")),
        )
    return table
