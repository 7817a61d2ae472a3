"""Many sessions at once, faults in some of them: the others never notice."""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic

from recorder.log import events as ev
from replay import check_invariants
from tests.server.conftest import Harness, make_harness
from tests.server.test_e2e import ask, echo
from tools.test_engine import Fault
from tools.test_engine.scripted import Reply

SESSIONS = 64
TURNS = 10


class ExplodingParser:
    """Raises on one marker: an unexpected bug inside one session's turn."""

    label = "exploding test parser"

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def parse(self, text: str, tools: list[dict[str, Any]]) -> Any:
        if "BOOM" in text:
            raise RuntimeError("unexpected parser failure")
        return await self.inner.parse(text, tools)


def marker(i: int, k: int) -> str:
    return f"[s{i}:t{k}]"


def inject_faults(h: Harness) -> dict[int, int]:
    """Faults for sessions i % 8 in 0..3; returns the errors each session should see."""
    expected: dict[int, int] = {}
    for i in range(SESSIONS):
        kind = i % 8
        if kind == 0:
            h.engine.inject(Fault(match=marker(i, 3), status=503))
            expected[i] = 1
        elif kind == 1:
            h.engine.inject(Fault(match=marker(i, 5), logprobs="missing"))
            expected[i] = 1
        elif kind == 2:
            h.engine.inject(Fault(match=marker(i, 2), abort_after=2))
            expected[i] = 0  # resumed transparently
        elif kind == 3:
            h.engine.push(Reply(text="BOOM", match=marker(i, 4)))
            expected[i] = 1
        else:
            expected[i] = 0
    return expected


async def run_session(h: Harness, i: int, sid: str) -> list[str]:
    """Ten turns like an agent with a retrying client; returns the error types seen
    (an HTTP error status, or an `event: error` once a stream was open)."""
    client = h.client(sid)
    messages: list[dict[str, Any]] = []
    errors: list[str] = []
    for k in range(TURNS):
        messages.append({"role": "user", "content": f"{marker(i, k)} next step please"})
        for _ in range(3):
            try:
                answer = await ask(client, messages, stream=(i + k) % 2 == 0, tools=[])
                break
            except anthropic.APIStatusError as exc:
                errors.append(exc.body["error"]["type"])  # type: ignore[index]
        else:
            raise AssertionError(f"session {i} turn {k} never succeeded: {errors}")
        messages.append(echo(answer))
    return errors


async def test_64_sessions_with_faults(tokenizer: Any, sqlite_url: str) -> None:
    h = await make_harness(tokenizer, sqlite_url)
    try:
        h.ctx.parser = ExplodingParser(h.ctx.parser)  # type: ignore[assignment]
        expected = inject_faults(h)
        sids = [await h.open_session(index=i) for i in range(SESSIONS)]
        errors = await asyncio.gather(*(run_session(h, i, sid) for i, sid in enumerate(sids)))
        for i, seen in enumerate(errors):
            assert len(seen) == expected[i], (i, seen)
        assert sorted({s for seen in errors for s in seen}) == ["api_error", "overloaded_error"]

        for i, sid in enumerate(sids):
            payloads = await h.payloads(sid)
            answered = [e for e in payloads if isinstance(e, ev.ResponseSent)]
            assert len(answered) == TURNS, i
            turns = [getattr(e, "turn", None) for e in payloads[1:]]
            turns = [t for t in turns if t is not None]
            assert turns == sorted(turns), i  # no interleaving inside a session
            decisions = [e for e in payloads if isinstance(e, ev.ChainDecision)]
            if expected[i] == 0 and i % 8 != 2:
                assert [d.action for d in decisions] == ["new"] + ["extend"] * (TURNS - 1), i
                assert not any(
                    isinstance(
                        e, ev.EngineError | ev.TurnFailed | ev.SessionFailed | ev.TurnAborted
                    )
                    for e in payloads
                ), i

        # Fault kinds were recorded where they happened, and only there.
        async def count(offset: int, kind: type) -> int:
            return sum([len(await h.payloads(sid, kind)) for sid in sids[offset::8]])

        assert await count(0, ev.EngineError) == SESSIONS // 8
        assert await count(1, ev.TurnFailed) == SESSIONS // 8
        assert await count(2, ev.TurnResumed) == SESSIONS // 8
        assert await count(3, ev.SessionFailed) == SESSIONS // 8
        assert await count(4, ev.EngineError) + await count(4, ev.TurnFailed) == 0

        # Every healthy session closes into one sample covering all its turns.
        for i in range(4, SESSIONS, 8):
            status, data = await h.admin("POST", f"/sessions/{sids[i]}/close", {"reward": 1.0})
            assert status == 200 and not data["placeholder"], data
            (sample,) = data["samples"]
            assert sample["status"] == "completed"
        from replay import close_session_samples

        result = await close_session_samples(h.store, sids[4], h.ctx.rules)
        for sample in result.samples:
            check_invariants(sample, context_length=h.config.context_length)
        assert result.turns_used == TURNS
    finally:
        await h.close()
