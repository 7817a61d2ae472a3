"""A tiny DSL for writing session event logs by hand (reducer tests).

    log = Log("s1").open(instance_id="i-1")
    t1 = log.turn([1, 2, 3], [10, 11])                 # first turn of the main line
    t2 = log.turn(t1.then([4, 5]), [12, 13])           # extends: input = t1 full + [4, 5]
    log.reward(1.0).close()
    result = reduce_session(log.events, log.arrays, Rules())

Everything is deterministic (event ids, timestamps, digests), so two logs
built the same way are equal. `write_to(store, log)` appends a log through a
real store (arrays re-stored, refs rewritten) for the I/O tests.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from recorder.dialects.chat import message_key
from recorder.dialects.translate import response_message_digest
from recorder.log.events import (
    ArrayRef,
    ChainDecision,
    ClientDisconnected,
    EngineError,
    Event,
    GenerateAttempt,
    GenerateResult,
    MessagesRequest,
    NewEvent,
    RecordedEvent,
    RenderedInput,
    ResponseSent,
    RewardAssigned,
    SessionClosed,
    SessionFailed,
    SessionOpened,
    TitoVerdict,
    TokenizerIdentity,
    TurnAborted,
    TurnFailed,
    TurnResumed,
)

MAIN = "sys-main"


def lp_for(tokens: Sequence[int]) -> list[float]:
    """Deterministic, distinct, negative logprobs for some output tokens."""
    return [-(((t * 7) % 13) + 1) / 16.0 for t in tokens]


@dataclass(frozen=True)
class Attempt:
    tokens: list[int]
    version: str = "1"
    finish: str = "stop"
    logprobs: list[float] | None = None
    missing_logprobs: bool = False
    routed: np.ndarray | None = None
    # The attempt's engine was gone (the live server moved the turn): no result.
    gone: bool = False


@dataclass(frozen=True)
class TurnRef:
    turn: int
    input: list[int]
    output: list[int]
    logprobs: list[float] = field(default_factory=list)

    @property
    def full(self) -> list[int]:
        return [*self.input, *self.output]

    def then(self, inserted: Sequence[int]) -> list[int]:
        """The next turn's input: this turn's full sequence + inserted tokens."""
        return [*self.full, *inserted]


class Log:
    def __init__(
        self,
        session_id: str = "s1",
        *,
        context_length: int | None = None,
        pad_token_id: int | None = 0,
        first_seq: int = 0,
        first_position: int = 1,
    ) -> None:
        self.session_id = session_id
        self.context_length = context_length
        self.pad_token_id = pad_token_id
        self.events: list[RecordedEvent] = []
        self.arrays: dict[bytes, np.ndarray] = {}
        self._seq = first_seq
        self._position = first_position
        self._turn = 0
        self.responses: dict[int, list[dict[str, Any]]] = {}

    # -- low level --------------------------------------------------------

    def emit(self, event: Event, *, version: int | None = None) -> Log:
        self.events.append(
            RecordedEvent(
                position=self._position,
                session_id=self.session_id,
                seq=self._seq,
                event_id=uuid.uuid5(uuid.NAMESPACE_OID, f"{self.session_id}/{self._seq}"),
                ts=1_700_000_000.0 + self._seq,
                version=version if version is not None else type(event).VERSION,
                event=event,  # type: ignore[arg-type]
            )
        )
        self._seq += 1
        self._position += 1
        return self

    def array(self, values: Sequence[Any] | np.ndarray, dtype: str = "int32") -> ArrayRef:
        arr = np.asarray(values, dtype=dtype).reshape(-1)
        digest = hashlib.blake2b(dtype.encode() + arr.tobytes(), digest_size=16).digest()
        self.arrays[digest] = arr
        return ArrayRef(digest=digest, length=int(arr.size), dtype=dtype)  # type: ignore[arg-type]

    def answer_key(self, t: TurnRef) -> str:
        """The message key under which a client's echo of `t`'s answer is recorded."""
        return message_key(response_message_digest(self.responses[t.turn]))

    # -- session lifecycle --------------------------------------------------

    def open(self, *, attempt: int = 0, **metadata: Any) -> Log:
        tok = TokenizerIdentity(
            name_or_path="test-tok",
            vocab_size=50_000,
            vocab_digest="v",
            chat_template_digest="t",
            eos_token_ids=(2,),
            pad_token_id=self.pad_token_id,
        )
        return self.emit(
            SessionOpened(
                session_id=self.session_id,
                metadata=metadata,
                tokenizer=tok,
                context_length=self.context_length,
                attempt=attempt,
            )
        )

    def reward(self, value: float) -> Log:
        return self.emit(RewardAssigned(reward=value))

    def reward_v1(self, value: float) -> Log:
        """A RewardAssigned as written by schema v1 (decoded through the upcaster)."""
        from recorder.log.events import decode_event

        raw = msgspec.msgpack.encode({"type": "reward_assigned", "value": value})
        return self.emit(decode_event("reward_assigned", 1, raw), version=1)

    def close(self, status: str = "completed", reason: str = "") -> Log:
        return self.emit(SessionClosed(status=status, reason=reason))  # type: ignore[arg-type]

    def fail(self, message: str = "boom") -> Log:
        return self.emit(SessionFailed(where="turn", error_type="RuntimeError", message=message))

    # -- turns ----------------------------------------------------------------

    def turn(
        self,
        input_ids: Sequence[int],
        output: Sequence[int] | None = None,
        *,
        attempts: Sequence[Attempt] | None = None,
        system: str = MAIN,
        tool_results: Sequence[str] = (),
        tool_uses: Sequence[tuple[str, str]] = (),
        tito_ok: bool | None = True,
        fail: str | None = None,
        disconnect: bool = False,
        engine_error: bool = False,
        respond: bool = True,
        decision: tuple[str, str] | None = None,
        chain_id: int = 0,
        prefix_len: int = 0,
        body: bytes | None = None,
        reencoded: Sequence[int] | None = None,
        n_chat_messages: int | None = None,
        n_tools: int | None = None,
        answers: Sequence[TurnRef] = (),
    ) -> TurnRef:
        """One engine call. `tool_uses` = (id, name) blocks in the response.

        `answers`: earlier turns whose answers this request carries (recorded
        as `MessagesRequest.answer_keys`, as the server does for a request
        that extends no chain).
        """
        turn = self._turn
        self._turn += 1
        rid = f"req-{self.session_id}-{turn}"
        if body is None:
            body = json.dumps({"system": system, "turn": turn}).encode()
        self.emit(
            MessagesRequest(
                request_id=rid,
                turn=turn,
                body=self.array(np.frombuffer(body, dtype=np.uint8), "uint8"),
                system_digest=system,
                tool_result_ids=tuple(tool_results),
                n_messages=turn * 2 + 1,
                n_chat_messages=n_chat_messages,
                n_tools=n_tools,
                answer_keys=tuple(self.answer_key(a) for a in answers) if answers else None,
            )
        )
        action, reason = decision or (("new", "first") if turn == 0 else ("extend", "extends"))
        self.emit(
            ChainDecision(
                rules_version="live-1",
                request_id=rid,
                turn=turn,
                chain_id=chain_id,
                action=action,  # type: ignore[arg-type]
                reason=reason,  # type: ignore[arg-type]
            )
        )
        self.emit(
            RenderedInput(
                request_id=rid,
                turn=turn,
                chain_id=chain_id,
                input_ids=self.array(input_ids),
                prefix_len=prefix_len,
            )
        )
        if attempts is None:
            attempts = [Attempt(list(output or []))]
        all_out: list[int] = []
        all_lp: list[float] = []
        for k, a in enumerate(attempts):
            if k > 0:
                self.emit(
                    TurnResumed(
                        request_id=rid,
                        turn=turn,
                        attempt=k,
                        resumed_tokens=len(all_out),
                        remaining_new_tokens=100,
                    )
                )
            self.emit(
                GenerateAttempt(request_id=rid, turn=turn, attempt=k, rid=f"{turn:016x}{k:016x}")
            )
            if a.gone:
                self.emit(EngineError(request_id=rid, turn=turn, attempt=k, kind="unreachable"))
                continue
            lps = a.logprobs if a.logprobs is not None else lp_for(a.tokens)
            self.emit(
                GenerateResult(
                    request_id=rid,
                    turn=turn,
                    attempt=k,
                    rid=f"{turn:016x}{k:016x}",
                    output_ids=self.array(a.tokens),
                    logprobs=None if a.missing_logprobs else self.array(lps, "float32"),
                    finish_reason=a.finish,  # type: ignore[arg-type]
                    weight_version=a.version,
                    routed_experts=None if a.routed is None else self.array(a.routed),
                )
            )
            all_out += a.tokens
            all_lp += [float(np.float32(x)) for x in lps]
            if a.finish == "abort":
                self.emit(
                    TurnAborted(
                        request_id=rid,
                        turn=turn,
                        attempt=k,
                        rid=f"{turn:016x}{k:016x}",
                        partial_tokens=len(a.tokens),
                    )
                )
        if engine_error:
            self.emit(EngineError(request_id=rid, turn=turn, kind="http", status=502))
        if disconnect:
            self.emit(ClientDisconnected(request_id=rid, turn=turn))
        if fail is not None:
            self.emit(TurnFailed(request_id=rid, turn=turn, reason=fail))
            return TurnRef(turn, list(input_ids), all_out, all_lp)
        if tito_ok is not None:
            self.emit(
                TitoVerdict(
                    rules_version="live-1",
                    request_id=rid,
                    turn=turn,
                    ok=tito_ok,
                    first_divergence=None if tito_ok else 0,
                    reencoded_ids=None if reencoded is None else self.array(reencoded),
                )
            )
        if respond:
            content: list[dict[str, Any]] = [{"type": "text", "text": f"turn {turn}"}]
            content += [
                {"type": "tool_use", "id": tid, "name": name, "input": {}}
                for tid, name in tool_uses
            ]
            self.responses[turn] = content
            self.emit(
                ResponseSent(
                    request_id=rid,
                    turn=turn,
                    content=content,
                    stop_reason="tool_use" if tool_uses else "end_turn",
                )
            )
        return TurnRef(turn, list(input_ids), all_out, all_lp)


def _rewrite_refs(event: Event, mapping: dict[bytes, ArrayRef]) -> Event:
    changes = {}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if isinstance(value, ArrayRef):
            changes[name] = mapping[value.digest]
    return msgspec.structs.replace(event, **changes) if changes else event


async def write_to(store: Any, log: Log, *, batch: int = 64) -> None:
    """Append a hand-written log through a real store, storing its arrays."""
    mapping: dict[bytes, ArrayRef] = {}
    for digest, arr in log.arrays.items():
        mapping[digest] = await store.put_array(arr)
    events = [
        NewEvent(event=_rewrite_refs(r.event, mapping), event_id=r.event_id, ts=r.ts)  # type: ignore[arg-type]
        for r in sorted(log.events, key=lambda r: r.seq)
    ]
    for i in range(0, len(events), batch):
        await store.append(log.session_id, events[i : i + batch])


def small_logs() -> list[Log]:
    """Four sessions covering a linear run, a compaction, a subagent and a failure."""
    sub = "sys-sub"
    logs = []
    a = Log("a-linear").open(instance_id="i-a", group_index=0, sample_index=0)
    t = a.turn([1, 2, 3], [10, 11, 2], tool_uses=[("tu1", "Bash")])
    t = a.turn(t.then([4, 5]), [12, 2], tool_results=["tu1"], tito_ok=False)
    a.reward(1.0).close()
    logs.append(a)

    b = Log("b-compact").open(instance_id="i-b", group_index=0, sample_index=1)
    t = b.turn([1, 2, 3], [20, 21])
    b.turn(t.then([6]), [22, 23])
    t = b.turn([1, 2, 77], [24])
    b.turn(t.then([7]), [25, 2])
    b.reward(0.5).close()
    logs.append(b)

    c = Log("c-subagent").open(instance_id="i-c", group_index=1, sample_index=0)
    m = c.turn([1, 2, 3], [30], tool_uses=[("ag", "Agent")])
    s = c.turn([50, 51], [60, 61], system=sub)
    c.turn(s.then([52]), [62, 2], system=sub)
    c.turn(
        m.then([8]),
        attempts=[Attempt([31, 32], version="1", finish="abort"), Attempt([33, 2], version="2")],
        tool_results=["ag"],
    )
    c.reward(0.0).close()
    logs.append(c)

    d = Log("d-failed").open(instance_id="i-d", group_index=1, sample_index=1)
    d.turn([1, 2], [40, 41])
    d.fail("sandbox crashed").close("failed", reason="sandbox crashed")
    logs.append(d)
    return logs
