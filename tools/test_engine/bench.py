"""Benchmarks for the tokenizer and the engine client (no GPU, no model).

    python -m tools.test_engine.bench [--turns 200] [--concurrency 1,16,128]

1. Render + encode of a conversation: ours (raw `tokenizers` + our jinja
   sandbox) against transformers' `apply_chat_template` + `encode`, and the
   incremental path (render only the new message, encode only its text).
2. `/generate` round trips against a zero-latency scripted engine: our
   pooled `EngineClient` against a new aiohttp session per call.
Every figure is measured in the same run; ratios are against the baseline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import click
from rich.console import Console
from rich.table import Table

from recorder.model.engine import EngineClient
from recorder.model.engine_wire import SamplingParams, new_rid
from recorder.model.tokenizer import load_tokenizer

from .__main__ import FIXTURE_TOKENIZER
from .scripted import ScriptedEngine

PARAGRAPH = (
    "The function reads the configuration file, validates every field against the schema, "
    "and returns a frozen dataclass; errors name the offending key and line. "
)


def _conversation(n_turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(n_turns):
        msgs.append({"role": "user", "content": f"Step {i}: " + PARAGRAPH * 3})
        msgs.append(
            {
                "role": "assistant",
                "content": PARAGRAPH,
                "tool_calls": [
                    {"type": "function", "function": {"name": "bash", "arguments": {"cmd": "ls"}}}
                ],
            }
        )
        msgs.append({"role": "tool", "content": PARAGRAPH * 2})
    return msgs


def _time(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def bench_tokenizer(console: Console) -> None:
    from transformers import AutoTokenizer

    ours = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template="chatml-tools")
    hf = AutoTokenizer.from_pretrained(str(FIXTURE_TOKENIZER))
    table = Table(title="render + encode per turn (ms)")
    for col in ("context tokens", "transformers", "ours full", "ratio", "ours new msg", "ratio"):
        table.add_column(col, justify="right")
    for turns in (4, 40, 400):
        msgs = _conversation(turns)
        n_tokens = len(ours.encode(ours.render(msgs)))
        repeat = max(3, 400 // turns)

        def baseline(msgs: list[dict[str, Any]] = msgs) -> list[int]:
            text = hf.apply_chat_template(
                msgs, chat_template=ours.chat_template, tokenize=False, add_generation_prompt=True
            )
            return hf.encode(text, add_special_tokens=False)

        def full(msgs: list[dict[str, Any]] = msgs) -> list[int]:
            return ours.encode(ours.render(msgs))

        def incremental(msgs: list[dict[str, Any]] = msgs) -> list[int]:
            return ours.encode(ours.render(msgs[-1:], continuation=True))

        assert baseline() == full()
        t_base, t_full, t_inc = (_time(f, repeat) for f in (baseline, full, incremental))
        table.add_row(
            f"{n_tokens:,}",
            f"{t_base * 1e3:.2f}",
            f"{t_full * 1e3:.2f}",
            f"{t_base / t_full:.1f}x",
            f"{t_inc * 1e3:.3f}",
            f"{t_base / t_inc:.0f}x",
        )
    console.print(table)


async def _round_trips(url: str, turns: int, concurrency: int, pooled: bool) -> float:
    prompt = list(range(1, 200))
    params = SamplingParams(max_new_tokens=32)
    per_worker = max(1, turns // concurrency)

    async def worker_pooled(client: EngineClient) -> None:
        for _ in range(per_worker):
            await client.generate(url, prompt, params, new_rid())

    async def worker_fresh() -> None:
        body = {
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": params.to_sglang(),
        }
        for _ in range(per_worker):
            async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
                await r.json()

    start = time.perf_counter()
    if pooled:
        async with EngineClient([url]) as client:
            await asyncio.gather(*(worker_pooled(client) for _ in range(concurrency)))
    else:
        await asyncio.gather(*(worker_fresh() for _ in range(concurrency)))
    return per_worker * concurrency / (time.perf_counter() - start)


async def bench_engine(console: Console, turns: int, concurrency: list[int]) -> None:
    tokenizer = load_tokenizer(str(FIXTURE_TOKENIZER))
    table = Table(
        title=f"/generate round trips against a zero-latency scripted engine ({turns} calls)"
    )
    for col in ("concurrency", "session per call (calls/s)", "EngineClient (calls/s)", "ratio"):
        table.add_column(col, justify="right")
    async with ScriptedEngine(tokenizer, default_words=20) as engine:
        for c in concurrency:
            fresh = await _round_trips(engine.url, turns, c, pooled=False)
            pooled = await _round_trips(engine.url, turns, c, pooled=True)
            table.add_row(str(c), f"{fresh:.0f}", f"{pooled:.0f}", f"{pooled / fresh:.2f}x")
    console.print(table)


@click.command()
@click.option("--turns", type=int, default=400, show_default=True)
@click.option("--concurrency", default="1,16,128", show_default=True)
def main(turns: int, concurrency: str) -> None:
    console = Console()
    bench_tokenizer(console)
    asyncio.run(bench_engine(console, turns, [int(c) for c in concurrency.split(",")]))


if __name__ == "__main__":
    main()
