"""Turns: a session's events grouped per engine call, with their arrays resolved.

Part of the pure reducer (see `replay.reducer`): no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np

from recorder.log.events import (
    ChainDecision,
    ClientDisconnected,
    EngineError,
    GenerateAttempt,
    GenerateResult,
    MessagesRequest,
    RecordedEvent,
    RenderedInput,
    ResponseSent,
    RewardAssigned,
    SessionClosed,
    SessionFailed,
    SessionOpened,
    TitoVerdict,
    TurnAborted,
    TurnFailed,
)
from replay.rules import Rules


@dataclass(slots=True, eq=False)
class Turn:
    turn: int
    request_id: str
    first_seq: int
    seqs: list[int] = field(default_factory=list)
    request: MessagesRequest | None = None
    decision: ChainDecision | None = None
    rendered: RenderedInput | None = None
    results: dict[int, GenerateResult] = field(default_factory=dict)
    aborts: int = 0
    tito: TitoVerdict | None = None
    response: ResponseSent | None = None
    failed: str | None = None
    interrupted: str | None = None
    # Derived by prepare_turn when usable:
    unusable: str | None = None
    input: np.ndarray | None = None
    output: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    mask: np.ndarray | None = None
    versions: list[tuple[int, int, str]] = field(default_factory=list)
    routed: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    finish_reason: str = "unknown"
    tito_masked: bool = False
    stale_masked: int = 0
    # An attempt sampled under a grammar (a JSON schema, regex, EBNF): its tokens came
    # from a constrained distribution, not the policy's, and are not trained.
    constrained: bool = False

    @property
    def system_digest(self) -> str | None:
        if self.request is None or not self.request.system_digest:
            return None
        return self.request.system_digest


@dataclass(slots=True, eq=False)
class SessionFacts:
    session_id: str
    opened: SessionOpened | None
    closed: SessionClosed | None
    failures: list[SessionFailed]
    reward: float | None
    turns: list[Turn]
    diagnostics: list[str]


_seq_order = attrgetter("seq", "position")


def _window(events: Sequence[RecordedEvent]) -> tuple[list[RecordedEvent], list[str]]:
    """Events in seq order from the last SessionOpened on.

    Nothing before it may influence the result, not even a diagnostic: a
    stream that starts at the re-open must reduce to the same bytes.
    """
    ordered = sorted(events, key=_seq_order)
    for i in range(len(ordered) - 1, -1, -1):
        if isinstance(ordered[i].event, SessionOpened):
            return ordered[i:], []
    return ordered, ["no SessionOpened event: reducing the whole stream"]


def collect_session(events: Sequence[RecordedEvent]) -> SessionFacts:
    window, diags = _window(events)
    session_id = window[0].session_id if window else (events[0].session_id if events else "")
    opened: SessionOpened | None = None
    closed: SessionClosed | None = None
    failures: list[SessionFailed] = []
    reward: float | None = None
    turns: dict[tuple[int, str], Turn] = {}
    for rec in window:
        ev = rec.event
        kind = type(ev)
        absorb = _ABSORB.get(kind)
        if absorb is not None:  # a turn event of an exact class: most of a session
            if ev.turn is None or ev.request_id is None:
                continue
            key = (int(ev.turn), str(ev.request_id))
            t = turns.get(key)
            if t is None:
                t = turns[key] = Turn(turn=key[0], request_id=key[1], first_seq=rec.seq)
            t.seqs.append(rec.seq)
            absorb(t, ev, diags)
            continue
        if kind is SessionOpened or isinstance(ev, SessionOpened):
            opened = ev
            continue
        if kind is SessionClosed or isinstance(ev, SessionClosed):
            closed = ev
            continue
        if isinstance(ev, SessionFailed):
            failures.append(ev)
            continue
        if isinstance(ev, RewardAssigned):
            reward = float(ev.reward)
            continue
        turn_no = getattr(ev, "turn", None)
        request_id = getattr(ev, "request_id", None)
        if turn_no is None or request_id is None:
            continue
        key = (int(turn_no), str(request_id))
        t = turns.get(key)
        if t is None:
            t = turns[key] = Turn(turn=key[0], request_id=key[1], first_seq=rec.seq)
        t.seqs.append(rec.seq)
        _absorb(t, ev, diags)
    ordered = sorted(turns.values(), key=lambda t: (t.first_seq, t.turn, t.request_id))
    return SessionFacts(session_id, opened, closed, failures, reward, ordered, diags)


def _request(t: Turn, ev: MessagesRequest, diags: list[str]) -> None:
    t.request = t.request or ev


def _decision(t: Turn, ev: ChainDecision, diags: list[str]) -> None:
    t.decision = t.decision or ev


def _rendered(t: Turn, ev: RenderedInput, diags: list[str]) -> None:
    if t.rendered is not None:
        diags.append(f"turn {t.turn}: more than one RenderedInput; the first is used")
    t.rendered = t.rendered or ev


def _result(t: Turn, ev: GenerateResult, diags: list[str]) -> None:
    if ev.attempt in t.results:
        diags.append(f"turn {t.turn}: duplicate result for attempt {ev.attempt}; first kept")
    else:
        t.results[ev.attempt] = ev


# SGLang's sampling parameters that constrain decoding to a grammar.
CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")


def _attempt(t: Turn, ev: GenerateAttempt, diags: list[str]) -> None:
    if any(ev.sampling_params.get(k) is not None for k in CONSTRAINTS):
        t.constrained = True


def _aborted(t: Turn, ev: TurnAborted, diags: list[str]) -> None:
    t.aborts += 1


def _tito(t: Turn, ev: TitoVerdict, diags: list[str]) -> None:
    t.tito = t.tito or ev


def _response(t: Turn, ev: ResponseSent, diags: list[str]) -> None:
    t.response = t.response or ev


def _failed(t: Turn, ev: TurnFailed, diags: list[str]) -> None:
    t.failed = t.failed or ev.reason or "turn failed"


def _engine_error(t: Turn, ev: EngineError, diags: list[str]) -> None:
    t.interrupted = t.interrupted or f"engine error ({ev.kind} {ev.status})"


def _disconnected(t: Turn, ev: ClientDisconnected, diags: list[str]) -> None:
    t.interrupted = t.interrupted or "client disconnected"


# What each turn event tells its turn. Looked up by the event's exact class (a
# session has hundreds of events); a subclass goes through `_absorb`.
_ABSORB: dict[type, Callable[[Turn, Any, list[str]], None]] = {
    MessagesRequest: _request,
    ChainDecision: _decision,
    RenderedInput: _rendered,
    GenerateResult: _result,
    GenerateAttempt: _attempt,
    TurnAborted: _aborted,
    TitoVerdict: _tito,
    ResponseSent: _response,
    TurnFailed: _failed,
    EngineError: _engine_error,
    ClientDisconnected: _disconnected,
}


def _absorb(t: Turn, ev: Any, diags: list[str]) -> None:
    for kind, absorb in _ABSORB.items():
        if isinstance(ev, kind):
            absorb(t, ev, diags)
            return


class IdChecks:
    """Which token-id buffers hold no negative id, each scanned once per session
    (and whether the session's logprobs are all valid: `logprobs_ok`).

    A session's inputs (and the outputs found in them) are views of one
    buffer (`replay.load`: the store assembles prefixes once), so checking
    every input alone scanned that buffer again for each turn: quadratic in
    the turns. A view whose every base is an array of its dtype holds only
    elements of its root buffer, so a root without a negative id clears it;
    otherwise (a root with one, or no such root) the view itself is scanned.
    """

    def __init__(self, logprobs: Sequence[np.ndarray] = ()) -> None:
        # id(root) -> (root, no negative id in it); the root is held so its id stays its own.
        self._roots: dict[int, tuple[np.ndarray, bool]] = {}
        # The session's float logprob arrays, checked together on first use
        # (`logprobs_ok`); held so their ids stay their own.
        self._logprobs = [a for a in logprobs if a.ndim == 1 and a.dtype.kind == "f"]
        self._clean_logprobs: set[int] | None = None

    def non_negative(self, a: np.ndarray) -> bool:
        root = _same_dtype_root(a)
        if root is not None:
            seen = self._roots.get(id(root))
            if seen is None:
                seen = self._roots[id(root)] = (root, _min_ok(root))
            if seen[1]:
                return True
        return _min_ok(a)

    def logprobs_ok(self, stored: np.ndarray, lp: np.ndarray) -> bool:
        """`_logprobs_ok(lp)`, where `lp` is the stored array `stored` as float64.

        A session's logprobs are one small array per attempt, and two
        reductions each cost more than the few hundred values they scan: all
        of the session's arrays given at construction are checked in one
        pass, and when they all pass, any of them passes without a scan.
        Widening float32 to float64 keeps every value's sign, NaN and
        infinities, so the stored array passes exactly when `lp` does.
        """
        if self._clean_logprobs is None:
            joined = np.concatenate(self._logprobs) if self._logprobs else np.zeros(0)
            clean = _logprobs_ok(joined)
            self._clean_logprobs = {id(a) for a in self._logprobs} if clean else set()
        return id(stored) in self._clean_logprobs or _logprobs_ok(lp)


def _logprobs_ok(lp: np.ndarray) -> bool:
    """Each logprob in -inf < lp <= 0: NaN fails both comparisons, +inf the first."""
    return lp.size == 0 or (float(lp.max()) <= 0.0 and float(lp.min()) > -np.inf)


def _min_ok(a: np.ndarray) -> bool:
    return a.size == 0 or int(a.min()) >= 0


def _same_dtype_root(a: np.ndarray) -> np.ndarray | None:
    """The array owning `a`'s data if every base between them has `a`'s dtype."""
    if a.strides[0] % a.itemsize:
        return None
    root = a
    while root.base is not None:
        base = root.base
        if not isinstance(base, np.ndarray) or base.dtype != a.dtype:
            return None
        root = base
    return root if root is not a else None


def session_logprobs(turns: Sequence[Turn], arrays: Mapping[bytes, np.ndarray]) -> list[np.ndarray]:
    """Every stored logprobs array the turns' attempts name (for `IdChecks`)."""
    out = []
    for t in turns:
        for r in t.results.values():
            if r.logprobs is not None:
                a = arrays.get(r.logprobs.digest)
                if a is not None:
                    out.append(a)
    return out


def _as_ids(arr: Any, checks: IdChecks | None = None) -> np.ndarray:
    a = np.asarray(arr)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"token ids must be a 1-D integer array, got {a.dtype}{list(a.shape)}")
    if not (checks.non_negative(a) if checks is not None else _min_ok(a)):
        raise ValueError("negative token id")
    # Kept in the stored dtype: a session's inputs are views of one buffer
    # (the store assembles prefixes once), and a conversion would copy each.
    return a


