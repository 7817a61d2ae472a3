"""The turn pipeline: one Messages request -> one engine call -> one answer.

Runs under the session lock. Every step is an event; each step's events are
appended as one batch, and the answer goes out only after its events are
durable. The request's own records (body, engine input, attempts) are written
by ordered background steps while the engine works, so a slow store and a
slow engine overlap instead of adding up. Order of a turn in the log:

  MessagesRequest, ChainDecision, [ClampApplied], RenderedInput, GenerateAttempt
  GenerateResult, [TurnAborted, TurnResumed, GenerateAttempt, GenerateResult]...
  [TitoVerdict], ResponseSent
  (or TurnFailed / EngineError / ClientDisconnected / SessionFailed)

A request refused before the turn starts (bad body, prompt too long) leaves
only a RequestRejected: nothing half-recorded.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

from recorder import events as ev
from recorder.engine import (
    Attempt,
    EngineError,
    GenerateOutput,
    MissingLogprobs,
    SamplingParams,
    TurnOutput,
    generate_with_resume,
)
from recorder.events import ArrayRef
from recorder.parsers import ParserError
from recorder.server.answer import (
    Answer,
    ToolCallOut,
    build_content,
    new_tool_use_id,
    split_stop_sequence,
    stop_reason_for,
    usage_for,
)
from recorder.server.context import LIVE_RULES_VERSION, ServerContext
from recorder.server.errors import ApiError
from recorder.server.journal import finish_even_if_cancelled
from recorder.server.responders import Responder
from recorder.server.sessions import SessionState
from recorder.tokens import (
    ContextOverflow,
    TurnPlan,
    clamp_max_new_tokens,
    commit_turn,
    note_dispatch,
    plan_turn,
    tito_check,
)
from recorder.translate import ChatRequest, find_dispatches, response_message_digest

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

    `request_id` is also the answer's message id (`msg_...`).
    """
    record = TurnRecord(state.session_id, state.next_turn, request_id)
    try:
        return await _run(ctx, state, chat, body, path, responder, record)
    except asyncio.CancelledError:
        await _record_cancel(ctx, state, record)
        raise
    except ApiError as err:
        return await responder.fail(err)
    except Exception as exc:
        record.outcome = "session_failed"
        return await _session_failed(state, record, exc, responder)
    finally:
        await finish_even_if_cancelled(state.journal.settle())
        _log_turn(record)


# Requests bigger than this are planned on a worker thread (a fresh render of a
# Claude Code request, ~80 KB and 20k tokens, takes ~50 ms of tokenizing that
# would stall every other session); smaller ones inline, cheaper than a hop.
_THREAD_PLAN_BYTES = 32 * 1024
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
    tok, store, journal = ctx.tokenizer, ctx.store, state.journal
    try:
        if len(body) > _THREAD_PLAN_BYTES:
            plan = await asyncio.to_thread(plan_turn, state.chains, chat, tok)
        else:
            plan = plan_turn(state.chains, chat, tok)
        max_new = clamp_max_new_tokens(
            chat.max_tokens, len(plan.input_ids), ctx.config.context_length
        )
    except (ContextOverflow, ValueError) as exc:
        return await reject(state, record.request_id, responder, "invalid_request_error", str(exc))
    record.plan = plan
    turn = record.turn
    state.next_turn += 1
    # The engine does not need the stored arrays: store them and record the
    # request while the engine works (ordered before every later event).
    body_task = asyncio.ensure_future(store.put_array(np.frombuffer(body, dtype=np.uint8)))
    input_task = asyncio.ensure_future(_put_input(ctx, state, plan))

    async def record_request() -> None:
        body_ref, input_ref = await asyncio.gather(body_task, input_task)
        journal.add(*_request_events(ctx, chat, plan, record, path, max_new, body_ref, input_ref))

    journal.then(record_request)
    model = chat.model or ctx.config.model_name
    await responder.started(record.request_id, model, usage_for(len(plan.input_ids), 0, 0))

    params = _sampling_params(ctx, chat, max_new)
    output = await _generate(ctx, state, plan, params, record)
    try:
        answer, tito_event = await _compose(ctx, chat, plan, output, record, model)
    except ParserError as exc:
        record.outcome = "parser_error"
        await _fail_turn(
            journal,
            record,
            ev.TurnFailed(request_id=record.request_id, turn=turn, reason=f"parser: {exc}"),
        )
        raise ApiError("overloaded_error", f"output parser unavailable: {exc}") from exc
    await journal.drain()
    if tito_event is not None:
        journal.add(tito_event)
    journal.add(
        ev.ResponseSent(
            request_id=record.request_id,
            turn=turn,
            content=answer.content,
            stop_reason=answer.stop_reason,
            usage=answer.usage,
        )
    )

    async def finish() -> None:
        await journal.flush()
        _commit(state, plan, output.output_ids, answer.content, input_task.result())

    # Durable answer and advanced chains go together, even if the client leaves now.
    await finish_even_if_cancelled(finish())
    record.outcome = "ok"
    return await responder.answer(answer)


