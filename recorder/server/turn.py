"""The turn pipeline: one Messages request -> one engine call -> one answer.

Runs under the session lock. Every step is an event; each step's events are
appended as one batch, and the answer goes out only after its events are
durable. The request's own records (body, engine input, attempts) are written
by ordered background steps while the engine works, so a slow store and a
slow engine overlap instead of adding up. Order of a turn in the log:

  MessagesRequest, ChainDecision, [ClampApplied], RenderedInput, GenerateAttempt
  GenerateResult, [TurnAborted, TurnResumed, GenerateAttempt, GenerateResult]...
  [TitoVerdict], ResponseSent, StateSnapshot
  (or TurnFailed / EngineError / ClientDisconnected / SessionFailed)

An attempt whose engine is gone (with several engines) is followed by its
EngineError and the turn goes on, as a TurnResumed + GenerateAttempt on a live
engine, within the same request. That is always safe to do: the engine is
called without streaming, so no model output has reached the client before
the whole generation is back (a streaming answer has sent at most
`message_start` and pings), and the failed attempt has no GenerateResult, so
replay stitches exactly the tokens the client was answered with.

A request refused before the turn starts (bad body, prompt too long) leaves
only a RequestRejected: nothing half-recorded.

Another process may append to the session while a turn runs (its database
lock lost, see journal.py). If the turn's first append loses, the engine call
is aborted and `ConcurrencyConflict` leaves `run_turn` with nothing of the
turn in the log: the caller plans it again from the new head
(`SessionRegistry.locked`). Later appends follow the other process's events;
the state is then rebuilt from the log before the session's next request.

Recording the engine attempts is `recorder.server.attempts`'s job. This module
(~650 lines) keeps the whole pipeline of one turn, plan to answer to its
failure paths, in the order a turn runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import traceback
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import numpy as np
from aiohttp import web

from recorder.dialects.answer import (
    Answer,
    ToolCallOut,
    build_content,
    new_tool_use_id,
    split_stop_sequence,
    stop_reason_for,
    usage_for,
)
from recorder.dialects.chat import ChatRequest, answer_keys, find_dispatches
from recorder.dialects.errors import ApiError
from recorder.dialects.translate import response_message_digest
from recorder.log import events as ev
from recorder.log.events import ArrayRef
from recorder.log.store.base import ConcurrencyConflict, StorageUnavailable
from recorder.model.admission import check_fits
from recorder.model.engine_wire import SamplingParams
from recorder.model.parsers import ParserError
from recorder.model.resume import TurnOutput
from recorder.model.tokens import (
    ContextOverflow,
    TurnPlan,
    clamp_max_new_tokens,
    commit_turn,
    note_dispatch,
    plan_turn,
    render_chars,
    tito_check,
)
from recorder.server.attempts import TurnRecord, fail_turn, generate, turn_failed
from recorder.server.context import LIVE_RULES_VERSION, ServerContext
from recorder.server.deltas import put_body, put_input, remember_refs
from recorder.server.errors import moved_on_error, storage_error
from recorder.server.journal import Journal, SessionMovedOn, finish_even_if_cancelled
from recorder.server.responders import Responder
from recorder.server.sessions import SessionState, TurnStop
from recorder.server.snapshot import add_snapshot

log = logging.getLogger("recorder.server")

T = TypeVar("T")


async def run_turn(
    ctx: ServerContext,
    state: SessionState,
    chat: ChatRequest,
    body: bytes,
    path: str,
    responder: Responder,
    request_id: str,
) -> web.StreamResponse:
    """Serve one request of an open session whose lock the caller holds.

    `request_id` is also the answer's message id (`msg_...`). Raises
    `ConcurrencyConflict` when another process claimed the head first: nothing
    of the turn was written, and the caller runs it again after catching up.
    """
    record = TurnRecord(state.session_id, state.next_turn, request_id)
    try:
        return await _run(ctx, state, chat, body, path, responder, record)
    except asyncio.CancelledError:
        await _record_cancel(ctx, state, record)
        raise
    except ApiError as err:
        return await responder.fail(err)
    except TurnStopped as exc:
        return await _stopped(state, record, str(exc), responder)
    except ConcurrencyConflict:
        record.outcome = "claim_lost"
        state.next_turn = record.turn  # not taken: the next free one is read from the log
        raise
    except SessionMovedOn as exc:
        # The engine's answer cannot be recorded after the other process's close
        # or reopen; what was appended stays, an unanswered turn.
        state.suspect = True
        record.outcome = "moved_on"
        log.warning("session %s turn %d: %s", state.session_id, record.turn, exc)
        return await responder.fail(moved_on_error(exc))
    except StorageUnavailable as exc:
        # Nothing more can be recorded; the state is rebuilt from the log next time.
        state.suspect = True
        record.outcome = "storage_unavailable"
        log.warning(
            "session %s turn %d: %s", state.session_id, record.turn, exc, exc_info=exc.__cause__
        )
        return await responder.fail(storage_error(exc))
    except Exception as exc:
        return await _session_failed(state, record, exc, responder)
    finally:
        if state.journal.busy:
            await finish_even_if_cancelled(state.journal.settle())
        else:
            state.journal.drop()  # the usual end: nothing to wait for, no task for it
        if state.journal.rebased:
            # Its chains miss the turns appended between this one's events.
            state.suspect = True
        _log_turn(record)


# Plans that render more text than this run on a worker thread (a fresh render
# of a Claude Code request, ~80 KB and 20k tokens, takes ~50 ms of tokenizing
# that would stall every other session); smaller ones inline, cheaper than a
# hop. Extending a chain renders only the new messages, whatever the context.
_THREAD_PLAN_CHARS = 32 * 1024
# Plans that render more than this wait for each other: tokenizing 8 MB of text
# is seconds of CPU (its memory is bounded: long texts are tokenized in pieces,
# `Tokenizer.encode_array`); one at a time keeps the others' turns fast.
_LARGE_PLAN_CHARS = 1024 * 1024
# Outputs longer than this get their TITO check (decode + encode) on a thread.
_THREAD_TITO_TOKENS = 4096


async def _run(
    ctx: ServerContext,
    state: SessionState,
    chat: ChatRequest,
    body: bytes,
    path: str,
    responder: Responder,
    record: TurnRecord,
) -> web.StreamResponse:
    try:
        plan, max_new = await _plan(ctx, state, chat, len(body))
    except (ContextOverflow, ValueError) as exc:
        return await reject(state, record.request_id, responder, "invalid_request_error", str(exc))
    record.plan = plan
    state.next_turn += 1
    state.journal.hold()  # released once the engine has the request (see Journal)
    input_ref = _record_request(
        ctx, state, chat, body, path, plan, record, max_new, responder.dialect.name
    )
    model = chat.model or ctx.config.model_name
    await responder.started(record.request_id, model, usage_for(len(plan.input_ids), 0, 0))
    forced = state.overrides.sampling
    params = forced.apply(_sampling_params(ctx, chat, max_new, forced.owns_distribution))
    stop = ctx.registry.turn_started(state.session_id)
    try:
        output = await _unless_claim_lost(
            state.journal, generate(ctx, state, plan, params, record), stop
        )
    finally:
        ctx.registry.turn_ended(state.session_id, stop)
    answer = await _answer(ctx, state, chat, plan, output, record, model)

    async def finish() -> None:
        await state.journal.drain()
        try:
            _commit(state, plan, output.output_ids, answer.content, input_ref.result())
            _add_snapshot(state)
            await state.journal.append_buffer()  # finish itself is not cut by a cancel
        except BaseException:
            state.suspect = True  # chains advanced past the log: rebuilt before the next use
            raise

    # Durable answer and advanced chains go together, even if the client leaves now.
    await finish_even_if_cancelled(finish())
    record.outcome = "ok"
    return await responder.answer(answer)


# How long a stopped turn waits for its engine request's abort to be acknowledged
# before it lets the close go on (the abort itself still goes out, in the
# background): a hung engine may not answer /abort_request either.
_STOP_ABORT_WAIT_S = 1.0


class TurnStopped(Exception):
    """An aborting close stopped the turn; its engine request was aborted."""


async def _unless_claim_lost(journal: Journal, work: Awaitable[T], stop: TurnStop) -> T:
    """`work` (the engine call), stopped as soon as the turn's claiming append loses,
    or the session is closed `aborted` (`stop`: raises TurnStopped).

    A lost claim: its input was planned from a stale head, so its answer would
    be thrown away. Either way the engine is asked to abort (as when the
    client leaves) and the turn ends at once instead of after the generation.

    `work` runs in this task, which either signal cancels (no watcher tasks:
    they would cost loop iterations every turn); a stop waits at most
    `_STOP_ABORT_WAIT_S` for the engine's abort (it goes on detached).
    """
    task = asyncio.current_task()
    assert task is not None
    cause = _Interrupt(task)
    unhook_lost = journal.on_lost(cause.lost)
    stop.callbacks.append(cause.stopped)
    if stop.event.is_set():  # stopped before the engine call began
        cause.stopped()
    try:
        result = await work
    except BaseException as exc:
        if not cause.reason or cause.outer_cancel():
            raise
        if not isinstance(exc, asyncio.CancelledError | Exception):
            raise
        # The engine call's own end (cancelled, or an error on the way) is not
        # what the turn reports: the interrupt is.
        if cause.reason == "stopped":
            raise TurnStopped(stop.reason) from None
        assert journal.lost is not None
        raise journal.lost from None
    finally:
        unhook_lost()
        if cause.stopped in stop.callbacks:
            stop.callbacks.remove(cause.stopped)
        cause.done()
    cause.outer_cancel()  # the engine call finished first: the interrupt came too late
    return result


class _Interrupt:
    """Why a turn's engine call was interrupted (its task cancelled), if it was."""

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self._task = task
        self.reason = ""
        self._cancels = 0
        self._late: asyncio.TimerHandle | None = None

    def lost(self) -> None:
        self._interrupt("lost")

    def stopped(self) -> None:
        if self._interrupt("stopped"):
            loop = asyncio.get_running_loop()
            self._late = loop.call_later(_STOP_ABORT_WAIT_S, self._cancel)

    def _interrupt(self, reason: str) -> bool:
        if self.reason:
            return False
        self.reason = reason
        self._cancel()
        return True

    def _cancel(self) -> None:
        self._late = None
        self._cancels += 1
        self._task.cancel()

    def outer_cancel(self) -> bool:
        """Take back this interrupt's cancels; was the task cancelled from outside too?"""
        for _ in range(self._cancels):
            self._task.uncancel()
        self._cancels = 0
        return self._task.cancelling() > 0

    def done(self) -> None:
        if self._late is not None:
            self._late.cancel()
            self._late = None


