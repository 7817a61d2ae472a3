"""A turn's generation: attempts resumed after engine aborts, moved off engines that are gone.

`generate_with_resume` turns engine aborts (weight updates pause the engine
with mode "abort") into re-submissions of prompt + partial output and
stitches the pieces, calling back before and after every attempt so the
caller can record each one as an event. With several engines it also moves
a turn whose engine is gone (a refused connection, a dropped one and a
failing health check, or a failing health check while the engine holds the
request) to a live one, each engine at most once per turn: the failed
attempt has no output, so the stitched tokens are exactly the answered
attempts'.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import msgspec
import numpy as np

from recorder.model.engine import EngineClient
from recorder.model.engine_wire import (
    EngineError,
    FinishReason,
    GenerateOutput,
    MissingLogprobs,
    SamplingParams,
    json_ids,
    new_rid,
    resumed_prompt,
)

log = logging.getLogger("recorder.model.engine")


class Attempt(msgspec.Struct):
    """One `/generate` call of a turn, sent to the engine at `url`.
    `resumed_tokens` partial-output tokens were appended to the turn's input
    for this attempt."""

    attempt: int
    rid: str
    resumed_tokens: int
    max_new_tokens: int
    url: str = ""


class TurnOutput(msgspec.Struct):
    """A turn's stitched output.

    `finish_reason == "abort"` means the resume budget (attempts or time)
    ran out: the output is partial and the turn should be failed.
    """

    output_ids: list[int]
    logprobs: list[float]
    weight_versions: list[str]
    finish_reason: FinishReason
    finish_detail: str
    attempts: list[Attempt]
    results: list[GenerateOutput]

    @property
    def prompt_tokens(self) -> int:
        return self.results[0].prompt_tokens if self.results else 0

    @property
    def cached_tokens(self) -> int:
        return self.results[0].cached_tokens if self.results else 0


async def generate_with_resume(
    client: EngineClient,
    url: str,
    input_ids: Sequence[int] | np.ndarray,
    params: SamplingParams,
    *,
    max_attempts: int = 8,
    budget_s: float = 3600,
    on_attempt: Callable[[Attempt], Awaitable[None]],
    on_result: Callable[[Attempt, GenerateOutput], Awaitable[None]],
    on_sent: Callable[[], None] | None = None,
    return_routed_experts: bool = False,
    session_id: str | None = None,
    on_moved: Callable[[Attempt, EngineError, str], Awaitable[None]] | None = None,
) -> TurnOutput:
    """Generate one turn, resuming after engine aborts.

    Each attempt sends `input_ids` + all output so far with `max_new_tokens`
    reduced by what was already generated. Raises MissingLogprobs (after
    `on_result` saw the offending output), EngineError, or CancelledError
    (after asking the engine to abort the in-flight rid). `on_sent` is called
    each time an attempt's request has been sent (see `EngineClient.generate`).

    With `session_id`, an attempt whose engine is gone goes on as the next
    attempt on the live engine `EngineClient.replacement` names, after
    `on_moved(failed attempt, its error, new url)`; every engine is tried at
    most once per turn. `max_attempts` counts the attempts an engine answered.
    """
    prompt = json_ids(input_ids)
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[str] = []
    attempts: list[Attempt] = []
    results: list[GenerateOutput] = []
    tried = {url}
    deadline = time.monotonic() + budget_s
    finish: FinishReason = "abort"
    detail = f"resume budget exhausted ({max_attempts} attempts, {budget_s:g}s)"
    while len(results) < max_attempts:
        remaining = params.max_new_tokens - len(ids)
        if remaining <= 0:
            finish, detail = "length", str(params.max_new_tokens)
            break
        time_left = deadline - time.monotonic()
        if time_left <= 0:
            break
        attempt = Attempt(
            attempt=len(attempts),
            rid=new_rid(),
            resumed_tokens=len(ids),
            max_new_tokens=remaining,
            url=url,
        )
        attempts.append(attempt)
        await on_attempt(attempt)
        try:
            out = await _one_attempt(
                client,
                url,
                resumed_prompt(prompt, ids),
                params.with_max_new_tokens(remaining),
                attempt.rid,
                time_left,
                return_routed_experts,
                on_sent,
                session_id,
            )
        except EngineError as exc:
            moved = None
            if session_id is not None:
                moved = await client.replacement(session_id, url, exc, tried)
            if moved is None:
                raise
            if on_moved is not None:
                await on_moved(attempt, exc, moved)
            tried.add(moved)
            url = moved
            continue
        results.append(out)
        await on_result(attempt, out)
        if out.logprobs is None:
            raise MissingLogprobs(attempt.rid, len(out.output_ids))
        ids += out.output_ids
        logprobs += out.logprobs
        versions += [out.weight_version] * len(out.output_ids)
        if out.finish_reason != "abort":
            finish, detail = out.finish_reason, out.finish_detail
            break
    return TurnOutput(
        output_ids=ids,
        logprobs=logprobs,
        weight_versions=versions,
        finish_reason=finish,
        finish_detail=detail,
        attempts=attempts,
        results=results,
    )


async def _one_attempt(
    client: EngineClient,
    url: str,
    input_ids: list[int] | np.ndarray,
    params: SamplingParams,
    rid: str,
    time_left: float,
    return_routed_experts: bool,
    on_sent: Callable[[], None] | None,
    session_id: str | None,
) -> GenerateOutput:
    try:
        async with asyncio.timeout(time_left):
            return await _while_live(
                client,
                url,
                client.generate(
                    url,
                    input_ids,
                    params,
                    rid,
                    return_routed_experts=return_routed_experts,
                    on_sent=on_sent,
                    cache_key=session_id,
                ),
            )
    except asyncio.CancelledError:
        # The caller went away (client disconnect): free the engine's slot.
        await _abort(client, url, rid)
        raise
    except TimeoutError as exc:
        await _abort(client, url, rid)
        raise EngineError("timeout", f"turn time budget ran out (rid {rid})", url=url) from exc
    except EngineError as exc:
        if exc.kind == "timeout" or exc.may_be_running:
            await _abort(client, url, rid)
        raise


async def _while_live(
    client: EngineClient, url: str, request: Awaitable[GenerateOutput]
) -> GenerateOutput:
    """`request`, given up when `url` is marked down meanwhile (its health check failed).

    An engine whose node died may never reset the connection: without this the
    attempt would wait for the turn budget. Not watched when `url` is down already
    (the only engine left, or all down): nothing would be better.

    `request` runs in this task, which the engine going down cancels (no watcher
    task: it would cost loop iterations on every attempt).
    """
    if not client.live(url):
        return await request
    task = asyncio.current_task()
    assert task is not None
    down = client.went_down(url)
    interrupted = watching = False

    def interrupt(_: object) -> None:
        nonlocal interrupted
        if watching:  # a callback scheduled just before the request ended finds it gone
            interrupted = True
            task.cancel()

    watching = True
    down.add_done_callback(interrupt)
    try:
        answer = await request
    except asyncio.CancelledError:
        if not interrupted or task.uncancel() > 0:  # also cancelled from outside
            raise
        raise EngineError(
            "unreachable",
            "failed its health check while generating",
            url=url,
            may_be_running=True,
        ) from None
    finally:
        watching = False
        down.remove_done_callback(interrupt)
    if interrupted:  # the request finished anyway: take the cancel back
        task.uncancel()
    return answer


async def _abort(client: EngineClient, url: str, rid: str) -> None:
    """Ask the engine to drop `rid`, not cut short by a cancel; for an engine marked
    down without waiting (a dead node may not answer for the whole request timeout)."""
    abort = client.detach(_abort_quietly(client, url, rid))
    if client.live(url):
        await asyncio.shield(abort)


async def _abort_quietly(client: EngineClient, url: str, rid: str) -> None:
    try:
        await client.abort(url, rid)
    except (EngineError, RuntimeError) as exc:
        log.warning("could not abort rid %s on %s: %s", rid, url, exc)
