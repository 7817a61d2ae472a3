"""Decoding from each id's bytes gives exactly the Rust tokenizer's text.

`Tokenizer.decode` takes the table for a byte-level tokenizer
(`recorder.model.byte_decoder`); every test compares against the raw
`tokenizers` call, on id sequences built to break it: single bytes that make
invalid or truncated UTF-8 (the decoder's U+FFFD substitution), special tokens
between them, whole words, ids outside the vocabulary.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from recorder.model.byte_decoder import ByteDecoder, _byte_chars
from recorder.model.tokenizer import Tokenizer


def _raw_text(tok: Tokenizer, ids: list[int]) -> str:
    return tok._raw.decode(ids, skip_special_tokens=False)


def _byte_ids(tok: Tokenizer) -> dict[int, int]:
    """The id of each single byte's token (a few control bytes have none in this vocabulary)."""
    ids = {b: tok.token_to_id(c) for c, b in _byte_chars().items()}
    found = {b: i for b, i in ids.items() if i is not None}
    assert len(found) >= 230 and all(b in found for b in range(0x80, 0xC0))
    return found


def test_the_fixture_tokenizer_has_a_table(tokenizer: Tokenizer) -> None:
    assert tokenizer._bytes is not None


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=24))
def test_any_bytes_decode_as_the_tokenizer_decodes_them(tokenizer: Tokenizer, data: bytes) -> None:
    byte_ids = _byte_ids(tokenizer)
    ids = [byte_ids[b] for b in data if b in byte_ids]
    assert tokenizer.decode(ids) == _raw_text(tokenizer, ids)


def test_invalid_utf8_is_replaced_as_the_tokenizer_replaces_it(tokenizer: Tokenizer) -> None:
    byte_ids = _byte_ids(tokenizer)
    special = tokenizer.token_to_id("<|im_end|>")
    cases = [
        b"\xf0\x9f\x98", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\xe2\x82",
        b"\x80\x80", b"\xe0\x80", b"a\xe2\x82b", b"\xf0\x9f\x98\x80", b"\xe6\xbc\xa2\xe5",
    ]  # fmt: skip
    for data in cases:
        for tail in ([], [special], [special, byte_ids[0xE2]]):
            ids = [byte_ids[b] for b in data if b in byte_ids] + tail
            assert tokenizer.decode(ids) == _raw_text(tokenizer, ids), data


def test_random_vocabulary_ids(tokenizer: Tokenizer) -> None:
    rng = random.Random(11)
    n = tokenizer.vocab_size
    for _ in range(3000):
        ids = [rng.randrange(n) for _ in range(rng.randrange(0, 16))]
        assert tokenizer.decode(ids) == _raw_text(tokenizer, ids), ids


def test_ids_outside_the_vocabulary_go_to_the_tokenizer(tokenizer: Tokenizer) -> None:
    decoder = tokenizer._bytes
    assert decoder is not None
    assert decoder.decode([5, -1]) is None  # the Rust call refuses it, as before
    for ids in ([tokenizer.vocab_size], [5, 10**9]):
        assert decoder.decode(ids) is None
        assert tokenizer.decode(ids) == _raw_text(tokenizer, ids)


def test_a_table_that_disagrees_is_refused(tokenizer: Tokenizer) -> None:
    decoder = ByteDecoder.for_tokenizer(tokenizer._raw)
    assert decoder is not None and decoder.agrees(tokenizer._raw)
    decoder._table[300] = b"not this token"
    assert not decoder.agrees(tokenizer._raw)