async def _plan(
    ctx: ServerContext, state: SessionState, chat: ChatRequest, body_len: int
) -> tuple[TurnPlan, int]:
    """(the turn's plan, its clamped max_new_tokens); raises ValueError if it cannot run."""
    context = ctx.config.context_length
    check_fits(chat, ctx.tokenizer, context)
    chars = render_chars(state.chains, chat, ctx.tokenizer, body_len)
    if chars > _LARGE_PLAN_CHARS:
        async with ctx.large_plans:  # one at a time: each holds ~90x its text in memory
            plan = await asyncio.to_thread(plan_turn, state.chains, chat, ctx.tokenizer, context)
    elif chars > _THREAD_PLAN_CHARS:
        plan = await asyncio.to_thread(plan_turn, state.chains, chat, ctx.tokenizer, context)
    else:
        plan = plan_turn(state.chains, chat, ctx.tokenizer, context)
    max_new = clamp_max_new_tokens(chat.max_tokens, len(plan.input_ids), context)
    return plan, max_new


def _record_request(
    ctx: ServerContext,
    state: SessionState,
    chat: ChatRequest,
    body: bytes,
    path: str,
    plan: TurnPlan,
    record: TurnRecord,
    max_new: int,
    dialect: str,
) -> asyncio.Future[ArrayRef]:
    """Record the request, its body and engine input, in a background step.

    The engine does not need the stored arrays, so this overlaps the engine
    call; the step is queued first, so its events precede every later one.
    The arrays are encoded once the engine has the request and written with
    the step's events by the turn's next append (the first attempt's: one
    commit for all of it). Returns the engine input's ref (the chains
    remember it at commit).
    """
    journal = state.journal
    input_ref: asyncio.Future[ArrayRef] = asyncio.get_running_loop().create_future()

    async def step() -> None:
        await journal.unheld()
        body_ref, prefixes = await put_body(journal.arrays, state.body_prefixes, body)
        # The next body is stored against this one's pieces once they are stored.
        journal.after_append(lambda: setattr(state, "body_prefixes", prefixes))
        input_ref.set_result(await put_input(journal.arrays, state.chain_refs, plan))
        journal.add(
            *_request_events(
                ctx, chat, plan, record, path, max_new, body_ref, input_ref.result(), dialect
            )
        )

    journal.then(step)
    return input_ref