def _request_events(
    ctx: ServerContext,
    chat: ChatRequest,
    plan: TurnPlan,
    record: TurnRecord,
    path: str,
    max_new: int,
    body_ref: ArrayRef,
    input_ref: ArrayRef,
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


async def _put_input(ctx: ServerContext, state: SessionState, plan: TurnPlan) -> ArrayRef:
    """Store the engine input as a delta after the longest stored prefix of its chain."""
    ids = plan.input_ids
    base: ArrayRef | None = None
    if plan.prefix_len:
        source = plan.chain_id if plan.action == "extend" else plan.parent_chain_id
        known = state.chain_refs.get(source, {}) if source is not None else {}
        usable = [n for n in known if n <= plan.prefix_len]
        base = known[max(usable)] if usable else None
    if base is not None:
        suffix = np.asarray(ids[base.length :], dtype=np.int32)
        return await ctx.store.put_array(suffix, extends=base)  # type: ignore[no-any-return]
    return await ctx.store.put_array(np.asarray(ids, dtype=np.int32))  # type: ignore[no-any-return]


def _sampling_params(ctx: ServerContext, chat: ChatRequest, max_new: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=chat.temperature
        if chat.temperature is not None
        else ctx.config.default_temperature,
        top_p=chat.top_p if chat.top_p is not None else 1.0,
        top_k=chat.top_k if chat.top_k is not None else -1,
        stop=chat.stop_sequences,
        stop_token_ids=ctx.tokenizer.eos_token_ids,
    )


async def _generate(
    ctx: ServerContext,
    state: SessionState,
    plan: TurnPlan,
    params: SamplingParams,
    record: TurnRecord,
) -> TurnOutput:
    """Call the engine (resuming after aborts), recording every attempt and result.

    A failed turn is recorded (TurnFailed / EngineError) before its ApiError is raised.
    """
    journal, store, turn = state.journal, ctx.store, record.turn
    url = _engine_url(ctx, state)
    sampling = params.to_sglang()

    def on_attempt_events(attempt: Attempt) -> list[Any]:
        events: list[Any] = []
        if attempt.attempt > 0:
            events.append(
                ev.TurnResumed(
                    request_id=record.request_id,
                    turn=turn,
                    attempt=attempt.attempt,
                    resumed_tokens=attempt.resumed_tokens,
                    remaining_new_tokens=attempt.max_new_tokens,
                )
            )
        events.append(
            ev.GenerateAttempt(
                request_id=record.request_id,
                turn=turn,
                attempt=attempt.attempt,
                rid=attempt.rid,
                engine_url=url,
                resumed_tokens=attempt.resumed_tokens,
                max_new_tokens=attempt.max_new_tokens,
                sampling_params={**sampling, "max_new_tokens": attempt.max_new_tokens},
            )
        )
        return events

    async def on_attempt(attempt: Attempt) -> None:
        """Recorded in the background: the engine call does not wait for the store."""
        record.attempts += 1
        record.current_rid = attempt.rid
        events = on_attempt_events(attempt)

        async def step() -> None:
            journal.add(*events)
            await journal.flush_buffer()

        journal.then(step)

    async def on_result(attempt: Attempt, out: GenerateOutput) -> None:
        record.engine_s += out.latency_s
        arrays = asyncio.ensure_future(_result_arrays(store, out))

        async def step() -> None:
            journal.add(_result_event(record, attempt, out, *await arrays))
            if out.finish_reason == "abort":
                journal.add(
                    ev.TurnAborted(
                        request_id=record.request_id,
                        turn=turn,
                        attempt=attempt.attempt,
                        rid=attempt.rid,
                        partial_tokens=len(out.output_ids),
                        message=out.finish_detail,
                    )
                )

        journal.then(step)

    try:
        output = await generate_with_resume(
            ctx.engine,
            url,
            plan.input_ids,
            params,
            max_attempts=ctx.config.max_attempts,
            budget_s=ctx.config.turn_budget_s,
            on_attempt=on_attempt,
            on_result=on_result,
            return_routed_experts=ctx.config.return_routed_experts,
        )
    except MissingLogprobs as exc:
        record.outcome = "missing_logprobs"
        await _fail_turn(
            journal,
            record,
            ev.TurnFailed(
                request_id=record.request_id, turn=turn, reason=f"missing_logprobs: {exc}"
            ),
        )
        raise ApiError(
            "api_error",
            f"the engine returned no logprobs for this turn, so it cannot be recorded "
            f"(never re-tokenized); check that SGLang honours return_logprob ({exc})",
        ) from exc
    except EngineError as exc:
        record.outcome = f"engine_{exc.kind}"
        await _fail_turn(
            journal,
            record,
            ev.EngineError(
                request_id=record.request_id,
                turn=turn,
                attempt=max(0, record.attempts - 1),
                kind=exc.kind,
                status=exc.status,
                message=str(exc),
            ),
        )
        raise _engine_error_answer(exc) from exc
    record.output_tokens = len(output.output_ids)
    record.finish = output.finish_reason
    if output.finish_reason == "abort":
        record.outcome = "aborted"
        await _fail_turn(
            journal,
            record,
            ev.TurnFailed(
                request_id=record.request_id, turn=turn, reason=f"aborted: {output.finish_detail}"
            ),
        )
        raise ApiError(
            "overloaded_error",
            f"the engine kept aborting this turn ({output.finish_detail}); retry later",
        )
    return output


async def _result_arrays(
    store: Any, out: GenerateOutput
) -> tuple[ArrayRef, ArrayRef | None, ArrayRef | None]:
    """(output ids, logprobs, routed experts) refs of one attempt."""
    arrays = [store.put_array(np.asarray(out.output_ids, dtype=np.int32))]
    if out.logprobs is not None:
        arrays.append(store.put_array(np.asarray(out.logprobs, dtype=np.float32)))
    if out.routed_experts is not None:
        arrays.append(store.put_array(np.frombuffer(out.routed_experts, dtype="<i4")))
    refs = await asyncio.gather(*arrays)
    logprobs_ref = refs[1] if out.logprobs is not None else None
    experts_ref = refs[-1] if out.routed_experts is not None else None
    return refs[0], logprobs_ref, experts_ref


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


async def _fail_turn(journal: Any, record: TurnRecord, event: Any) -> None:
    await finish_even_if_cancelled(journal.write(event))


def _engine_error_answer(exc: EngineError) -> ApiError:
    if exc.kind in ("unreachable", "timeout") or exc.status >= 500 or exc.status == 429:
        return ApiError("overloaded_error", f"inference engine unavailable: {exc}; retry later")
    return ApiError("api_error", f"inference engine failed: {exc}")


def _engine_url(ctx: ServerContext, state: SessionState) -> str:
    if state.engine_url not in ctx.engine.urls:
        state.engine_url = ctx.engine.pick(state.session_id)
    return state.engine_url


async def _compose(
    ctx: ServerContext,
    chat: ChatRequest,
    plan: TurnPlan,
    output: TurnOutput,
    record: TurnRecord,
    model: str,
) -> tuple[Answer, ev.TitoVerdict | None]:
    """TITO verdict, reasoning/tool-call parsing, content blocks, stop reason, usage."""
    tok, ids = ctx.tokenizer, output.output_ids
    tito_event = None
    if ids:
        if len(ids) > _THREAD_TITO_TOKENS:
            result = await asyncio.to_thread(tito_check, tok, ids)
        else:
            result = tito_check(tok, ids)
        record.tito = "ok" if result.ok else f"fail@{result.first_divergence}"
        reencoded_ref = None
        if not result.ok:
            reencoded_ref = await ctx.store.put_array(
                np.asarray(result.reencoded_ids, dtype=np.int32)
            )
        tito_event = ev.TitoVerdict(
            rules_version=LIVE_RULES_VERSION,
            request_id=record.request_id,
            turn=record.turn,
            ok=result.ok,
            first_divergence=result.first_divergence,
            reencoded_ids=reencoded_ref,
        )
    ended_with_eos = bool(ids) and ids[-1] in tok.eos_token_ids
    text = tok.decode(ids[:-1] if ended_with_eos else ids)
    stop_sequence = None
    if output.finish_reason == "stop" and not ended_with_eos:
        text, stop_sequence = split_stop_sequence(text, chat.stop_sequences)
    parsed = await ctx.parser.parse(text, chat.tools)
    calls = [ToolCallOut(name=c.name, arguments=dict(c.arguments)) for c in parsed.tool_calls]
    content = build_content(
        parsed.reasoning, parsed.text, calls, [new_tool_use_id() for _ in calls]
    )
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
    )
    return answer, tito_event


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
    remember_refs(state, plan, chain.chain_id, input_ref)
    state.turns_completed += 1


