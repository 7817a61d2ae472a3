"""A scripted engine that solves the shipped tasks: `python -m tools.tasks.engine --port N`.

SGLang's `/generate` protocol (tools.test_engine) answering with
`tools.tasks.policy`: a correct fix per task, or with `--wrong` a wrong one.
"""

from __future__ import annotations

import asyncio

import click

from recorder.model.tokenizer import load_tokenizer
from tools.tasks.policy import task_policy
from tools.test_engine.launch import REPO_ROOT
from tools.test_engine.scripted import ScriptedEngine

TOKENIZER_DIR = REPO_ROOT / "tests" / "data" / "smollm2-tokenizer"
CHAT_TEMPLATE = REPO_ROOT / "recorder" / "model" / "templates" / "chatml-tools.jinja"
CONTEXT_LENGTH = 200_000


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=30000, show_default=True)
@click.option("--wrong", is_flag=True, help="Answer with a wrong fix (reward 0).")
@click.option("--token-delay", type=float, default=0.0, help="Seconds per output token.")
def main(host: str, port: int, wrong: bool, token_delay: float) -> None:
    asyncio.run(_serve(host, port, wrong, token_delay))


async def _serve(host: str, port: int, wrong: bool, token_delay: float) -> None:
    tokenizer = load_tokenizer(str(TOKENIZER_DIR))
    engine = ScriptedEngine(
        tokenizer,
        default_reply=task_policy(tokenizer, wrong=wrong),
        token_delay_s=token_delay,
        context_length=CONTEXT_LENGTH,
        host=host,
        port=port,
    )
    url = await engine.start()
    click.echo(f"task engine listening on {url}", err=True)
    try:
        await asyncio.Event().wait()
    finally:
        await engine.stop()


if __name__ == "__main__":
    main()