async def _answer(
    ctx: ServerContext,
    state: SessionState,
    chat: ChatRequest,
    plan: TurnPlan,
    output: TurnOutput,
    record: TurnRecord,
    model: str,
) -> Answer:
    """Compose the answer and buffer [TitoVerdict,] ResponseSent after every queued step."""
    journal = state.journal
    try:
        answer, tito_event = await _compose(ctx, journal, chat, plan, output, record, model)
    except ParserError as exc:
        await fail_turn(
            journal,
            record,
            "parser_error",
            turn_failed(record, f"parser: {exc}"),
            ApiError("overloaded_error", f"output parser unavailable: {exc}"),
            cause=exc,
        )
    await journal.drain()
    if tito_event is not None:
        journal.add(tito_event)
    journal.add(
        ev.ResponseSent(
            request_id=record.request_id,
            turn=record.turn,
            content=answer.content,
            stop_reason=answer.stop_reason,
            usage=answer.usage,
            reasoning=answer.hidden_reasoning,
            parser=ctx.parser.label,
        )
    )
    return answer


def _request_events(
    ctx: ServerContext,
    chat: ChatRequest,
    plan: TurnPlan,
    record: TurnRecord,
    path: str,
    max_new: int,
    body_ref: ArrayRef,
    input_ref: ArrayRef,
    dialect: str,
) -> list[Any]:
    """MessagesRequest, ChainDecision, [ClampApplied], RenderedInput."""
    turn, request_id = record.turn, record.request_id
    events: list[Any] = [
        ev.MessagesRequest(
            request_id=request_id,
            turn=turn,
            body=body_ref,
            path=path,
            stream=chat.stream,
            system_digest=chat.system_digest,
            n_messages=chat.n_input_messages,
            tool_result_ids=chat.tool_result_ids,
            model=chat.model,
            n_chat_messages=len(chat.messages),
            n_tools=len(chat.tools),
            dialect=dialect,
            answer_keys=None if plan.action == "extend" else answer_keys(chat),
        ),
        ev.ChainDecision(
            rules_version=LIVE_RULES_VERSION,
            request_id=request_id,
            turn=turn,
            chain_id=plan.chain_id,
            action=plan.action,
            reason=plan.reason,
            parent_chain_id=plan.parent_chain_id,
            dispatch_tool_use_id=plan.dispatch_tool_use_id,
        ),
    ]
    if chat.max_tokens is not None and max_new < chat.max_tokens:
        events.append(
            ev.ClampApplied(
                rules_version=LIVE_RULES_VERSION,
                request_id=request_id,
                turn=turn,
                requested=chat.max_tokens,
                clamped_to=max_new,
                context_length=ctx.config.context_length,
            )
        )
    events.append(
        ev.RenderedInput(
            request_id=request_id,
            turn=turn,
            chain_id=plan.chain_id,
            input_ids=input_ref,
            prefix_len=plan.prefix_len,
            new_messages=plan.new_messages,
        )
    )
    return events


