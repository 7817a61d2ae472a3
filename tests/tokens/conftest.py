from __future__ import annotations

import pytest

from recorder.model.tokenizer import Tokenizer

pytest.register_assert_rewrite("chat_builders")  # its assert helpers explain failures

from chat_builders import load_test_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    return load_test_tokenizer()
