"""ASCII text tokenized from cached pre-token ids gets exactly the Rust tokenizer's ids.

`Tokenizer.encode` takes the cache for ASCII text (`recorder.model.word_cache`);
every test here compares against the raw `tokenizers` call, never against
`encode` itself, on texts built to break the transcribed regex: whitespace runs
before words, contractions in both cases, digits, punctuation runs, control
characters, added tokens glued to words, and tokenizers whose pre-tokenizer
differs (Qwen's and Llama 3's splits; pre-tokenizers we have no regex for get
no cache).
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recorder.model import word_cache
from recorder.model.tokenizer import Tokenizer
from recorder.model.word_cache import WordCache
from tests.conftest import tokenizer_variant

from .conftest import FIXTURE_TOKENIZER

_ATOMS = [
    " ", "  ", "   ", "\n", "\n\n", "\r\n", "\r", "\t", " \t", "\v", "\f", "\x00", "\x1b", "\x7f",
    "a", "Word", "WORD", "x1", "1", "123", "1234567", "3.14", "'s", "'S", "'t", "'re", "'VE",
    "'m", "'ll", "'D", "'x", "don't", "!!", "?! ", "...", "--", "#", "$", "(", ")", "{", "}",
    '"', "\\", "~", "`", "_", "<", "|", ">", "<|im_end|>", "<|im_start|>", "<|endoftext|>",
    "<|im_end", "im_end|>", "<repo_name>", "<reponame>",
]  # fmt: skip


def _raw_ids(tok: Tokenizer, text: str) -> list[int]:
    return tok._raw.encode(text, add_special_tokens=False).ids


def _random_texts(seed: int, n: int, length: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_ATOMS) for _ in range(length)) for _ in range(n)]


def _assert_same(tok: Tokenizer, texts: list[str]) -> None:
    for text in texts:
        assert tok.encode(text) == _raw_ids(tok, text), repr(text[:80])


def test_the_fixture_tokenizer_has_a_cache_and_it_is_exact(tokenizer: Tokenizer) -> None:
    assert tokenizer._words is not None
    _assert_same(tokenizer, _random_texts(1, 300, 60))
    # Twice: the second time every pre-token comes from the cache.
    _assert_same(tokenizer, _random_texts(1, 300, 60))


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from([*string.printable, "\x00", "\x1b", "\x7f"]), max_size=80))
def test_any_ascii_text_gets_the_tokenizers_ids(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.encode(text) == _raw_ids(tokenizer, text)


def test_text_that_is_not_plain_ascii_goes_to_the_tokenizer(tokenizer: Tokenizer) -> None:
    words = tokenizer._words
    assert words is not None
    for text in ["ünï", "a\x1cb", "x \x1f y", "漢字 x", "🙂"]:
        assert words.encode(text) is None
        assert tokenizer.encode(text) == _raw_ids(tokenizer, text)


def test_a_full_cache_is_emptied_and_still_exact(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(word_cache, "_MAX_WORDS", 10)
    monkeypatch.setattr(word_cache, "_MAX_WORD_CHARS", 3)
    _assert_same(tokenizer, _random_texts(2, 50, 80))


_variant = tokenizer_variant


def _split(pattern: str) -> dict:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ],
    }  # fmt: skip


@pytest.mark.parametrize("pattern", [word_cache._QWEN2, word_cache._LLAMA3])
def test_qwen_and_llama3_splits_are_exact(tmp_path: Path, pattern: str) -> None:
    tok = _variant(
        tmp_path, "split", {"pre_tokenizer": _split(pattern), "normalizer": {"type": "NFC"}}
    )
    assert tok._words is not None
    _assert_same(tok, _random_texts(3, 300, 60))
    _assert_same(tok, _random_texts(3, 300, 60))


@pytest.mark.parametrize(
    "edit",
    [
        {"pre_tokenizer": _split(r"\p{L}+|\s+")},  # a regex we have no transcription of
        {"normalizer": {"type": "Lowercase"}},
        {"normalizer": {"type": "Prepend", "prepend": " "}},
        {
            "pre_tokenizer": {
                "type": "ByteLevel",
                "add_prefix_space": True,
                "trim_offsets": True,
                "use_regex": True,
            }
        },
        {"pre_tokenizer": {"type": "Whitespace"}},
    ],
)
def test_other_configurations_get_no_cache(tmp_path: Path, edit: dict) -> None:
    tok = _variant(tmp_path, "other", edit)
    assert tok._words is None
    assert tok.encode("Hello  world's 123") == _raw_ids(tok, "Hello  world's 123")


def test_an_added_token_that_strips_blanks_disables_the_cache(tmp_path: Path) -> None:
    spec = json.loads((FIXTURE_TOKENIZER / "tokenizer.json").read_text())
    added = [dict(t, lstrip=True) if t["id"] == 2 else t for t in spec["added_tokens"]]
    tok = _variant(tmp_path, "lstrip", {"added_tokens": added})
    assert tok._words is None


def test_a_probe_that_disagrees_disables_the_cache(tokenizer: Tokenizer) -> None:
    cache = WordCache.for_tokenizer(tokenizer._raw)
    assert cache is not None and cache.agrees(["hello world"])
    cache._chunk_ids["world"] = [0]  # a wrong chunk (" world"): the probe must notice
    assert not cache.agrees(["hello world"])
    cache._chunk_ids.clear()
    cache._words["hello"] = [0]  # a wrong pre-token, under no chunk yet
    assert not cache.agrees(["hello world"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([*_ATOMS, "x", " x", "  x", "x ", "\n  x", ":\n  ", "\t x"]),
                max_size=40))  # fmt: skip
def test_chunks_cut_only_where_a_pre_token_begins(tokenizer: Tokenizer, atoms: list[str]) -> None:
    """Each chunk (`word_cache._chunks`) tokenized alone, in order, gives the text's ids:
    twice, so the second time every chunk comes from the chunk cache."""
    text = "".join(atoms)
    lead, spaced = word_cache._chunks(text)
    chunks = [lead, *(" " + s for s in spaced)]
    assert "".join(chunks).replace(word_cache._KEPT, " ") == text
    alone = [i for c in chunks for i in _raw_ids(tokenizer, c.replace(word_cache._KEPT, " "))]
    if not any(t in text for t in ("<|", "|>", "<repo", "<reponame>")):  # no added tokens
        assert alone == _raw_ids(tokenizer, text)
    assert tokenizer.encode(text) == tokenizer.encode(text) == _raw_ids(tokenizer, text)


def test_non_ascii_added_tokens_leave_the_cache_on(tmp_path: Path) -> None:
    """DeepSeek-style added tokens (full-width bars) cannot occur in ASCII text."""
    spec = json.loads((FIXTURE_TOKENIZER / "tokenizer.json").read_text())
    extra = {
        "id": spec["added_tokens"][-1]["id"] + 1,
        "content": "<｜begin▁of▁sentence｜>",
        "single_word": False, "lstrip": True, "rstrip": False, "normalized": False, "special": True,
    }  # fmt: skip
    tok = _variant(tmp_path, "wide", {"added_tokens": [*spec["added_tokens"], extra]})
    assert tok._words is not None
    _assert_same(tok, _random_texts(4, 100, 60))
    text = "x <｜begin▁of▁sentence｜> y"
    assert tok.encode(text) == _raw_ids(tok, text)


class _Counting:
    """Stands in for a WordCache to see whether `encode` consults it."""

    def __init__(self, real: WordCache) -> None:
        self.real, self.calls = real, 0

    def encode(self, text: str) -> list[int] | None:
        self.calls += 1
        return self.real.encode(text)


def test_a_worker_thread_leaves_the_gil_to_the_loop(tokenizer: Tokenizer, monkeypatch) -> None:
    """Off the loop (`asyncio.to_thread`) the Rust call, which releases the GIL, is used;
    on the loop's thread the cache is (an 8 MB plan on a thread starved the loop)."""
    import asyncio

    assert tokenizer._words is not None
    counting = _Counting(tokenizer._words)
    monkeypatch.setattr(tokenizer, "_words", counting)
    text = "def f(x):\n    return x  # it's " * 50

    async def both() -> tuple[list[int], list[int]]:
        on_loop = tokenizer.encode(text)
        assert counting.calls == 1
        off_loop = await asyncio.to_thread(tokenizer.encode, text)
        assert counting.calls == 1
        return on_loop, off_loop

    on_loop, off_loop = asyncio.run(both())
    assert on_loop == off_loop == _raw_ids(tokenizer, text)