# --------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------


def _sampling_params(
    ctx: ServerContext, chat: ChatRequest, max_new: int, trainer_owned: bool
) -> SamplingParams:
    """The engine's parameters for `chat`. In a session whose trainer forces the sampling
    distribution (`trainer_owned`), the request's temperature, top_p and top_k are not
    taken: an agent that asked for `top_k: 1` had its tokens sampled greedily and trained
    as the policy's (an audit); the fields the trainer left unset stay neutral. A grammar
    (`json_schema`) is kept, for the client's sake, and its turn is not trained
    (`replay.turns.CONSTRAINTS`)."""
    own = not trainer_owned
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=chat.temperature
        if own and chat.temperature is not None
        else ctx.config.default_temperature,
        top_p=chat.top_p if own and chat.top_p is not None else 1.0,
        top_k=chat.top_k if own and chat.top_k is not None else -1,
        stop=chat.stop_sequences,
        stop_token_ids=ctx.tokenizer.eos_token_ids,
        json_schema=None if chat.json_schema is None else json.dumps(chat.json_schema),
    )


async def _compose(
    ctx: ServerContext,
    journal: Journal,
    chat: ChatRequest,
    plan: TurnPlan,
    output: TurnOutput,
    record: TurnRecord,
    model: str,
) -> tuple[Answer, ev.TitoVerdict | None]:
    """TITO verdict, reasoning/tool-call parsing, content blocks, stop reason, usage."""
    tok, ids = ctx.tokenizer, output.output_ids
    tito_event = await _tito_verdict(ctx, journal, ids, record) if ids else None
    ended_with_eos = bool(ids) and ids[-1] in tok.eos_token_ids
    text = tok.decode(ids[:-1] if ended_with_eos else ids)
    stop_sequence = None
    if output.finish_reason == "stop" and not ended_with_eos:
        text, stop_sequence = split_stop_sequence(
            text, chat.stop_sequences, matched=output.finish_detail
        )
    # No tools offered (`tools: []`, `tool_choice: none`): no calls, the text stays text.
    parsed = await ctx.parser.parse(text, [] if chat.tool_choice == "none" else chat.callable_tools)
    calls = [ToolCallOut(name=c.name, arguments=dict(c.arguments)) for c in parsed.tool_calls]
    # Thinking comes back only when the request enabled it, as with the real API.
    shown = parsed.reasoning if chat.thinking in ("enabled", "adaptive") else None
    content = build_content(shown, parsed.text, calls, [new_tool_use_id() for _ in calls])
    stop_reason = stop_reason_for(
        output.finish_reason, has_tool_calls=bool(calls), stop_sequence=stop_sequence
    )
    answer = Answer(
        message_id=record.request_id,
        model=model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence if stop_reason == "stop_sequence" else None,
        usage=usage_for(len(plan.input_ids), output.cached_tokens, len(ids)),
        hidden_reasoning=(parsed.reasoning or "") if shown is None else "",
        token_logprobs=_token_logprobs(tok, output) if chat.logprobs else None,
    )
    return answer, tito_event


