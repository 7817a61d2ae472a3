"""Wire dialects over the one turn model (STYLE.md 4b).

A dialect is a value that translates at the two edges: request bytes ->
`ChatRequest`, `Answer` -> JSON body or SSE frames, `ApiError` -> its error
shape. The chain, engine, TITO and event logic (recorder/server/turn.py)
never branches on it; the responders take one.
"""

from __future__ import annotations

from recorder.dialects.anthropic import ANTHROPIC
from recorder.dialects.base import Dialect, History
from recorder.dialects.openai_chat import OPENAI_CHAT
from recorder.dialects.openai_responses import OPENAI_RESPONSES

DIALECTS: dict[str, Dialect] = {d.name: d for d in (ANTHROPIC, OPENAI_CHAT, OPENAI_RESPONSES)}


def dialect_named(name: str) -> Dialect:
    """The dialect a request was recorded with (`MessagesRequest.dialect`)."""
    try:
        return DIALECTS[name]
    except KeyError:
        raise ValueError(
            f"unknown dialect {name!r} in the log (known: {', '.join(DIALECTS)}); "
            "upgrade the recorder that reads it"
        ) from None


__all__ = ["ANTHROPIC", "DIALECTS", "OPENAI_CHAT", "OPENAI_RESPONSES", "Dialect", "History"]
__all__ += ["dialect_named"]
