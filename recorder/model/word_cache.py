"""Exact tokenization of plain-ASCII text from a cache of pre-token ids.

A byte-level BPE tokenizer (GPT-2, SmolLM, Qwen, Llama 3) first splits the
text at its added tokens, then splits the rest into pre-tokens with one regex,
and merges each pre-token on its own: the ids of a text are the added tokens'
ids and each pre-token's ids, in order. The Rust tokenizer spends most of a
turn's encoding in that regex (oniguruma over Unicode classes: splitting a
740-character tool result alone took ~320 us, hot; twice that cold), while an
agent's texts reuse the same few thousand words turn after turn. So for ASCII
text this module splits with Python's `re` (an ASCII transcription of the
tokenizer's own regex, exact on that alphabet) and looks each pre-token's ids
up in a dict; a pre-token not seen yet is tokenized by the Rust tokenizer (a
pre-token tokenized alone gives its ids within the text: the regex splits it
into itself). ~5x less CPU per text; the ids are the tokenizer's.

Python's `re` still costs ~0.3 us a pre-token, the bulk of a long text's
encoding. So a text is first cut into chunks with `str.split(" ")`, where a
pre-token must begin: before every space followed by a non-blank character
(`_chunks`). A chunk seen before (most often a word and its space) is one
dict lookup; a new one goes through the regex and the pre-token cache: 1.5x
less CPU on prose whose words were seen before, 2.8x on indented code
(tools/BENCHMARKS.md, 2026-11-29).

Only configurations known to split this way get a cache (`WordCache.for_tokenizer`
returns None otherwise): a BPE model without dropout, no normalizer or NFC
(the identity on ASCII), a pre-tokenizer whose regex is one of `_PATTERNS`,
ASCII added tokens matched as plain strings (no lstrip/rstrip/single_word;
the others cannot occur in ASCII text), no truncation or padding. A probe of
ASCII texts must then give the Rust tokenizer's ids, or no cache is used. Any
other text (non-ASCII, or holding one of the separators \\x1c-\\x1f) goes to
the Rust tokenizer whole.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
from typing import Any

from tokenizers import Tokenizer as RawTokenizer

# The regex inputs are ASCII: \p{L} is [A-Za-z], \p{N} is [0-9], \s is the six
# ASCII blanks (Unicode's White_Space on ASCII, as oniguruma reads \s).
_L, _N, _S = "A-Za-z", "0-9", r"\t\n\v\f\r "
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = _QWEN2.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
# ASCII the cache leaves to the Rust tokenizer: \x1c-\x1f are blank to Python
# (`str.isspace`, `re`'s `\s`), not to oniguruma (Unicode's White_Space). The
# transcription spells its blanks out, so they would split alike; kept out anyway.
_UNSAFE = re.compile(r"[\x1c-\x1f]")
_UNSAFE_CHARS = ("\x1c", "\x1d", "\x1e", "\x1f")  # the same, found faster than by `re`
# In a chunk's key, a space that cuts no chunk (`_chunks`); and the key of a
# text's first chunk, which no space precedes, starts with `_LEAD`. No text the
# cache takes holds either character.
_KEPT = "\x1d"
_LEAD = "\x1c"
# Chunks longer than this are not cached (split by the regex each time); the
# chunk cache is emptied when it holds `_MAX_WORDS`.
_MAX_CHUNK_CHARS = 64
# Pre-tokens longer than this are tokenized each time (a long run of one
# character), and the cache is emptied when it holds this many.
_MAX_WORD_CHARS = 64
# New words joined longer than this are tokenized with the GIL released (see
# `Tokenizer.encode`), shorter ones by the plain call.
_GIL_FREE_CHARS = 64
_MAX_WORDS = 1 << 16  # ~200 bytes each: ~13 MB at most, for each of the two caches


def _ascii(pattern: str) -> re.Pattern[str]:
    """The tokenizer's regex for ASCII input: Unicode classes as ASCII ranges."""
    out = pattern.replace(r"\S", f"[^{_S}]")
    for name, chars in ((r"\p{L}", _L), (r"\p{N}", _N), (r"\s", _S)):
        out = re.sub(r"(\[[^\]]*)" + re.escape(name), lambda m, c=chars: m.group(1) + c, out)
        out = out.replace(name, f"[{chars}]")
    return re.compile(out)