def prepare_turn(
    t: Turn, arrays: Mapping[bytes, np.ndarray], rules: Rules, checks: IdChecks | None = None
) -> None:
    """Resolve a turn's arrays and masks, or set `t.unusable` to why not.

    `checks`: one per session, shared by its turns (see `IdChecks`)."""
    t.unusable = _missing_facts(t)
    if t.unusable is not None:
        return
    attempts = [t.results[k] for k in sorted(t.results)]
    try:
        inp, outs, lps = _read_turn(t, attempts, arrays, checks)
    except (KeyError, ValueError, TypeError) as exc:
        t.unusable = str(exc).strip("'\"")
        return
    t.finish_reason = attempts[-1].finish_reason
    if t.finish_reason == "abort":
        t.unusable = "last attempt was aborted and never resumed"
        return
    t.input = inp
    t.output = np.concatenate(outs) if len(outs) > 1 else outs[0]
    t.logprobs = np.concatenate(lps) if len(lps) > 1 else lps[0]
    t.mask = _turn_mask(t, attempts, outs, arrays, rules)


def _missing_facts(t: Turn) -> str | None:
    if t.failed is not None:
        return f"failed: {t.failed}"
    if t.rendered is None:
        return "no RenderedInput"
    if not t.results:
        return "no GenerateResult"
    if t.interrupted is not None and t.response is None:
        return f"{t.interrupted} before a response was sent"
    return None


