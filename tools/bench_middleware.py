"""Per-turn middleware overhead: parse + plan + tokenization, no engine.

For a Claude-Code-shaped session (3 system blocks with a changing billing
header, 16 tools, tool-use turns) at ~1k, ~10k and ~100k tokens of context,
times one more turn that adds ~200 (and ~2k) new tokens, two ways:

  chain     parse_request + plan_turn (the chain's exact tokens + only the new
            messages rendered and tokenized) - what the server does
  baseline  parse_request + render the whole conversation + tokenize it all

Prints median milliseconds per turn and the baseline/chain ratio. The target
is a ratio >= 20 at 100k, with the chain time growing with the new tokens,
not with the context.

    python -m tools.bench_middleware [--repeat 15] [--contexts 1000,10000,100000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from recorder.tokenizer import Tokenizer, load_tokenizer
from recorder.tokens import SessionChains, commit_turn, full_input_ids, plan_turn
from recorder.translate import parse_request, response_message_digest

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "tests" / "data" / "smollm2-tokenizer"
TEMPLATE = REPO / "recorder" / "templates" / "chatml-tools.jinja"

_VOCAB = (
    "def return self import class value result error file path test module function "
    "config None True False for in if else while try except raise assert len range "
    "print list dict str int data index token chain session event store async await"
)
_WORDS = _VOCAB.split()


def _text(rng: random.Random, n_words: int) -> str:
    lines, line = [], []
    for _ in range(n_words):
        line.append(rng.choice(_WORDS))
        if len(line) >= 12:
            lines.append("    " + " ".join(line))
            line = []
    lines.append(" ".join(line))
    return "\n".join(lines)


def _tools(n: int) -> list[dict[str, Any]]:
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


class Session:
    """A synthetic Claude Code session that grows by tool-use turns."""

    def __init__(self, context: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        # Claude Code's own preamble is ~15k tokens; scale it down for small contexts.
        self.tools = _tools(min(16, max(1, context // 2000)))
        self.instructions = _text(random.Random(1), min(2000, context // 50))
        self.messages: list[dict[str, Any]] = [
            {"role": "user", "content": "Fix the failing tests. " + _text(self.rng, 40)}
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
        block = {"type": "tool_result", "tool_use_id": call_id, "content": _text(self.rng, n_words)}
        self.messages.append({"role": "user", "content": [block]})


def _output_ids(tok: Tokenizer, content: list[dict[str, Any]]) -> list[int]:
    """What a model emits for this answer (template rendering of it, up to EOS)."""
    call = content[1]
    message = {
        "role": "assistant",
        "content": content[0]["text"],
        "tool_calls": [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["input"]},
            }
        ],
    }
    head = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    start = tok.render(head, None, True)
    return tok.encode(tok.render([*head, message], None, False)[len(start) :].rstrip("\n"))


def _build(tok: Tokenizer, context: int) -> tuple[Session, SessionChains]:
    """Grow a session turn by turn through the chain layer until ~`context` tokens."""
    session, chains = Session(context), SessionChains()
    while True:
        req = parse_request(session.body())
        plan = plan_turn(chains, req, tok)
        content = session.answer()
        out = _output_ids(tok, content)
        commit_turn(chains, plan, out, response_message_digest(content))
        session.add_answer(content)
        if len(plan.input_ids) + len(out) >= context * 0.97:
            return session, chains
        session.add_tool_result(n_words=min(600, max(20, context // 40)))


def _median_ms(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median wall time of each function, interleaved so machine load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm caches the same way for every side
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def measure(tok: Tokenizer, context: int, new_words: int, repeat: int) -> dict[str, float]:
    session, chains = _build(tok, context)
    session.add_tool_result(new_words)
    body = session.body()
    req = parse_request(body)
    plan = plan_turn(chains, req, tok)
    assert plan.action == "extend", plan
    assert plan.input_ids == full_input_ids(req, tok), "chain and full render disagree"
    ms = _median_ms(
        {
            "parse": lambda: parse_request(body),
            "plan": lambda: plan_turn(chains, req, tok),
            "chain": lambda: plan_turn(chains, parse_request(body), tok),
            "base": lambda: full_input_ids(parse_request(body), tok),
        },
        repeat,
    )
    return {"context": plan.prefix_len, "new": plan.new_tokens, "body_kb": len(body) / 1024, **ms}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--contexts", default="1000,10000,100000")
    ap.add_argument("--new-words", default="150,1500", help="words of new tool output per turn")
    args = ap.parse_args(argv)
    tok = load_tokenizer(str(TOKENIZER), chat_template=str(TEMPLATE))
    table = Table(
        title="middleware time per turn, median ms, no engine\n"
        "chain = parse + plan (plan_turn); baseline = parse + full render + full encode"
    )
    cols = ("context tok", "new tok", "body KB", "parse", "plan", "chain", "baseline", "ratio")
    for col in cols:
        table.add_column(col, justify="right")
    for context in (int(c) for c in args.contexts.split(",")):
        for new_words in (int(w) for w in args.new_words.split(",")):
            r = measure(tok, context, new_words, args.repeat)
            table.add_row(
                f"{r['context']:,}",
                f"{r['new']:,}",
                f"{r['body_kb']:.0f}",
                f"{r['parse']:.2f}",
                f"{r['plan']:.2f}",
                f"{r['chain']:.2f}",
                f"{r['base']:.2f}",
                f"{r['base'] / r['chain']:.1f}x",
            )
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