_PATTERNS = {_GPT2: _ascii(_GPT2), _QWEN2: _ascii(_QWEN2), _LLAMA3: _ascii(_LLAMA3)}


class WordCache:
    """`encode(text)` for an ASCII-safe text, from cached pre-token ids (None: not ASCII-safe)."""

    def __init__(
        self, raw: RawTokenizer, split: re.Pattern[str], added: list[list[tuple[str, int]]]
    ) -> None:
        self._raw = raw
        self._split = split.findall
        # One pass per group of added tokens, as the tokenizer does (its un-normalized
        # ones first), each longest first: the leftmost-longest match, as its matcher.
        self._added = [
            (
                re.compile("|".join(re.escape(t) for t, _ in sorted(g, key=lambda x: -len(x[0])))),
                dict(g),
            )
            for g in added
            if g
        ]
        self._words: dict[str, list[int]] = {}
        # Chunk (`_chunks`; a text's first one keyed `_LEAD` + its text) -> its ids.
        self._chunk_ids: dict[str, list[int]] = {}
        # An added token that separates new words tokenized in one call (`_tokenize`).
        self._sep = next(((t, i) for g in added for t, i in g), None)

    @classmethod
    def for_tokenizer(cls, raw: RawTokenizer) -> WordCache | None:
        """A cache for `raw` if its configuration splits as described above and a probe agrees."""
        split = _split_pattern(_state(raw.normalizer), _state(raw.pre_tokenizer))
        added = _added_groups(raw)
        if split is None or added is None or not _plain_bpe(raw):
            return None
        if raw.truncation is not None or raw.padding is not None:
            return None
        if getattr(raw, "encode_special_tokens", False):
            return None
        cache = cls(raw, split, added)
        return cache if cache.agrees(_probe_texts(added)) else None

    def agrees(self, texts: list[str]) -> bool:
        """Do these texts get the Rust tokenizer's ids (all of them ASCII-safe)?"""
        return all(
            self.encode(t) == self._raw.encode(t, add_special_tokens=False).ids for t in texts
        )

    def encode(self, text: str) -> list[int] | None:
        """The tokenizer's ids for `text` (no special tokens added); None unless ASCII-safe."""
        if not text.isascii() or any(c in text for c in _UNSAFE_CHARS):
            return None
        segments: list[str | int] = [text]
        for pattern, ids in self._added:
            segments = [
                part
                for seg in segments
                for part in ([seg] if isinstance(seg, int) else _split_added(seg, pattern, ids))
            ]
        out: list[int] = []
        for seg in segments:
            if isinstance(seg, int):
                out.append(seg)
            elif seg and not self._extend_chunks(out, seg):
                return None  # the regex skipped characters (never expected): the tokenizer's
        return out

    def _extend_chunks(self, out: list[int], text: str) -> bool:
        """Add the ids of `text` (no added token in it) chunk by chunk; False if the
        regex skipped characters."""
        lead, spaced = _chunks(text)
        get = self._chunk_ids.get
        parts: list[list[int] | None] = [get(_LEAD + lead), *map(get, spaced)]
        if None in parts and not self._fill_chunks(parts, lead, spaced):
            return False
        for part in parts:
            out.extend(part)  # type: ignore[arg-type]  (filled: none is None)
        return True

    def _fill_chunks(self, parts: list[list[int] | None], lead: str, spaced: list[str]) -> bool:
        """Fill in the chunks not cached (None in `parts`) from their pre-tokens, and cache
        them; False if the regex skipped characters.

        Safe while another thread fills or empties the cache, as `_fill` is."""
        cache = self._chunk_ids
        if len(cache) + parts.count(None) > _MAX_WORDS:
            cache.clear()
        for i in [i for i, part in enumerate(parts) if part is None]:
            key = _LEAD + lead if i == 0 else spaced[i - 1]
            text = (lead if i == 0 else " " + spaced[i - 1]).replace(_KEPT, " ")
            ids = self._pre_token_ids(text)
            if ids is None:
                return False
            if len(text) <= _MAX_CHUNK_CHARS:
                cache[key] = ids
            parts[i] = ids
        return True

    def _pre_token_ids(self, text: str) -> list[int] | None:
        """The ids of `text` split by the regex, each pre-token's from the cache; None if
        the regex skipped characters."""
        words = self._split(text)
        if len("".join(words)) != len(text):
            return None
        out: list[int] = []
        self._extend(out, words)
        return out

    def _extend(self, out: list[int], words: list[str]) -> None:
        try:
            parts = list(map(self._words.__getitem__, words))  # the usual case: all cached
        except KeyError:
            parts = self._fill(words)
        for ids in parts:
            out.extend(ids)

    def _fill(self, words: list[str]) -> list[list[int]]:
        """Each word's ids, tokenizing (in one call) and caching those not cached.

        Safe while another thread fills or empties the cache (plans may run on
        threads): a word found neither here nor there is tokenized again.
        """
        cache = self._words
        fresh = self._tokenize(list(dict.fromkeys(w for w in words if w not in cache)))
        if len(cache) + len(fresh) > _MAX_WORDS:
            cache.clear()
        cache.update((w, ids) for w, ids in fresh.items() if len(w) <= _MAX_WORD_CHARS)
        with contextlib.suppress(KeyError):  # all cached now, unless too long or emptied
            return list(map(cache.__getitem__, words))
        parts = []
        for word in words:
            ids = fresh.get(word) or cache.get(word)
            if ids is None:
                ids = self._raw.encode(word, add_special_tokens=False).ids
            parts.append(ids)
        return parts

    def _tokenize(self, words: list[str]) -> dict[str, list[int]]:
        """Each word's ids, from one call on the words joined by an added token.

        The tokenizer splits at added tokens before anything else, and a word
        alone is one pre-token, so the ids between two separators are the
        word's. One call instead of one per word (~25 us each, cold), and no
        batch call (it wakes the tokenizer's thread pool: ~200 us of CPU for 4
        words). Per word when the separator's id shows up other than between
        words (never expected).
        """
        raw = self._raw
        if self._sep is None or len(words) < 2:
            return {w: raw.encode(w, add_special_tokens=False).ids for w in words}
        sep, sep_id = self._sep
        joined = sep.join(words)
        if len(joined) < _GIL_FREE_CHARS:
            ids = raw.encode(joined, add_special_tokens=False).ids
        else:
            ids = raw.encode_batch_fast([joined], add_special_tokens=False)[0].ids
        parts: list[list[int]] = [[]]
        for i in ids:
            if i == sep_id:
                parts.append([])
            else:
                parts[-1].append(i)
        if len(parts) != len(words) or not all(parts):
            return {w: raw.encode(w, add_special_tokens=False).ids for w in words}
        return dict(zip(words, parts, strict=True))


