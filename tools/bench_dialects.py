"""Parsing a turn's request body in each dialect, through a session's caches and without.

An agent re-sends its whole conversation every turn: at 100k tokens a body
is ~430 kB. Through the session's `ParseCache` (what the server does) only
the messages / input items not seen before are decoded and translated; the
baseline column parses the same body afresh. Bodies are shaped alike in the
three dialects: a large system prompt, 20 tools, then per turn one tool call
and a tool result of `--result-chars`, for `--turns` turns; the median is over
the last `--measured` turns (the largest bodies).

    python tools/bench_dialects.py [--turns 100] [--measured 30] [--result-chars 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from recorder.dialects import ANTHROPIC, OPENAI_CHAT, OPENAI_RESPONSES, Dialect  # noqa: E402
from recorder.dialects.parse_cache import ParseCache  # noqa: E402
from tools.benchkit.table import Columns  # noqa: E402

SYSTEM = "You are a coding agent. Follow the repository's conventions. " * 300
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}}
TOOLS = [(f"tool_{i}", "Runs a command in the sandbox. " * 12) for i in range(20)]
TABLE = Columns(
    [("dialect", 17, ">"), ("body kB", 7, ">"), ("session ms", 10, ">"), ("fresh ms", 8, ">"),
     ("x", 5, ">")],
    sep=" | ",
)  # fmt: skip


def _result(turn: int, chars: int) -> str:
    line = f"src/module_{turn}.py:{turn}: def function_{turn}(argument): return argument\n"
    return (line * (chars // len(line) + 1))[:chars]


def _anthropic(turns: int, chars: int) -> Iterator[bytes]:
    tools = [{"name": n, "description": d, "input_schema": SCHEMA} for n, d in TOOLS]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    for t in range(turns):
        yield json.dumps({"model": "m", "max_tokens": 4096, "system": SYSTEM, "tools": tools,
                          "messages": messages}).encode()  # fmt: skip
        call = {"type": "tool_use", "id": f"call_{t}", "name": "tool_1", "input": {"command": "ls"}}
        result = {"type": "tool_result", "tool_use_id": f"call_{t}", "content": _result(t, chars)}
        messages += [
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ]


def _chat(turns: int, chars: int) -> Iterator[bytes]:
    tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": SCHEMA}}
             for n, d in TOOLS]  # fmt: skip
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Fix the failing test."},
    ]
    for t in range(turns):
        yield json.dumps({"model": "m", "tools": tools, "messages": messages}).encode()
        call = {"id": f"call_{t}", "type": "function",
                "function": {"name": "tool_1", "arguments": '{"command": "ls"}'}}  # fmt: skip
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{t}", "content": _result(t, chars)},
        ]


def _responses(turns: int, chars: int) -> Iterator[bytes]:
    tools = [{"type": "function", "name": n, "description": d, "parameters": SCHEMA}
             for n, d in TOOLS]  # fmt: skip
    items: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    for t in range(turns):
        yield json.dumps({"model": "m", "instructions": SYSTEM, "tools": tools,
                          "input": items}).encode()  # fmt: skip
        items += [
            {"type": "function_call", "call_id": f"call_{t}", "name": "tool_1",
             "arguments": '{"command": "ls"}'},
            {"type": "function_call_output", "call_id": f"call_{t}", "output": _result(t, chars)},
        ]  # fmt: skip


async def _measure(dialect: Dialect, bodies: list[bytes], measured: int) -> tuple[float, float]:
    cache = ParseCache()
    cached: list[float] = []
    fresh: list[float] = []
    for i, body in enumerate(bodies):
        t0 = time.perf_counter()
        through_cache, _ = await dialect.parse(body, cache=cache)
        t1 = time.perf_counter()
        if i >= len(bodies) - measured:
            alone, _ = await dialect.parse(body)
            fresh.append(time.perf_counter() - t1)
            cached.append(t1 - t0)
            assert through_cache == alone, "the cached parse must equal a fresh one"
    return statistics.median(cached), statistics.median(fresh)


async def main(args: argparse.Namespace) -> None:
    rows = []
    for dialect, make in ((ANTHROPIC, _anthropic), (OPENAI_CHAT, _chat),
                          (OPENAI_RESPONSES, _responses)):  # fmt: skip
        bodies = list(make(args.turns, args.result_chars))
        cached, fresh = await _measure(dialect, bodies, args.measured)
        rows.append((dialect.name, len(bodies[-1]), cached, fresh))
    print(f"\nper-turn parse, median of the last {args.measured} of {args.turns} turns")
    print(TABLE.header())
    for name, size, cached, fresh in rows:
        ms = (f"{cached * 1e3:.2f}", f"{fresh * 1e3:.2f}")
        print(TABLE.row(name, f"{size / 1e3:.0f}", *ms, f"{fresh / cached:.1f}"))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--turns", type=int, default=100)
    p.add_argument("--measured", type=int, default=30)
    p.add_argument("--result-chars", type=int, default=4000)
    asyncio.run(main(p.parse_args()))
