"""Decoding byte-level BPE ids from a table of each token's bytes.

A byte-level tokenizer (GPT-2, SmolLM, Qwen, Llama 3) decodes ids by mapping
each token's characters back to the bytes they stand for, joining them, and
reading the bytes as UTF-8 with U+FFFD for what is not (`from_utf8_lossy`). Its
Rust call costs ~40 us for a turn's ~80 output ids, cold, most of it crossing
into Rust and building the token strings; the same bytes come from a table of
each id's bytes joined in Python in a few microseconds, and Python's UTF-8
decoder with "replace" substitutes exactly the same maximal invalid sequences.
A turn decodes its output twice (the TITO check, the answer's text).

`ByteDecoder.for_tokenizer` builds the table only for a byte-level decoder
over a vocabulary without holes, and only if every id alone decodes as the
Rust call does; ids outside the vocabulary go to the Rust call.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as RawTokenizer


def _byte_chars() -> dict[str, int]:
    """GPT-2's byte <-> printable character map (the one `ByteLevel` uses), char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class ByteDecoder:
    """`decode(ids)` as the tokenizer's own `decode(ids, skip_special_tokens=False)`."""

    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        self._bytes_of = table.__getitem__

    @classmethod
    def for_tokenizer(cls, raw: RawTokenizer) -> ByteDecoder | None:
        if type(raw.decoder).__name__ != "ByteLevel":
            return None
        byte_of = _byte_chars().__getitem__
        table: list[bytes] = []
        for i in range(raw.get_vocab_size(with_added_tokens=True)):
            token = raw.id_to_token(i)
            if token is None:
                return None  # a hole: the Rust call skips it, a table cannot say so
            try:
                table.append(bytes(map(byte_of, token)))
            except KeyError:  # as the decoder does with a token it cannot map: its own UTF-8
                table.append(token.encode())
        decoder = cls(table)
        return decoder if decoder.agrees(raw) else None

    def agrees(self, raw: RawTokenizer) -> bool:
        """Does every id decode as the Rust call decodes it?

        Checked in one call: every id followed by a one-byte ASCII token, which
        ends any invalid UTF-8 before it, so the text is each id's own text
        and that character, in turn (~0.15 s for 49k ids).
        """
        table = self._table
        sep = next((i for i, b in enumerate(table) if len(b) == 1 and b.isascii()), None)
        if sep is None:
            return False
        ids = [k for i in range(len(table)) for k in (i, sep)]
        mark = table[sep].decode()
        mine = mark.join(b.decode("utf-8", "replace") for b in table) + mark
        return raw.decode(ids, skip_special_tokens=False) == mine

    def decode(self, ids: Sequence[int]) -> str | None:
        """The text of `ids`; None when one is not in the vocabulary."""
        if ids and not (min(ids) >= 0 and max(ids) < len(self._table)):
            return None
        return b"".join(map(self._bytes_of, ids)).decode("utf-8", "replace")
