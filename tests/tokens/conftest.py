from __future__ import annotations

import pytest
from chat_builders import load_test_tokenizer

from recorder.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    return load_test_tokenizer()
