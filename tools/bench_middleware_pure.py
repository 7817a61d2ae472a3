"""bench_middleware's pure section: parse + plan in-process, no HTTP, no store, no engine.

The chain path (parse with the session's ParseCache + `plan_turn`) against
parse + full render + full encode, median of interleaved repeats, on a
synthetic Claude Code session grown through the chain layer to ~`context`
tokens. Run it with `python -m tools.bench_middleware --section pure`.
"""

from __future__ import annotations

import json
import random
from typing import Any

from rich.table import Table

from recorder.dialects.parse_cache import ParseCache
from recorder.dialects.translate import parse_request, response_message_digest
from recorder.model.tokenizer import Tokenizer
from recorder.model.tokens import SessionChains, commit_turn, full_input_ids, plan_turn
from tools.benchkit.conversation import assistant_text, text, tools
from tools.benchkit.stats import median_ms
from tools.benchkit.table import rich_table


class Session:
    """A synthetic Claude Code session that grows by tool-use turns."""

    def __init__(self, context: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        # Claude Code's own preamble is ~15k tokens; scale it down for small contexts.
        self.tools = tools(min(16, max(1, context // 2000)))
        self.instructions = text(random.Random(1), min(2000, context // 50))
        self.messages: list[dict[str, Any]] = [
            {"role": "user", "content": "Fix the failing tests. " + text(self.rng, 40)}
        ]
        self.turn = 0

    def body(self) -> bytes:
        self.turn += 1
        system = [
            {
                "type": "text",
                "text": f"x-anthropic-billing-header: cc_version=2.1; cch={self.turn:08x};",
            },
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": "Instructions. " + self.instructions},
        ]
        return json.dumps(
            {
                "model": "bench",
                "max_tokens": 32000,
                "stream": True,
                "system": system,
                "tools": self.tools,
                "messages": self.messages,
                "thinking": {"type": "adaptive"},
                "context_management": {"edits": []},
            }
        ).encode()

    def answer(self) -> list[dict[str, Any]]:
        k = len(self.messages)
        return [
            {"type": "text", "text": "Next I will look at another file."},
            {
                "type": "tool_use",
                "id": f"toolu_{k:06d}",
                "name": "Tool1",
                "input": {"path": f"/repo/src/file_{k}.py", "mode": "read"},
            },
        ]

    def add_answer(self, content: list[dict[str, Any]]) -> None:
        self.messages.append({"role": "assistant", "content": content})

    def add_tool_result(self, n_words: int) -> None:
        call_id = self.messages[-1]["content"][-1]["id"]
        block = {"type": "tool_result", "tool_use_id": call_id, "content": text(self.rng, n_words)}
        self.messages.append({"role": "user", "content": [block]})


def _output_ids(tok: Tokenizer, content: list[dict[str, Any]]) -> list[int]:
    """What a model emits for this answer (template rendering of it, up to EOS)."""
    call = content[1]
    function = {"name": call["name"], "arguments": call["input"]}
    message = {
        "role": "assistant",
        "content": content[0]["text"],
        "tool_calls": [{"id": call["id"], "type": "function", "function": function}],
    }
    return tok.encode(assistant_text(tok, message))


def _build(tok: Tokenizer, context: int) -> tuple[Session, SessionChains, ParseCache]:
    """Grow a session turn by turn through the chain layer until ~`context` tokens."""
    session, chains, cache = Session(context), SessionChains(), ParseCache()
    while True:
        req = parse_request(session.body(), cache=cache)
        plan = plan_turn(chains, req, tok)
        content = session.answer()
        out = _output_ids(tok, content)
        commit_turn(chains, plan, out, response_message_digest(content))
        session.add_answer(content)
        if len(plan.input_ids) + len(out) >= context * 0.97:
            return session, chains, cache
        session.add_tool_result(n_words=min(600, max(20, context // 40)))


def measure(tok: Tokenizer, context: int, new_words: int, repeat: int) -> dict[str, float]:
    session, chains, cache = _build(tok, context)
    session.add_tool_result(new_words)
    body = session.body()
    req = parse_request(body, cache=cache)
    assert req == parse_request(body), "cached and uncached parse disagree"
    plan = plan_turn(chains, req, tok)
    assert plan.action == "extend", plan
    assert plan.input_ids.tolist() == full_input_ids(req, tok), "chain and full render disagree"
    ms = median_ms(
        {
            # First after the previous repeat's "base", as "parse" was before the cache:
            # whatever runs there pays for the memory the full render freed and re-faults.
            "parse_uncached": lambda: parse_request(body),
            "parse": lambda: parse_request(body, cache=cache),
            "plan": lambda: plan_turn(chains, req, tok),
            "chain": lambda: plan_turn(chains, parse_request(body, cache=cache), tok),
            "base": lambda: full_input_ids(parse_request(body), tok),
        },
        repeat,
    )
    return {"context": plan.prefix_len, "new": plan.new_tokens, "body_kb": len(body) / 1024, **ms}


def pure_table(rows: list[dict[str, float]]) -> Table:
    title = (
        "pure: middleware time per turn, median ms, no HTTP, no store, no engine\n"
        "chain = parse + plan (plan_turn); baseline = parse + full render + full encode\n"
        "parse = with the session's ParseCache (warm; repeats find the new message cached too);"
        " uncached = without"
    )
    cols = (
        "context tok", "new tok", "body KB", "parse", "uncached", "plan", "chain", "baseline",
        "ratio",
    )  # fmt: skip
    cells = [
        (
            f"{r['context']:,}",
            f"{r['new']:,}",
            f"{r['body_kb']:.0f}",
            *(f"{r[k]:.2f}" for k in ("parse", "parse_uncached", "plan", "chain", "base")),
            f"{r['base'] / r['chain']:.1f}x",
        )
        for r in rows
    ]
    return rich_table(title, cols, cells)
