"""Our chat templates: every message renders independently of what follows it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recorder.model.tokenizer import load_tokenizer

from .conftest import FIXTURE_TOKENIZER

TEMPLATES = ["chatml-tools", "chatml-tools-think"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]

text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
tool_call = st.builds(
    lambda name, args: {"type": "function", "function": {"name": name, "arguments": args}},
    st.sampled_from(["read_file", "bash"]),
    st.dictionaries(st.sampled_from(["path", "cmd", "n"]), st.one_of(text, st.integers())),
)
message = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, text),
    st.builds(lambda c: {"role": "user", "content": [{"type": "text", "text": c}]}, text),
    st.builds(lambda c: {"role": "system", "content": c}, text),
    st.builds(lambda c: {"role": "tool", "tool_call_id": "t1", "content": c}, text),
    st.builds(
        lambda c, r, calls: {
            "role": "assistant",
            "content": c,
            **({"reasoning_content": r} if r else {}),
            **({"tool_calls": calls} if calls else {}),
        },
        text,
        st.one_of(st.none(), text),
        st.lists(tool_call, max_size=2),
    ),
)


@pytest.fixture(scope="module", params=TEMPLATES)
def tok(request):
    return load_tokenizer(str(FIXTURE_TOKENIZER), chat_template=request.param)


def _conversation() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Read a.py"},
        {
            "role": "assistant",
            "content": "Reading it.",
            "reasoning_content": "I should call read_file.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "read_file", "arguments": {"path": "a.py"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "print('hi')"},
        {"role": "assistant", "content": "It prints hi."},
        {"role": "user", "content": "Thanks"},
    ]


@settings(max_examples=60, deadline=None)
@given(messages=st.lists(message, min_size=1, max_size=6), with_tools=st.booleans())
def test_each_message_renders_independently(tok, messages, with_tools) -> None:
    tools = TOOLS if with_tools else None
    rendered = [
        tok.render(messages[:k], tools, add_generation_prompt=False)
        for k in range(len(messages) + 1)
    ]
    for k in range(len(messages)):
        assert rendered[k + 1].startswith(rendered[k])
        # The new message alone, rendered as a continuation, is exactly the added text.
        if k:
            alone = tok.render(messages[k:], tools, add_generation_prompt=False, continuation=True)
            assert alone == rendered[-1][len(rendered[k]) :]
    # The generation prompt only appends.
    assert tok.render(messages, tools).startswith(rendered[-1])


def test_render_suffix_equals_continuation(tok) -> None:
    msgs = _conversation()
    for start in range(1, len(msgs)):
        assert tok.render_suffix(msgs, start, TOOLS) == tok.render(
            msgs[start:], TOOLS, continuation=True
        )
    assert tok.render_suffix(msgs, 0, TOOLS) == tok.render(msgs, TOOLS)


def test_tool_call_and_result_format() -> None:
    tok = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template="chatml-tools")
    out = tok.render(_conversation(), TOOLS, add_generation_prompt=True)
    assert out.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n")
    assert '\n<tools>\n{"type": "function", "function": {"name": "read_file"' in out
    assert (
        "<|im_start|>assistant\n<think>\nI should call read_file.\n</think>\n\nReading it.\n"
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>\n'
    ) in out
    assert "<|im_start|>user\n<tool_response>\nprint('hi')\n</tool_response><|im_end|>\n" in out
    assert "<|im_start|>assistant\nIt prints hi.<|im_end|>\n" in out
    assert out.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
    # Special tokens in the text tokenize to single ids.
    ids = tok.encode(out)
    assert ids.count(1) == out.count("<|im_start|>") and ids.count(2) == out.count("<|im_end|>")


def test_json_string_arguments_render_verbatim() -> None:
    tok = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template="chatml-tools")
    msg = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}],
    }
    out = tok.render([msg], add_generation_prompt=False, continuation=True)
    assert (
        out
        == '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>\n'
    )


def test_no_system_message_gets_a_preamble() -> None:
    tok = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template="chatml-tools")
    out = tok.render([{"role": "user", "content": "hi"}], TOOLS)
    assert out.startswith("<|im_start|>system\n# Tools\n")
    plain = tok.render([{"role": "user", "content": "hi"}])
    assert plain.startswith("<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n")


def test_think_variant_prefills_reasoning() -> None:
    tok = load_tokenizer(str(FIXTURE_TOKENIZER), chat_template="chatml-tools-think")
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render(msgs).endswith("<|im_start|>assistant\n<think>\n")
    assert tok.render(msgs, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    with_answer = [*msgs, {"role": "assistant", "content": "hello"}]
    assert tok.render(with_answer, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nhello<|im_end|>\n"
    )


# A template reading dict keys that are also dict attributes, missing keys, a dict
# subclass and dunder names: the sandbox's dict shortcut must change none of them.
_LOOKUPS = (
    "{{ m.role }}|{{ m.items is defined }}|{{ m.get('role') }}|{{ m.missing is defined }}"
    "|{{ m.keys is defined }}|{{ s.role }}|{{ s.items is defined }}|{{ m.__class__ is defined }}"
    "|{{ m.content }}|{% for k, v in m.items() %}{{ k }}={{ v }};{% endfor %}"
)


class _Sub(dict):  # type: ignore[type-arg]
    role = "attribute"


def test_sandbox_dict_shortcut_matches_jinja_sandbox() -> None:
    """Same text as jinja's own ImmutableSandboxedEnvironment, attribute-like keys included."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from recorder.model.tokenizer import _compile_template

    m = {"role": "user", "items": "key", "content": "hi", "keys": 1}
    s = _Sub(role="item", items="x")
    ours = _compile_template(_LOOKUPS).render(m=m, s=s)
    theirs = ImmutableSandboxedEnvironment().from_string(_LOOKUPS).render(m=m, s=s)
    assert ours == theirs
    # Dict methods stay methods, a missing key is undefined, `__class__` stays unsafe.
    assert ours == (
        "user|True|user|False|True|attribute|True|False|hi|role=user;items=key;content=hi;keys=1;"
    )