def _read_turn(
    t: Turn,
    attempts: list[GenerateResult],
    arrays: Mapping[bytes, np.ndarray],
    checks: IdChecks | None,
) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """The turn's input and each attempt's ids and logprobs, checked."""
    assert t.rendered is not None
    inp = _as_ids(_array(arrays, t.rendered.input_ids.digest, "input_ids"), checks)
    if inp.size == 0:
        raise ValueError("empty input")
    outs: list[np.ndarray] = []
    lps: list[np.ndarray] = []
    for r in attempts:
        out = _as_ids(_array(arrays, r.output_ids.digest, "output_ids"), checks)
        if r.logprobs is None:
            raise ValueError(f"attempt {r.attempt}: logprobs missing")
        stored = _array(arrays, r.logprobs.digest, "logprobs")
        lp = np.asarray(stored, dtype=np.float64)
        if lp.shape != out.shape:
            raise ValueError(
                f"attempt {r.attempt}: {lp.size} logprobs for {out.size} output tokens"
            )
        if not (checks.logprobs_ok(stored, lp) if checks is not None else _logprobs_ok(lp)):
            raise ValueError(f"attempt {r.attempt}: logprobs not finite or positive")
        outs.append(out)
        lps.append(lp)
    return inp, outs, lps


def _turn_mask(
    t: Turn,
    attempts: list[GenerateResult],
    outs: list[np.ndarray],
    arrays: Mapping[bytes, np.ndarray],
    rules: Rules,
) -> np.ndarray:
    """Loss mask of the turn's output; records weight versions and routing per attempt."""
    assert t.input is not None and t.output is not None
    mask = np.ones(t.output.size, dtype=np.int8)
    final_version = attempts[-1].weight_version
    pos = 0
    for r, out in zip(attempts, outs, strict=True):
        n = out.size
        t.versions.append((pos, pos + n, r.weight_version or "unknown"))
        if rules.stale_weight_tokens == "mask" and r.weight_version != final_version and n:
            mask[pos : pos + n] = 0
            t.stale_masked += n
        if r.routed_experts is not None and rules.routed_experts is not None:
            routed = arrays.get(r.routed_experts.digest)
            if routed is not None:
                # (tokens before this attempt's output, its output length, routing)
                t.routed.append((t.input.size + pos, n, np.asarray(routed)))
        pos += n
    if t.tito is not None and not t.tito.ok and rules.mask_tito_failed:
        mask[:] = 0
        t.tito_masked = True
    if t.constrained:
        mask[:] = 0
    return mask


def _array(arrays: Mapping[bytes, np.ndarray], digest: bytes, what: str) -> np.ndarray:
    try:
        return arrays[digest]
    except KeyError:
        raise KeyError(f"{what} array {digest.hex()[:16]} missing") from None
