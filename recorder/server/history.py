"""`previous_response_id`, resolved from the session's log.

A Responses client that chains by id sends only the new input items; the
conversation they extend is the earlier request's (itself perhaps chained)
plus the answer it got, both in the log. Nothing is kept in memory, so a
restarted recorder resolves the same ids, and restore resolves them the
same way from the events it reads.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np

from recorder.dialects.anthropic_wire import Message
from recorder.dialects.base import History
from recorder.dialects.chat import InvalidRequest
from recorder.dialects.openai_common import decode
from recorder.dialects.openai_responses import (
    OPENAI_RESPONSES,
    ResponsesRequest,
    answered,
    request_messages,
)
from recorder.log import events as ev
from recorder.log.events import RecordedEvent
from recorder.log.store.base import EventStore

Events = Callable[[], Awaitable[list[RecordedEvent]]]


MEMO_SIZE = 16
"""Resolved conversations a session keeps (the newest ids; a client chains from the last)."""


def log_history(
    store: EventStore, events: Events, memo: dict[str, list[Message]] | None = None
) -> History:
    """A resolver reading `events()` once, on its first use; `memo` keeps what it resolved."""
    loaded: list[RecordedEvent] | None = None
    memo = {} if memo is None else memo

    async def resolve(response_id: str) -> list[Message]:
        nonlocal loaded
        if response_id in memo:
            return memo[response_id]
        if loaded is None:
            loaded = await events()
        request, sent = _find(loaded, response_id)
        (body,) = await store.get_arrays([request.body])
        raw = np.asarray(body, dtype=np.uint8).tobytes()
        previous = decode(raw, ResponsesRequest).previous_response_id
        earlier = await resolve(previous) if previous else []
        memo[response_id] = resolved = answered(request_messages(raw, earlier), sent.content)
        while len(memo) > MEMO_SIZE:
            del memo[next(iter(memo))]
        return resolved

    return resolve


def _find(
    events: list[RecordedEvent], response_id: str
) -> tuple[ev.MessagesRequest, ev.ResponseSent]:
    request = sent = None
    for record in events:
        e = record.event
        if isinstance(e, ev.MessagesRequest) and e.request_id == response_id:
            request = e
        elif isinstance(e, ev.ResponseSent) and e.request_id == response_id and e.status == 200:
            sent = e
    if request is None or sent is None or request.dialect != OPENAI_RESPONSES.name:
        raise InvalidRequest(
            f"no answered response {response_id!r} in this session; send an `id` of an earlier "
            "/v1/responses answer of the same session, or the whole conversation as `input`",
            "previous_response_id",
        )
    return request, sent
