"""Builders for Anthropic conversations driven through the token-chain layer.

`Conversation` plays both sides: it holds the client's message history (what
Claude Code would send), and turns a scripted model answer into output ids the
way an engine would emit them, plus the response content blocks the server
would send back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recorder.dialects.chat import ChatRequest
from recorder.dialects.translate import parse_request, response_message_digest
from recorder.model.tokenizer import Tokenizer, load_tokenizer
from recorder.model.tokens import SessionChains, TurnPlan, commit_turn, plan_turn

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "tests" / "data" / "smollm2-tokenizer"
TEMPLATE = REPO / "recorder" / "model" / "templates" / "chatml-tools.jinja"


def load_test_tokenizer() -> Tokenizer:
    return load_tokenizer(str(TOKENIZER_DIR), chat_template=str(TEMPLATE))


TOOLS = [
    {
        "name": "Bash",
        "description": "Run a shell command.",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
        "cache_control": {"type": "ephemeral"},
    },
    {
        "name": "Agent",
        "description": "Launch a subagent.",
        "input_schema": {
            "type": "object",
            "properties": {
                "description": {"type": "string"},
                "prompt": {"type": "string"},
                "subagent_type": {"type": "string"},
            },
        },
    },
]


@dataclass
class Answer:
    """A scripted model answer."""

    text: str = ""
    thinking: str = ""
    tool_calls: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)

    def content(self) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = []
        if self.thinking:
            blocks.append({"type": "thinking", "thinking": self.thinking, "signature": "sig"})
        if self.text:
            blocks.append({"type": "text", "text": self.text})
        for call_id, name, args in self.tool_calls:
            blocks.append({"type": "tool_use", "id": call_id, "name": name, "input": args})
        return blocks

    def chat_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.thinking:
            message["reasoning_content"] = self.thinking
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in self.tool_calls
            ]
        return message


def canonical_output_ids(tok: Tokenizer, answer: Answer, *, eos: bool = True) -> list[int]:
    """The ids the template would give this answer (as a well-behaved model emits them)."""
    head = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    start = tok.render(head, None, True)
    full = tok.render([*head, answer.chat_message()], None, False)
    text = full[len(start) :].rstrip("\n")
    if not eos:
        text = text.removesuffix("<|im_end|>")
    return tok.encode(text)


@dataclass
class Conversation:
    system: str | list[dict[str, Any]] = "You are a coding agent."
    tools: list[dict[str, Any]] = field(default_factory=lambda: list(TOOLS))
    messages: list[dict[str, Any]] = field(default_factory=list)
    max_tokens: int = 256

    def user(self, text: str) -> Conversation:
        self.messages.append({"role": "user", "content": text})
        return self

    def tool_results(self, *results: tuple[str, str]) -> Conversation:
        self.messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": i, "content": c} for i, c in results
                ],
            }
        )
        return self

    def body(self) -> bytes:
        return json.dumps(
            {
                "model": "test",
                "max_tokens": self.max_tokens,
                "system": self.system,
                "tools": self.tools,
                "messages": self.messages,
                "stream": True,
            }
        ).encode()

    def request(self) -> ChatRequest:
        return parse_request(self.body())

    def turn(
        self,
        chains: SessionChains,
        tok: Tokenizer,
        answer: Answer,
        *,
        output_ids: list[int] | None = None,
        eos: bool = True,
    ) -> tuple[TurnPlan, list[int]]:
        """Plan, 'generate' (scripted), commit, and echo the answer into the history."""
        plan = plan_turn(chains, self.request(), tok)
        out = output_ids if output_ids is not None else canonical_output_ids(tok, answer, eos=eos)
        commit_turn(chains, plan, out, response_message_digest(answer.content()))
        self.messages.append({"role": "assistant", "content": answer.content()})
        return plan, out


def assert_extends_with_output(plan: TurnPlan, previous: TurnPlan, output_ids: list[int]) -> None:
    """`plan` extends `previous`'s chain, reusing the model's output tokens verbatim."""
    assert plan.action == "extend"
    assert plan.input_ids[len(previous.input_ids) : plan.prefix_len].tolist() == list(output_ids)