def remember_refs(state: SessionState, plan: TurnPlan, chain_id: int, input_ref: ArrayRef) -> None:
    """Per chain: stored prefixes of its tokens (length -> ref), to store later inputs as deltas.

    Every input a chain was fed is a prefix of the chain's tokens, so the next
    input is stored as its suffix after the longest such ref (the previous
    output travels in that suffix: no extra array write per turn).
    """
    refs = state.chain_refs.get(chain_id)
    if refs is None:
        refs = {}
        source = plan.parent_chain_id if plan.prefix_len else None
        if source is not None:
            refs.update(
                (n, r) for n, r in state.chain_refs.get(source, {}).items() if n <= plan.prefix_len
            )
        state.chain_refs[chain_id] = refs
    refs[input_ref.length] = input_ref
    live = set(state.chains.chains)
    for stale in [c for c in state.chain_refs if c not in live]:
        del state.chain_refs[stale]


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
    try:
        await finish_even_if_cancelled(
            state.journal.write(
                ev.SessionFailed(
                    where=f"turn {record.turn}",
                    error_type=type(exc).__name__,
                    message=str(exc)[:2000],
                    traceback="".join(traceback.format_exception(exc))[-8000:],
                )
            )
        )
    except Exception:
        log.exception("session %s: could not record the failure", state.session_id)
    return await responder.fail(
        ApiError(
            "api_error",
            f"internal error in this session ({type(exc).__name__}: {str(exc)[:200]}); "
            "it was logged and recorded, the session can go on",
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
