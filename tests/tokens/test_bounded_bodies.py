"""A long text is tokenized in pieces to the same ids, and planning stops at the context (issue 24).

The pieces are cut where the pre-tokenizer always starts a new pre-token;
these tests attack that claim with texts built to break it (whitespace
runs at a cut, special tokens, no blank at all, every script), with pieces
made tiny so every text is cut many times, and with tokenizers whose
pre-tokenizer differs (Qwen's regex split: pieces allowed; a marker prepended
to every text, as Llama 2 does: pieces refused). Planning with a context must refuse a prompt
that cannot fit, whatever field holds the bulk, after tokenizing no more
than it must; and a prompt that fits must get the ids of the whole render.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import recorder.dialects.chat as chat_module
import recorder.model.tokenizer as tokenizer_module
from recorder.dialects import dialect_named
from recorder.model.tokenizer import Tokenizer, TooManyTokens
from recorder.model.tokens import ContextOverflow, SessionChains, full_input_ids, plan_turn
from tests.conftest import tokenizer_variant
from tools.benchkit.bodies import CHAT, KINDS, RESPONSES, bulk_body
from tools.benchkit.engine import TOKENIZER as FIXTURE_TOKENIZER

DIALECT_OF = {CHAT: "openai-chat", RESPONSES: "openai-responses"}

TEXTS = [
    "def f(x):\n    return x * 2  # ünï 漢字\n" * 300,
    "word " * 3000,
    "a  b   c    d\n\n\ne\n \n f\t\tg \t h" * 300,
    "=" * 3000 + "\n" * 3000 + " " * 3000 + "x",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> <|im_start|>x" * 200,
    "ünïcödé 漢字 🙂 عربى हिन्दी " * 300,
    "".join(chr(c) for c in range(32, 5000)) * 2,
    "x" * 20000,
    "it's don't we'll 12345 678 3.14 -- !!! ??? ...\r\n" * 300,
]


def _random_text(rng: random.Random, n: int) -> str:
    alphabet = [
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "a",
        "Word",
        "é",
        "漢",
        "🙂",
        "1",
        "'s",
        ".",
        "<|im_end|>",
    ]
    return "".join(rng.choice(alphabet) for _ in range(n))


@pytest.fixture
def tiny_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of ~50 characters: every text below is cut hundreds of times."""
    monkeypatch.setattr(tokenizer_module, "_PIECE_CHARS", 50)
    monkeypatch.setattr(tokenizer_module, "_CUT_LOOKBACK", 40)


def test_pieces_give_the_ids_of_the_whole_text(tok: Tokenizer, tiny_pieces: None) -> None:
    assert tok.cuts_exact
    rng = random.Random(24)
    for text in [*TEXTS, *(_random_text(rng, 2000) for _ in range(30))]:
        assert tok.encode_array(text).tolist() == tok.encode(text), text[:40]


def _variant(
    tmp_path: Path, name: str, pre_tokenizer: dict, normalizer: dict | None = None
) -> Tokenizer:
    """The fixture tokenizer with another pre-tokenizer (and normalizer)."""
    edit: dict = {"pre_tokenizer": pre_tokenizer}
    if normalizer is not None:
        edit["normalizer"] = normalizer
    return tokenizer_variant(tmp_path, name, edit)


QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def test_a_qwen_style_split_is_cut_exactly(tmp_path: Path, tiny_pieces: None) -> None:
    qwen = _variant(
        tmp_path,
        "qwen",
        {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN_SPLIT},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": False,
                    "use_regex": False,
                },
            ],
        },
        {"type": "NFC"},
    )
    assert qwen.cuts_exact
    rng = random.Random(7)
    for text in [*TEXTS, *(_random_text(rng, 2000) for _ in range(30))]:
        assert qwen.encode_array(text).tolist() == qwen.encode(text), text[:40]


def test_a_tokenizer_that_marks_each_text_start_is_never_cut(tmp_path: Path) -> None:
    """As Llama 2's SentencePiece does (a normalizer prepends the word marker to every
    text): each piece would get a marker of its own."""
    spec = json.loads((FIXTURE_TOKENIZER / "tokenizer.json").read_text())
    prepending = _variant(
        tmp_path, "prepend", spec["pre_tokenizer"], {"type": "Prepend", "prepend": " "}
    )
    assert not prepending.cuts_exact
    text = TEXTS[0] * 100  # longer than a piece: tokenized whole, as before
    assert prepending.encode_array(text).tolist() == prepending.encode(text)