def _token_logprobs(tok: Any, output: TurnOutput) -> list[tuple[str, float]]:
    """Each output token's text and the engine's logprob (the EOS that ended it left out)."""
    ids, logprobs = output.output_ids, output.logprobs
    n = len(ids) - 1 if ids and ids[-1] in tok.eos_token_ids else len(ids)
    return [(tok.decode([i]), float(lp)) for i, lp in zip(ids[:n], logprobs[:n], strict=True)]


async def _tito_verdict(
    ctx: ServerContext, journal: Journal, ids: list[int], record: TurnRecord
) -> ev.TitoVerdict:
    """Does decode -> re-encode give back the output? The re-encoding is kept on a mismatch."""
    if len(ids) > _THREAD_TITO_TOKENS:
        result = await asyncio.to_thread(tito_check, ctx.tokenizer, ids)
    else:
        result = tito_check(ctx.tokenizer, ids)
    record.tito = "ok" if result.ok else f"fail@{result.first_divergence}"
    reencoded_ref = None
    if not result.ok:  # written with the verdict
        reencoded_ref = journal.add_array(np.asarray(result.reencoded_ids, dtype=np.int32))
    return ev.TitoVerdict(
        rules_version=LIVE_RULES_VERSION,
        request_id=record.request_id,
        turn=record.turn,
        ok=result.ok,
        first_divergence=result.first_divergence,
        reencoded_ids=reencoded_ref,
    )


def _commit(
    state: SessionState,
    plan: TurnPlan,
    output_ids: Sequence[int],
    content: list[dict[str, Any]],
    input_ref: ArrayRef,
) -> None:
    """Advance the session's chains now that the answer is durable."""
    chain = commit_turn(state.chains, plan, output_ids, response_message_digest(content))
    dispatches = find_dispatches(content)
    if dispatches:
        note_dispatch(state.chains, [d[0] for d in dispatches], [d[1] for d in dispatches])
    remember_refs(state.chain_refs, state.chains.chains, plan, chain.chain_id, input_ref)
    state.turns_completed += 1


def _add_snapshot(state: SessionState) -> None:
    """The session's state after this turn, in the turn's last batch (see snapshot.py).

    A snapshot is only a shortcut for a restart: one that cannot be built is
    logged and left out, and the turn is answered as usual.
    """
    try:
        add_snapshot(state)
    except Exception:
        log.exception("session %s: no state snapshot for this turn", state.session_id)


