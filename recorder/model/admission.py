"""Refuse, before any tokenizing, a prompt whose text alone cannot fit the context.

Tokenizing is the one step whose cost grows with the body and cannot be
avoided once started: 8 MB of text is 3 s and ~1 GB of tokenizer state, 63 MB
is minutes. Yet most such bodies are refused in the end as too long. A token
stands for at most `Tokenizer.max_token_chars` characters, so the text the
template will certainly render (every user, tool and system message) gives a
lower bound on the prompt's tokens from its length alone. When that bound
already leaves no room to generate, the request is refused with the same
"prompt is too long" an exact count gives, at the cost of summing lengths.

Assistant messages are not counted: a parse policy or template may drop parts
of them (reasoning of earlier turns), and a lower bound must never overcount.
"""

from __future__ import annotations

from typing import Any, Protocol

from recorder.dialects.chat import ChatRequest
from recorder.model.tokens import ContextOverflow

_RENDERED_ROLES = frozenset({"user", "tool", "system"})


class _Bounded(Protocol):
    max_token_chars: int


class PromptCannotFit(ContextOverflow):
    """`ContextOverflow` known from the text's length alone (nothing was tokenized)."""

    def __init__(self, min_tokens: int, context_length: int) -> None:
        super().__init__(min_tokens, context_length, at_least=True)


def min_prompt_tokens(chat: ChatRequest, tok: _Bounded) -> int:
    """A lower bound on the tokens of `chat`'s rendered prompt, from text lengths only.

    The lengths are summed as the request is translated (`ChatRequest.text_chars`),
    so a turn does not walk every message of a long conversation again.
    """
    chars = chat.text_chars
    if chars < 0:
        chars = sum(
            _chars(m.get("content")) for m in chat.messages if m.get("role") in _RENDERED_ROLES
        )
    return chars // max(tok.max_token_chars, 1)


def check_fits(chat: ChatRequest, tok: _Bounded, context_length: int) -> None:
    """Raise `PromptCannotFit` if `chat` certainly leaves no room to generate one token."""
    bound = min_prompt_tokens(chat, tok)
    if bound >= context_length:
        raise PromptCannotFit(bound, context_length)


def _chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(
            len(b["text"]) for b in value if isinstance(b, dict) and isinstance(b.get("text"), str)
        )
    return 0