def _chunks(text: str) -> tuple[str, list[str]]:
    """`text` cut before each space that a non-blank character follows: (the first
    chunk, the others without their leading space), other spaces as `_KEPT`.

    Such a space begins a pre-token under each of the three regexes: no
    alternative matches a non-blank character and then a space (letters,
    digits, punctuation runs and contractions hold no space, blank runs no
    non-blank character), so the space is the first of its match. And a chunk
    alone splits as it does within the text: where a match could look past
    the chunk's end, the text has that space, which reads as the end of the
    text does (blank, not a newline).

    The spaces that cut nothing (before a blank, or last) become `_KEPT` with
    `str.replace`, then one `split` cuts at the rest: no loop over the words.
    """
    if " " not in text:
        return text, []
    marked = text
    if marked.endswith(" "):
        body = marked.rstrip(" ")
        marked = body + _KEPT * (len(marked) - len(body))
    for blank in "\t\n\v\f\r":
        if " " + blank in marked:
            marked = marked.replace(" " + blank, _KEPT + blank)
    while "  " in marked or " " + _KEPT in marked:  # a space before a space that cuts nothing
        marked = marked.replace("  ", _KEPT + " ").replace(" " + _KEPT, _KEPT + _KEPT)
    pieces = marked.split(" ")
    return pieces[0], pieces[1:]