def test_tokenizing_stops_once_the_count_passes_the_limit(tok: Tokenizer) -> None:
    text = "the quick brown fox jumps over a lazy dog; " * 50_000  # 2.1M chars, ~500k tokens
    seen: list[int] = []
    original = tok.encode

    def counting(piece: str) -> list[int]:
        seen.append(len(piece))
        return original(piece)

    tok.encode = counting  # type: ignore[method-assign]
    try:
        with pytest.raises(TooManyTokens) as caught:
            tok.encode_array(text, limit=20_000)
    finally:
        del tok.encode
    assert 20_000 < caught.value.at_least < 40_000 and not caught.value.exact
    assert sum(seen) < 3 * tokenizer_module._PIECE_CHARS  # ~90k of 2.1M chars tokenized
    with pytest.raises(TooManyTokens) as from_length:
        tok.encode_array(text, limit=1000)  # 2.1M chars / 81 > 1000: nothing tokenized
    assert from_length.value.at_least == len(text) // tok.max_token_chars


def _chat(kind: str, n_chars: int):  # type: ignore[no-untyped-def]
    import asyncio

    route, raw = bulk_body(kind, n_chars)
    chat, _ = asyncio.run(dialect_named(DIALECT_OF.get(route, "anthropic")).parse(raw))
    return chat


@pytest.mark.parametrize("kind", KINDS)
def test_every_field_kind_that_cannot_fit_is_refused(tok: Tokenizer, kind: str) -> None:
    chat = _chat(kind, 600_000)  # ~130k tokens in one field
    with pytest.raises(ContextOverflow, match="prompt is too long: at least"):
        plan_turn(SessionChains(), chat, tok, 8192)


@pytest.mark.parametrize("kind", KINDS)
def test_every_field_kind_that_fits_gets_the_ids_of_the_whole_render(
    tok: Tokenizer, kind: str
) -> None:
    chat = _chat(kind, 300_000)  # several pieces of 64k characters
    plan = plan_turn(SessionChains(), chat, tok, 1_000_000)
    assert plan.input_ids.tolist() == full_input_ids(chat, tok)


def test_digests_of_long_texts_are_the_digests_of_the_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Digested in pieces (no stripped, encoded copy), a message keeps its digest: digests
    are in the log, so one that changed would break every chain recorded before."""
    encoder = chat_module._encoder

    def whole(message: dict) -> str:  # message_digest as it was, copying the texts
        calls = message.get("tool_calls")
        ids = [(c["id"], c["function"]["name"]) for c in calls] if calls else None
        text = (message.get("content") or "").strip()
        rest = (message.get("tool_call_id"), message.get("is_error", False))
        digest = chat_module.digest_obj((message["role"], text, ids, *rest))
        if ids and text:
            digest += "|" + chat_module.digest_obj((message["role"], "", ids, *rest))
        reasoning = (message.get("reasoning_content") or "").strip()
        if not reasoning:
            return digest
        return f"{digest}+{chat_module.hashlib.blake2b(reasoning.encode(), digest_size=16).hexdigest()}"

    assert encoder is chat_module._encoder
    monkeypatch.setattr(chat_module, "_PIECE_CHARS", 7)
    rng = random.Random(3)
    alphabet = [
        " ",
        "\n",
        "\t",
        "a",
        "é",
        '"',
        "\\",
        "\x01",
        "\u2028",
        "漢",
        "🙂",
        "\u3000",
        "\x85",
    ]
    for n in range(3000):
        message: dict = {"role": rng.choice(["user", "assistant"])}
        message["content"] = (
            "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) if n % 5 else None
        )
        if n % 3 == 0:
            message["reasoning_content"] = "".join(
                rng.choice(alphabet) for _ in range(rng.randint(0, 30))
            )
        if n % 4 == 0:
            message["tool_calls"] = [{"id": "c1", "function": {"name": "Bash"}}]
        if n % 7 == 0:
            message["tool_call_id"] = "toolu_1"
        assert chat_module.message_digest(message) == whole(message), message