# --------------------------------------------------------------------------
# Rejections, cancellations, session failures
# --------------------------------------------------------------------------


async def reject(
    state: SessionState,
    request_id: str,
    responder: Responder,
    error_type: str,
    message: str,
    status: int | None = None,
) -> web.StreamResponse:
    """Record a request refused before its turn started, then answer the error."""
    err = ApiError(error_type, message, status)  # type: ignore[arg-type]
    await finish_even_if_cancelled(
        state.journal.write(
            ev.RequestRejected(
                request_id=request_id, status=err.status, error_type=error_type, message=message
            )
        )
    )
    log.info(
        "session %s request %s rejected (%d): %s", state.session_id, request_id, err.status, message
    )
    return await responder.fail(err)


async def _stopped(
    state: SessionState, record: TurnRecord, reason: str, responder: Responder
) -> web.StreamResponse:
    """Record the turn an aborting close stopped (unanswered), and tell the client."""
    record.outcome = "stopped"
    try:
        await finish_even_if_cancelled(state.journal.write(turn_failed(record, reason)))
    except asyncio.CancelledError:
        raise
    except Exception:
        state.suspect = True
        log.exception("session %s: could not record the stopped turn", state.session_id)
    return await responder.fail(ApiError("invalid_request_error", reason, status=409))


async def _record_cancel(ctx: ServerContext, state: SessionState, record: TurnRecord) -> None:
    """The handler was cancelled: the client left, or shutdown's grace period ran out."""
    journal = state.journal
    if record.plan is None or state.next_turn == record.turn:
        return  # the turn never started: nothing to say
    if ctx.stopping:
        record.outcome = "shutdown"
        event: Any = ev.TurnFailed(
            request_id=record.request_id,
            turn=record.turn,
            reason="server shutting down: turn cancelled after the grace period",
        )
    else:
        record.outcome = "client_disconnected"
        event = ev.ClientDisconnected(
            request_id=record.request_id, turn=record.turn, rid=record.current_rid
        )
    try:
        await finish_even_if_cancelled(journal.write(event))
    except asyncio.CancelledError:
        raise
    except Exception:
        state.suspect = True
        log.exception("session %s: could not record the cancelled turn", state.session_id)


async def _session_failed(
    state: SessionState, record: TurnRecord, exc: Exception, responder: Responder
) -> web.StreamResponse:
    """An unexpected error in this session: log, record, answer 500; others go on."""
    log.error("session %s turn %d failed", state.session_id, record.turn, exc_info=exc)
    state.suspect = True  # rebuilt from the log before its next request
    events: list[Any] = []
    if record.plan is not None and record.outcome != "ok":
        # The turn started but its answer never went out: replay must not
        # count it as answered.
        reason = f"internal error: {type(exc).__name__}: {str(exc)[:500]}"
        events.append(turn_failed(record, reason))
    record.outcome = "session_failed"
    events.append(
        ev.SessionFailed(
            where=f"turn {record.turn}",
            error_type=type(exc).__name__,
            message=str(exc)[:2000],
            traceback="".join(traceback.format_exception(exc))[-8000:],
        )
    )
    recorded = "it was logged and recorded"
    try:
        await finish_even_if_cancelled(state.journal.write(*events))
    except Exception:
        log.exception("session %s: could not record the failure", state.session_id)
        recorded = "it is in the server log"
    return await responder.fail(
        ApiError(
            "api_error",
            f"internal error in this session ({type(exc).__name__}: {str(exc)[:200]}); {recorded}, "
            "the session can go on",
        )
    )


def _log_turn(record: TurnRecord) -> None:
    plan = record.plan
    if plan is None:
        return
    log.info(
        "turn session=%s turn=%d chain=%d %s/%s prompt=%d new=%d out=%d attempts=%d tito=%s "
        "finish=%s outcome=%s ms=%.0f engine_ms=%.0f",
        record.session_id,
        record.turn,
        plan.chain_id,
        plan.action,
        plan.reason,
        len(plan.input_ids),
        plan.new_tokens,
        record.output_tokens,
        record.attempts,
        record.tito,
        record.finish or "-",
        record.outcome or "-",
        (time.perf_counter() - record.started) * 1000,
        record.engine_s * 1000,
    )
