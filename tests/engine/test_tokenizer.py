"""The tokenizer loads from the committed fixture and from the GGUF, and round-trips."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from recorder.model.tokenizer import (
    TemplateNotIncremental,
    TokenizerLoadError,
    bundled_template,
    load_tokenizer,
)

from .conftest import FIXTURE_TOKENIZER, smollm2_gguf_or_skip


def test_fixture_identity(tokenizer) -> None:
    ident = tokenizer.identity
    assert ident.vocab_size == 49152
    assert tokenizer.eos_token_ids == (2,) == ident.eos_token_ids
    assert tokenizer.pad_token_id == 2
    assert len(ident.vocab_digest) == 64
    assert tokenizer.token_to_id("<|im_start|>") == 1


def test_encode_adds_nothing_and_maps_special_strings(tokenizer) -> None:
    assert tokenizer.encode("") == []
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>"


def test_decode_keeps_special_tokens_and_per_token_strings(tokenizer) -> None:
    text = "Hello, wörld! <|im_end|>"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    pieces = tokenizer.decode_tokens(ids)
    assert len(pieces) == len(ids)
    assert pieces[-1] == "<|im_end|>"
    assert pieces[0] == "Hello"


def test_template_identity_differs_per_template() -> None:
    a = load_tokenizer(str(FIXTURE_TOKENIZER))
    b = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template=str(bundled_template("chatml-tools")))
    assert a.identity.vocab_digest == b.identity.vocab_digest
    assert a.identity.chat_template_digest != b.identity.chat_template_digest
    # The model's own template (plain ChatML with a default system prompt).
    assert "SmolLM" in a.render([{"role": "user", "content": "hi"}])


def test_bad_paths_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="neither a directory"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(TokenizerLoadError, match=r"no tokenizer\.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(TokenizerLoadError, match="cannot read chat template"):
        load_tokenizer(str(FIXTURE_TOKENIZER), chat_template=str(tmp_path / "nope.jinja"))


def test_missing_template_is_an_error(tmp_path: Path) -> None:
    shutil.copy(FIXTURE_TOKENIZER / "tokenizer.json", tmp_path)
    config = json.loads((FIXTURE_TOKENIZER / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerLoadError, match="--chat-template"):
        load_tokenizer(str(tmp_path))
    config["chat_template"] = "{{ messages[0].content }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.render([{"role": "user", "content": "x"}]) == "x"
    assert tok.eos_token_ids == (2, 0)


def test_render_suffix_rejects_non_incremental_template(tmp_path: Path) -> None:
    template = tmp_path / "last.jinja"
    # Marks the last message: rendering more messages changes earlier text.
    template.write_text(
        "{% for m in messages %}{{ m.content }}{% if loop.last %}!{% endif %}{% endfor %}"
    )
    tok = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template=str(template))
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateNotIncremental, match="first change at character 1"):
        tok.render_suffix(msgs, 1)


def test_render_errors_are_value_errors(tmp_path: Path) -> None:
    template = tmp_path / "strict.jinja"
    template.write_text("{{ raise_exception('no tools allowed') if tools else 'ok' }}")
    tok = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template=str(template))
    assert tok.render([]) == "ok"
    with pytest.raises(ValueError, match="no tools allowed"):
        tok.render([], tools=[{"name": "x"}])


@pytest.mark.tiny
def test_gguf_load_converts_once_into_cache(tmp_path: Path, monkeypatch) -> None:
    gguf = smollm2_gguf_or_skip()
    monkeypatch.setenv("TR_TOKENIZER_CACHE", str(tmp_path))
    tok = load_tokenizer(str(gguf))
    fixture = load_tokenizer(str(FIXTURE_TOKENIZER))
    assert tok.identity.vocab_digest == fixture.identity.vocab_digest
    assert tok.identity.name_or_path == str(gguf)
    text = "def f(x):\n    return x ** 2  # 平方"
    assert tok.encode(text) == fixture.encode(text)
    cached = list((tmp_path / "gguf-tokenizers").iterdir())
    assert len(cached) == 1 and (cached[0] / "tokenizer.json").exists()
    # A second load reuses the cache (no conversion: the directory is unchanged).
    mtime = (cached[0] / "tokenizer.json").stat().st_mtime_ns
    load_tokenizer(str(gguf))
    assert (cached[0] / "tokenizer.json").stat().st_mtime_ns == mtime


def test_jinja_environment_matches_transformers(tmp_path: Path) -> None:
    """Our sandbox renders templates as transformers' apply_chat_template does."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(FIXTURE_TOKENIZER))
    msgs = [
        {"role": "system", "content": "sys <b>&"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "ok",
            "reasoning_content": "think",
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {"x": "é"}}}
            ],
        },
        {"role": "tool", "content": "result"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for name in ("chatml-tools", "chatml-tools-think"):
        ours = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template=name)
        theirs = hf.apply_chat_template(
            msgs, tools=tools, chat_template=ours.chat_template, tokenize=False,
            add_generation_prompt=True,
        )  # fmt: skip
        assert ours.render(msgs, tools) == theirs
    own = load_tokenizer(str(FIXTURE_TOKENIZER))
    plain = msgs[1:2]
    assert own.render(plain) == hf.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=True
    )


def test_generation_tag_loop_controls_and_raw_tokens(tmp_path: Path) -> None:
    template = tmp_path / "gen.jinja"
    template.write_text(
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% if loop.index > 1 %}"
        "{% break %}{% endif %}{% endfor %}{{ {'a': '<b>'} | tojson }}"
    )
    tok = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template=str(template))
    msgs = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "never"},
    ]
    assert tok.render(msgs) == 'uA{"a": "<b>"}'
    assert tok.id_to_token(tok.encode(" hello")[0]) == "Ġhello"
