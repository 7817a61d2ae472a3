"""Probes that time an in-process recorder's own calls: store writes, turn planning, parsing.

`Planner` stands in for the server's `plan_turn` (ours, or the full
re-render peer when `mode` is "baseline") and wraps every dialect's `parse`,
timing each call; `time_store_calls` records the intervals the store's
`append` / `put_array` calls were in flight. Patched inside this process only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import recorder.server.turn as turn_module
from recorder.dialects.anthropic import Anthropic
from recorder.dialects.chat import ChatRequest
from recorder.dialects.openai_chat import OpenAIChat
from recorder.dialects.openai_responses import OpenAIResponses
from recorder.log.store.base import EventStore
from recorder.model.tokenizer import Tokenizer
from recorder.model.tokens import SessionChains, TurnPlan, plan_turn
from tools.benchkit.peer import full_render_plan
from tools.benchkit.stats import Span


def time_store_calls(store: EventStore, spans: list[Span]) -> None:
    """Record every `append` / `put_array` call's interval (instance-level wrappers)."""
    for name in ("append", "put_array"):
        call = getattr(store, name)

        def timed(*args: Any, _call: Any = call, **kwargs: Any) -> Any:
            async def run() -> Any:
                t0 = time.perf_counter()
                try:
                    return await _call(*args, **kwargs)
                finally:
                    spans.append(Span(t0, time.perf_counter()))

            return run()

        setattr(store, name, timed)


@dataclass
class PlanCall:
    mode: str
    seconds: float
    prompt_tokens: int
    new_tokens: int


class Planner:
    """Stands in for the server's `plan_turn`; `mode` picks ours or the baseline."""

    def __init__(self) -> None:
        self.mode = "ours"
        self.calls: list[PlanCall] = []
        self.parse_s: list[float] = []  # the server's parse_request, timed the same way

    def __call__(
        self,
        chains: SessionChains,
        req: ChatRequest,
        tok: Tokenizer,
        context_length: int | None = None,
    ) -> TurnPlan:
        fn = full_render_plan if self.mode == "baseline" else plan_turn
        t0 = time.perf_counter()
        plan = fn(chains, req, tok, context_length)
        seconds = time.perf_counter() - t0
        self.calls.append(PlanCall(self.mode, seconds, len(plan.input_ids), plan.new_tokens))
        return plan

    def timed_parse(self, original: Any) -> Any:
        """A dialect's `parse` (body -> ChatRequest, whatever the wire), timed."""

        async def parse(dialect: Any, body: bytes, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await original(dialect, body, **kwargs)
            finally:
                self.parse_s.append(time.perf_counter() - t0)

        return parse

    @contextlib.contextmanager
    def installed(self) -> Iterator[Planner]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(turn_module, "plan_turn", self))
            for cls in (Anthropic, OpenAIChat, OpenAIResponses):
                stack.enter_context(mock.patch.object(cls, "parse", self.timed_parse(cls.parse)))
            yield self
