"""Recording a turn's engine attempts: every attempt, result, move and failure becomes events.

`generate` calls the engine through `recorder.model.resume.generate_with_resume`
and hands it `_AttemptRecorder`'s callbacks, which record each attempt and
result by ordered background steps (`Journal.then`, `Journal.now_or_then`), so
the engine call never waits for the store. A turn the engine failed is recorded (`TurnFailed` /
`EngineError`) before the error the client gets is raised (`fail_turn`).
Called by the turn pipeline, `recorder.server.turn`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from recorder.dialects.errors import ApiError
from recorder.log import events as ev
from recorder.log.events import ArrayRef
from recorder.model.engine_wire import EngineError, GenerateOutput, MissingLogprobs, SamplingParams
from recorder.model.resume import Attempt, TurnOutput, generate_with_resume
from recorder.model.tokens import TurnPlan
from recorder.server.context import ServerContext
from recorder.server.journal import Journal, finish_even_if_cancelled
from recorder.server.sessions import SessionState

log = logging.getLogger("recorder.server")


@dataclass
class TurnRecord:
    """What one turn did, for the log line and the caller."""

    session_id: str
    turn: int
    request_id: str
    plan: TurnPlan | None = None
    attempts: int = 0
    output_tokens: int = 0
    tito: str = "-"
    finish: str = ""
    outcome: str = ""
    started: float = field(default_factory=time.perf_counter)
    engine_s: float = 0.0
    current_rid: str = ""


class _AttemptRecorder:
    """The engine driver's callbacks: every attempt and result becomes events.

    They are recorded by ordered background steps (`Journal.then`), so the
    engine call never waits for the store; a result only buffers its events
    and arrays (the turn's last append writes them), at once when no step is
    queued (`Journal.now_or_then`).
    """

    def __init__(
        self, journal: Journal, record: TurnRecord, state: SessionState, params: SamplingParams
    ) -> None:
        self._journal = journal
        self._record = record
        self._state = state
        self._sampling = params.to_sglang()

    async def on_attempt(self, attempt: Attempt) -> None:
        self._record.attempts += 1
        self._record.current_rid = attempt.rid
        events = self._attempt_events(attempt)

        async def step() -> None:
            self._journal.add(*events)
            # Recorded while the engine works, without an fsync of its own: the
            # client is answered only after the turn's last append, which flushes it.
            # With the request's events and arrays when it is the first attempt.
            await self._journal.append_buffer(durable=False)

        self._journal.then(step)

    async def on_result(self, attempt: Attempt, out: GenerateOutput) -> None:
        self._record.engine_s += out.latency_s

        def buffer() -> None:
            # The arrays travel with the next append (usually the turn's last).
            refs = _result_arrays(self._journal, out)
            self._journal.add(_result_event(self._record, attempt, out, *refs))
            if out.finish_reason == "abort":
                self._journal.add(
                    ev.TurnAborted(
                        request_id=self._record.request_id,
                        turn=self._record.turn,
                        attempt=attempt.attempt,
                        rid=attempt.rid,
                        partial_tokens=len(out.output_ids),
                        message=out.finish_detail,
                    )
                )

        self._journal.now_or_then(buffer)

    async def on_moved(self, attempt: Attempt, exc: EngineError, url: str) -> None:
        """The attempt's engine is gone: record why, re-pin the session, go on at `url`.

        The attempt stays on record (GenerateAttempt + EngineError, no result), so
        replay stitches only the answered attempts, exactly what the client gets.
        """
        record, state = self._record, self._state
        log.warning(
            "session %s turn %d: engine %s is gone (%s); the turn moves to %s",
            record.session_id,
            record.turn,
            attempt.url,
            exc,
            url,
        )
        state.engine_url = url
        event = _engine_error_event(record, attempt.attempt, exc)
        self._journal.now_or_then(lambda: self._journal.add(event))

    def _attempt_events(self, attempt: Attempt) -> list[Any]:
        """[TurnResumed,] GenerateAttempt."""
        request_id, turn = self._record.request_id, self._record.turn
        events: list[Any] = []
        if attempt.attempt > 0:
            events.append(
                ev.TurnResumed(
                    request_id=request_id,
                    turn=turn,
                    attempt=attempt.attempt,
                    resumed_tokens=attempt.resumed_tokens,
                    remaining_new_tokens=attempt.max_new_tokens,
                )
            )
        events.append(
            ev.GenerateAttempt(
                request_id=request_id,
                turn=turn,
                attempt=attempt.attempt,
                rid=attempt.rid,
                engine_url=attempt.url,
                resumed_tokens=attempt.resumed_tokens,
                max_new_tokens=attempt.max_new_tokens,
                sampling_params={**self._sampling, "max_new_tokens": attempt.max_new_tokens},
            )
        )
        return events


async def generate(
    ctx: ServerContext,
    state: SessionState,
    plan: TurnPlan,
    params: SamplingParams,
    record: TurnRecord,
) -> TurnOutput:
    """Call the engine (resuming after aborts), recording every attempt and result.

    A failed turn is recorded (TurnFailed / EngineError) before its ApiError is raised.
    """
    journal = state.journal
    recorder = _AttemptRecorder(journal, record, state, params)
    try:
        output = await generate_with_resume(
            ctx.engine,
            _engine_url(ctx, state),
            plan.input_ids,
            params,
            max_attempts=ctx.config.max_attempts,
            budget_s=ctx.config.turn_budget_s,
            on_attempt=recorder.on_attempt,
            on_result=recorder.on_result,
            on_sent=journal.release,
            return_routed_experts=ctx.config.return_routed_experts,
            session_id=state.session_id,
            on_moved=recorder.on_moved,
        )
    except (MissingLogprobs, EngineError) as exc:
        await fail_turn(journal, record, *_engine_failure(record, exc), cause=exc)
    record.output_tokens = len(output.output_ids)
    record.finish = output.finish_reason
    if output.finish_reason == "abort":
        await fail_turn(
            journal,
            record,
            "aborted",
            turn_failed(record, f"aborted: {output.finish_detail}"),
            ApiError(
                "overloaded_error",
                f"the engine kept aborting this turn ({output.finish_detail}); retry later",
            ),
        )
    return output


def _engine_failure(
    record: TurnRecord, exc: MissingLogprobs | EngineError
) -> tuple[str, Any, ApiError]:
    """(outcome, event to record, error to answer) for a turn the engine failed."""
    if isinstance(exc, MissingLogprobs):
        return (
            "missing_logprobs",
            turn_failed(record, f"missing_logprobs: {exc}"),
            ApiError(
                "api_error",
                f"the engine returned no logprobs for this turn, so it cannot be recorded "
                f"(never re-tokenized); check that SGLang honours return_logprob ({exc})",
            ),
        )
    event = _engine_error_event(record, max(0, record.attempts - 1), exc)
    log.warning("session %s turn %d: engine %s: %s", record.session_id, record.turn, exc.url, exc)
    plain = _engine_problem(exc)
    if exc.kind in ("unreachable", "timeout") or exc.status >= 500 or exc.status == 429:
        answer = ApiError("overloaded_error", f"inference engine unavailable: {plain}; retry later")
    else:
        answer = ApiError("api_error", f"inference engine failed: {plain}")
    return f"engine_{exc.kind}", event, answer


def _engine_error_event(record: TurnRecord, attempt: int, exc: EngineError) -> ev.EngineError:
    return ev.EngineError(
        request_id=record.request_id,
        turn=record.turn,
        attempt=attempt,
        kind=exc.kind,
        status=exc.status,
        message=str(exc),
    )


def _engine_problem(exc: EngineError) -> str:
    """What the agent may read: the engine's own error text, never its URL or the
    transport's (host, port); those are in the server log and the EngineError event."""
    if exc.kind == "http":
        return (
            f"HTTP {exc.status}: {str(exc).replace(exc.url, '<engine>')}" if exc.url else str(exc)
        )
    return {
        "unreachable": "it cannot be reached",
        "timeout": "it did not answer in time",
        "protocol": "its answer could not be read",
    }[exc.kind]


def _result_arrays(
    journal: Journal, out: GenerateOutput
) -> tuple[ArrayRef, ArrayRef | None, ArrayRef | None]:
    """(output ids, logprobs, routed experts) refs of one attempt, buffered in the journal."""
    # Not cached in the store's piece cache: nothing reads them while the session is open
    # (its chain holds the tokens); its close reads them back from the log.
    ids_ref = journal.add_array(np.asarray(out.output_ids, dtype=np.int32), cache=False)
    logprobs_ref = None
    if out.logprobs is not None:
        # float64: exactly the engine's values (SGLang sends JSON doubles).
        logprobs = np.asarray(out.logprobs, dtype=np.float64)
        logprobs_ref = journal.add_array(logprobs, cache=False)
    experts_ref = None
    if out.routed_experts is not None:
        experts_ref = journal.add_array(np.frombuffer(out.routed_experts, dtype="<i4"))
    return ids_ref, logprobs_ref, experts_ref


def _result_event(
    record: TurnRecord,
    attempt: Attempt,
    out: GenerateOutput,
    ids_ref: ArrayRef,
    logprobs_ref: ArrayRef | None,
    experts_ref: ArrayRef | None,
) -> ev.GenerateResult:
    return ev.GenerateResult(
        request_id=record.request_id,
        turn=record.turn,
        attempt=attempt.attempt,
        rid=attempt.rid,
        output_ids=ids_ref,
        logprobs=logprobs_ref,
        finish_reason=out.finish_reason,
        finish_detail=out.finish_detail,
        weight_version=out.weight_version,
        prompt_tokens=out.prompt_tokens,
        cached_tokens=out.cached_tokens,
        routed_experts=experts_ref,
        latency_s=out.latency_s,
    )


def turn_failed(record: TurnRecord, reason: str) -> ev.TurnFailed:
    return ev.TurnFailed(request_id=record.request_id, turn=record.turn, reason=reason)


async def fail_turn(
    journal: Journal,
    record: TurnRecord,
    outcome: str,
    event: Any,
    error: ApiError,
    *,
    cause: BaseException | None = None,
) -> NoReturn:
    """Record durably why the turn failed, then raise the error the client gets."""
    record.outcome = outcome
    await finish_even_if_cancelled(journal.write(event))
    raise error from cause


def _engine_url(ctx: ServerContext, state: SessionState) -> str:
    """The session's engine; a session whose engine is down moves to a live one.

    Moving costs only the prefix cache: the turn sends its whole chain's tokens. The
    move is on record as the turn's `GenerateAttempt.engine_url`.
    """
    engine = ctx.engine
    if state.engine_url not in engine.urls or not engine.live(state.engine_url):
        moved_from, state.engine_url = state.engine_url, engine.pick(state.session_id)
        if moved_from and moved_from != state.engine_url:
            log.warning(
                "session %s moves from engine %s (down) to %s",
                state.session_id,
                moved_from,
                state.engine_url,
            )
    return state.engine_url