def _split_added(text: str, pattern: re.Pattern[str], ids: dict[str, int]) -> list[str | int]:
    """`text` as its runs between added tokens and those tokens' ids."""
    out: list[str | int] = []
    at = 0
    for match in pattern.finditer(text):
        out.append(text[at : match.start()])
        out.append(ids[match.group()])
        at = match.end()
    out.append(text[at:])
    return out


def _state(component: Any) -> dict[str, Any] | None:
    """A tokenizer component's configuration (as in tokenizer.json), None if it has none."""
    return None if component is None else json.loads(component.__getstate__())


def _split_pattern(
    normalizer: dict[str, Any] | None, pre: dict[str, Any] | None
) -> re.Pattern[str] | None:
    """The ASCII regex for the tokenizer's normalizer and pre-tokenizer, if known."""
    if normalizer is not None and normalizer.get("type") != "NFC":
        return None
    pre = pre or {}
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return _PATTERNS[_GPT2]
    if pre.get("type") != "Sequence" or len(pre.get("pretokenizers", [])) != 2:
        return None
    first, second = pre["pretokenizers"]
    if (
        first.get("type") != "Split"
        or first.get("behavior") != "Isolated"
        or first.get("invert")
        or second.get("type") != "ByteLevel"
        or second.get("add_prefix_space")
        or second.get("use_regex")
    ):
        return None
    return _PATTERNS.get((first.get("pattern") or {}).get("Regex", ""))


def _plain_bpe(raw: RawTokenizer) -> bool:
    model = raw.model
    return type(model).__name__ == "BPE" and not getattr(model, "dropout", None)


def _added_groups(raw: RawTokenizer) -> list[list[tuple[str, int]]] | None:
    """Added tokens as (content, id): un-normalized ones, then normalized ones (the
    tokenizer's two passes); None when one is matched other than as a plain string.

    A token that cannot occur in the text the cache takes (non-ASCII, or holding
    \\x1c-\\x1f) is left out: its matching rules do not matter there.
    """
    groups: list[list[tuple[str, int]]] = [[], []]
    for token_id, token in raw.get_added_tokens_decoder().items():
        content = token.content
        if not content or not content.isascii() or _UNSAFE.search(content):
            continue
        if token.single_word or token.lstrip or token.rstrip:
            return None
        groups[1 if token.normalized else 0].append((content, token_id))
    return groups


def _probe_texts(added: list[list[tuple[str, int]]]) -> list[str]:
    """ASCII texts that exercise every branch of the regexes and the added tokens."""
    specials = [t for g in added for t, _ in g]
    parts = [
        " ", "  ", "   ", "\n", "\n\n", "\r\n", "\t", " \t ", "\v", "\f", "a", "Word", "WORD",
        "x1", "123", "12345678", "3.14", "'s", "'S", "'ll", "'LL", "don't", "it's", "!!", "?! ",
        "...", "--", "#", "$x", "(a)", "{\"k\": 1}", "\\n", "~`", "_id", "a_b", "\x7f", "\x00",
    ]  # fmt: skip
    parts += specials[:32]
    rng = random.Random(25)
    texts = ["".join(rng.choice(parts) for _ in range(400)) for _ in range(12)]
    return [*texts, "".join(parts), "def f(x):\n    return x * 2  # it's 2024-01-02\n\n  y\n"]
