"""Claude-Code-shaped sessions: synthetic code-like text, tools, and a conversation that grows.

Every session built with the same seed gets the same tool results; the
assistant turns are what the server answered, echoed back verbatim.
"""

from __future__ import annotations

import json
import random
from typing import Any

from recorder.model.tokenizer import Tokenizer

_VOCAB = (
    "def return self import class value result error file path test module function "
    "config None True False for in if else while try except raise assert len range "
    "print list dict str int data index token chain session event store async await"
)
_WORDS = _VOCAB.split()

# The model's ~50-token call and the template's ~15-token tool-result wrapping.
FIXED_TOKENS_PER_TURN = 65


def text(rng: random.Random, n_words: int) -> str:
    """`n_words` of code-like words, 12 to an indented line."""
    lines, line = [], []
    for _ in range(n_words):
        line.append(rng.choice(_WORDS))
        if len(line) >= 12:
            lines.append("    " + " ".join(line))
            line = []
    lines.append(" ".join(line))
    return "\n".join(lines)


def words_per_token(tok: Tokenizer) -> float:
    """How many of `text`'s words make one token: sizes tool results in tokens."""
    sample = text(random.Random(3), 2000)
    return 2000 / len(tok.encode(sample))


def tools(n: int) -> list[dict[str, Any]]:
    """`n` generic tools with a schema each, the bulk of an agent's preamble."""
    return [
        {
            "name": f"Tool{i}",
            "description": f"Tool number {i}. " + "It does useful things with files. " * 6,
            "input_schema": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Absolute path."},
                    "mode": {"type": "string", "enum": ["read", "write", "append"]},
                    "limit": {"type": "integer", "minimum": 1},
                },
                "required": ["path"],
            },
            "cache_control": {"type": "ephemeral"},
        }
        for i in range(n)
    ]


_CC_TOOLS = [
    ("Read", "Reads a file from the local filesystem.", {"file_path": "string", "offset": "integer", "limit": "integer"}),
    ("Bash", "Executes a bash command in a persistent shell session.", {"command": "string", "timeout": "integer"}),
    ("Edit", "Performs exact string replacements in files.", {"file_path": "string", "old_string": "string", "new_string": "string"}),
    ("Grep", "A search tool built on ripgrep.", {"pattern": "string", "path": "string", "glob": "string"}),
]  # fmt: skip


def cc_tools() -> list[dict[str, Any]]:
    """Claude Code's Read / Bash / Edit / Grep, as its requests declare them."""
    return [
        {
            "name": name,
            "description": description,
            "input_schema": {
                "type": "object",
                "properties": {k: {"type": t} for k, t in props.items()},
                "required": [next(iter(props))],
            },
            "cache_control": {"type": "ephemeral"},
        }
        for name, description, props in _CC_TOOLS
    ]


class Conversation:
    """One session's side of a Claude-Code-shaped tool-use conversation.

    The body is laid out as Claude Code 2.1.197 sends it: messages first, then
    system prompt, tools and the rest, with the billing header and metadata
    the same all session. `instructions_words` / `n_tools` scale the constant
    preamble (Claude Code's own is ~70 kB: ~2,000 words and ~20 tools here).
    """

    def __init__(
        self, seed: int = 7, *, instructions_words: int = 80, n_tools: int | None = None
    ) -> None:
        self.rng = random.Random(seed)
        self.instructions = text(random.Random(1), instructions_words)
        self.tools = cc_tools() if n_tools is None else cc_tools() + tools(n_tools)
        self.messages: list[dict[str, Any]] = [
            {"role": "user", "content": "Fix the failing tests. " + text(self.rng, 20)}
        ]
        self.tag = f"{random.Random(seed).getrandbits(32):08x}"
        self.turn = 0

    def body(self) -> bytes:
        self.turn += 1
        system = [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.0df; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": "Instructions. " + self.instructions, "cache_control": {"type": "ephemeral"}},
        ]  # fmt: skip
        return json.dumps(
            {
                "model": "bench",
                "messages": self.messages,
                "system": system,
                "tools": self.tools,
                "metadata": {"user_id": json.dumps({"device_id": "bench", "session_id": self.tag})},
                "max_tokens": 4096,
                "thinking": {"type": "adaptive"},
                "stream": True,
            }
        ).encode()

    def add_answer(self, content: list[dict[str, Any]]) -> None:
        self.messages.append({"role": "assistant", "content": content})

    def add_tool_result(self, n_words: int) -> None:
        calls = [b for b in self.messages[-1]["content"] if b.get("type") == "tool_use"]
        if not calls:
            raise RuntimeError(f"the model answered without a tool call: {self.messages[-1]}")
        block = {
            "type": "tool_result",
            "tool_use_id": calls[-1]["id"],
            "content": text(self.rng, n_words),
        }
        self.messages.append({"role": "user", "content": [block]})


def assistant_text(tok: Tokenizer, message: dict[str, Any]) -> str:
    """An assistant message as the chat template renders it after a prompt, newline stripped."""
    head = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    start = tok.render(head, None, True)
    return tok.render([*head, message], None, False)[len(start) :].rstrip("\n")


def tool_call_reply(tok: Tokenizer, n: int, k: int = 0, words: int = 0) -> str:
    """The model's ~50-token turn: a sentence and a Read call, written the way
    the chat template renders it (so a full re-render reproduces its tokens).

    `k` numbers the engine's answers: every output differs, as a sampling
    model's would, so no turn's output arrays are already stored. `words`:
    that many words of reasoning-like text before the call (a thinking
    model's turn runs to hundreds or thousands of tokens)."""
    content = "I will read the next file to find the failing test."
    if words:
        content = f"{content}\n{text(random.Random(k), words).strip()}"
    message = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {
                "id": "call",
                "type": "function",
                "function": {
                    "name": "Read",
                    "arguments": {"file_path": f"/repo/src/pkg/module_{n:06d}_{k % 10_000:04d}.py", "offset": 1, "limit": 400},
                },
            }
        ],
    }  # fmt: skip
    return assistant_text(tok, message).removesuffix(tok.decode([tok.eos_token_ids[0]]))
