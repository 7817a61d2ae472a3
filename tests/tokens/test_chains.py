"""Token chains: extension with raw tokens, new chains and their reasons, clamp, TITO."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from chat_builders import (
    TOKENIZER_DIR,
    Answer,
    Conversation,
    assert_extends_with_output,
    canonical_output_ids,
)

from recorder.dialects.chat import find_dispatches
from recorder.dialects.translate import parse_request, response_message_digest
from recorder.model.tokenizer import Tokenizer, load_tokenizer
from recorder.model.tokens import (
    MAX_PENDING_DISPATCHES,
    ContextOverflow,
    SessionChains,
    clamp_max_new_tokens,
    commit_turn,
    full_input_ids,
    note_dispatch,
    plan_turn,
    render_chars,
    tito_check,
)


def _tool_loop(conv: Conversation, chains: SessionChains, tok: Tokenizer, turns: int) -> list:
    """`turns` tool-use turns; returns [(plan, output_ids)]."""
    conv.user("Fix the failing test in this repo.")
    done = []
    for k in range(turns):
        answer = Answer(
            text=f"Step {k}: running a command.",
            thinking=f"I should check thing {k}." if k % 2 else "",
            tool_calls=[(f"toolu_{k:02d}", "Bash", {"command": f"cat file{k}.py"})],
        )
        done.append(conv.turn(chains, tok, answer))
        conv.tool_results((f"toolu_{k:02d}", f"contents of file{k}.py\nline 2\n"))
    return done


def test_each_turn_starts_with_previous_input_and_output(tok: Tokenizer) -> None:
    conv, chains = Conversation(), SessionChains()
    done = _tool_loop(conv, chains, tok, turns=5)
    first = done[0][0]
    assert (first.action, first.reason, first.prefix_len) == ("new", "first", 0)
    for (prev, prev_out), (plan, _) in itertools.pairwise(done):
        assert (plan.action, plan.reason, plan.chain_id) == ("extend", "extends", first.chain_id)
        assert plan.input_ids[: len(prev.input_ids)] == prev.input_ids
        assert plan.input_ids[len(prev.input_ids) : plan.prefix_len].tolist() == prev_out
        assert plan.prefix_len == len(prev.input_ids) + len(prev_out)
        assert plan.new_messages == 1  # the tool result
        assert plan.closing_inserted == 0


def test_incremental_render_equals_full_rerender_when_outputs_are_canonical(
    tok: Tokenizer,
) -> None:
    conv, chains = Conversation(), SessionChains()
    _tool_loop(conv, chains, tok, turns=4)
    req = conv.request()
    plan = plan_turn(chains, req, tok)
    assert plan.action == "extend"
    assert plan.input_ids.tolist() == full_input_ids(req, tok)
    # Only the new tokens were tokenized: far fewer than the whole input.
    assert plan.new_tokens < len(plan.input_ids) // 4


def test_chain_keeps_raw_model_tokens_where_rerender_differs(tok: Tokenizer) -> None:
    conv, chains = Conversation(), SessionChains()
    conv.user("Say hello.")
    answer = Answer(text="hello world")
    canonical = canonical_output_ids(tok, answer)
    # The model spelled "hello" in two pieces: same text, different ids.
    hel, lo = tok.encode("hel"), tok.encode("lo")
    raw = hel + lo + canonical[len(tok.encode("hello")) :]
    assert tok.decode(raw) == tok.decode(canonical) and raw != canonical
    plan, _ = conv.turn(chains, tok, answer, output_ids=raw)
    conv.user("Again.")
    req = conv.request()
    nxt = plan_turn(chains, req, tok)
    assert_extends_with_output(nxt, plan, raw)
    full = full_input_ids(req, tok)
    assert full != nxt.input_ids.tolist()  # a re-render would have lost the model's real tokens
    assert tok.decode(full) == tok.decode(nxt.input_ids)


def test_output_without_eos_gets_the_closing_inserted(tok: Tokenizer) -> None:
    conv, chains = Conversation(), SessionChains()
    conv.user("Write a long essay.")
    answer = Answer(text="Once upon a time")
    _, out = conv.turn(chains, tok, answer, eos=False)  # cut by max_tokens
    assert out[-1] not in tok.eos_token_ids
    conv.user("Go on.")
    req = conv.request()
    nxt = plan_turn(chains, req, tok)
    assert nxt.action == "extend"
    assert nxt.closing_inserted == len(tok.encode("<|im_end|>\n"))
    inserted = nxt.input_ids[nxt.prefix_len : nxt.prefix_len + nxt.closing_inserted]
    assert tok.decode(inserted) == "<|im_end|>\n"
    assert nxt.input_ids.tolist() == full_input_ids(req, tok)


def test_compaction_starts_a_new_main_chain(tok: Tokenizer) -> None:
    conv, chains = Conversation(), SessionChains()
    done = _tool_loop(conv, chains, tok, turns=3)
    conv.user("Summarize the conversation so far.")
    summary, _ = conv.turn(chains, tok, Answer(text="Summary: fixed files 0-2."))
    assert summary.action == "extend"  # the summary request still extends
    compacted = Conversation(system=conv.system)
    compacted.user("This session continues from a summary: fixed files 0-2. Continue.")
    plan = plan_turn(chains, compacted.request(), tok)
    assert (plan.action, plan.reason, plan.prefix_len) == ("new", "compaction", 0)
    assert plan.parent_chain_id == done[0][0].chain_id
    assert plan.chain_id != done[0][0].chain_id
    commit_turn(
        chains,
        plan,
        canonical_output_ids(tok, Answer(text="ok")),
        response_message_digest(Answer(text="ok").content()),
    )
    assert chains.main_chain_id == plan.chain_id


def test_subagent_gets_its_own_chain_and_main_line_resumes(tok: Tokenizer) -> None:
    main, chains = Conversation(), SessionChains()
    main.user("Investigate, using a subagent.")
    dispatch = Answer(
        text="Delegating.",
        tool_calls=[
            (
                "toolu_agent",
                "Agent",
                {"prompt": "Find where X is defined.", "description": "find X"},
            )
        ],
    )
    first, _ = main.turn(chains, tok, dispatch)
    found = find_dispatches(dispatch.content())
    note_dispatch(chains, [i for i, _ in found], [p for _, p in found])

    sub = Conversation(system="You are a search subagent.")
    sub.user("Find where X is defined.")
    s1, _ = sub.turn(
        chains,
        tok,
        Answer(text="Searching.", tool_calls=[("toolu_s1", "Bash", {"command": "grep -r X"})]),
    )
    assert (s1.action, s1.reason, s1.dispatch_tool_use_id) == ("new", "subagent", "toolu_agent")
    assert s1.parent_chain_id == first.chain_id and not s1.main_line
    sub.tool_results(("toolu_s1", "x.py:1: X = 1"))
    s2, _ = sub.turn(chains, tok, Answer(text="X is defined in x.py."))
    assert (s2.action, s2.chain_id) == ("extend", s1.chain_id)
    assert chains.main_chain_id == first.chain_id

    main.tool_results(("toolu_agent", "X is defined in x.py."))
    back = plan_turn(chains, main.request(), tok)
    assert (back.action, back.chain_id) == ("extend", first.chain_id)
    assert back.returned_dispatch_ids == ("toolu_agent",)
    commit_turn(
        chains,
        back,
        canonical_output_ids(tok, Answer(text="Done.")),
        response_message_digest(Answer(text="Done.").content()),
    )
    assert chains.pending_dispatches == []


def test_parallel_subagents_match_their_dispatch_by_prompt(tok: Tokenizer) -> None:
    main, chains = Conversation(), SessionChains()
    main.user("Two searches.")
    main.turn(chains, tok, Answer(text="x"))
    note_dispatch(chains, ["toolu_a", "toolu_b"], ["Search for alpha.", "Search for beta."])
    sub = Conversation(system="You are a search subagent.")
    sub.user("Search for beta.")
    plan = plan_turn(chains, sub.request(), tok)
    assert (plan.reason, plan.dispatch_tool_use_id) == ("subagent", "toolu_b")


def test_unrelated_system_prompt_without_dispatch_is_diverged(tok: Tokenizer) -> None:
    main, chains = Conversation(), SessionChains()
    main.user("Hi.")
    first, _ = main.turn(chains, tok, Answer(text="Hello."))
    side = Conversation(system="Generate a short title for this conversation.")
    side.user("Hi.")
    plan, _ = side.turn(chains, tok, Answer(text="Greeting"))
    assert (plan.action, plan.reason, plan.main_line) == ("new", "diverged", False)
    assert chains.main_chain_id == first.chain_id


def test_render_chars_counts_what_plan_turn_will_tokenize(tok: Tokenizer) -> None:
    conv, chains = Conversation(), SessionChains()
    conv.user("x" * 50_000)  # a long first message
    first = len(conv.body())
    assert render_chars(chains, conv.request(), tok, first) == first  # no chain: everything
    _tool_loop(conv, chains, tok, turns=3)
    body = len(conv.body())
    new = render_chars(chains, conv.request(), tok, body)
    assert 0 < new < 200 < body  # only the last tool result, whatever the context
    retry = Conversation(system=conv.system, messages=conv.messages[:-2])
    assert render_chars(chains, retry.request(), tok, len(retry.body())) == 0


def test_retried_request_reuses_the_exact_input(tok: Tokenizer) -> None:
    conv, chains = Conversation(), SessionChains()
    done = _tool_loop(conv, chains, tok, turns=2)
    last_plan = done[-1][0]
    # The client never saw the last answer and sends the same request again.
    retry = Conversation(system=conv.system, messages=conv.messages[:-2])
    plan = plan_turn(chains, retry.request(), tok)
    assert (plan.action, plan.reason) == ("new", "diverged")
    assert plan.input_ids == last_plan.input_ids
    assert plan.prefix_len == len(last_plan.input_ids)
    assert plan.main_line and plan.parent_chain_id == last_plan.chain_id


def test_edited_history_forks_at_the_last_matching_turn(tok: Tokenizer) -> None:
    conv, chains = Conversation(), SessionChains()
    done = _tool_loop(conv, chains, tok, turns=3)
    forked = Conversation(system=conv.system, messages=list(conv.messages[:4]))
    forked.tool_results(("toolu_01", "a different result"))
    plan = plan_turn(chains, forked.request(), tok)
    second_plan, second_out = done[1]
    assert (plan.action, plan.reason) == ("new", "diverged")
    assert plan.prefix_len == len(second_plan.input_ids) + len(second_out)
    assert plan.input_ids[: plan.prefix_len].tolist() == second_plan.input_ids.tolist() + second_out


def test_changed_tools_do_not_extend(tok: Tokenizer) -> None:
    conv, chains = Conversation(), SessionChains()
    _tool_loop(conv, chains, tok, turns=1)
    conv.tools = conv.tools[:1]
    plan = plan_turn(chains, conv.request(), tok)
    assert (plan.action, plan.reason) == ("new", "compaction")


def test_failed_turn_leaves_chains_untouched(tok: Tokenizer) -> None:
    conv, chains = Conversation(), SessionChains()
    _tool_loop(conv, chains, tok, turns=2)
    before = (dict(chains.chains), chains.main_chain_id, list(chains.pending_dispatches))
    tokens_before = chains.main.tokens.tolist()
    plan_turn(chains, conv.request(), tok)  # engine fails: no commit
    assert (dict(chains.chains), chains.main_chain_id, list(chains.pending_dispatches)) == before
    assert chains.main.tokens.tolist() == tokens_before
    again = plan_turn(chains, conv.request(), tok)
    assert again.action == "extend"


def test_commit_refuses_a_stale_plan(tok: Tokenizer) -> None:
    conv, chains = Conversation(), SessionChains()
    _tool_loop(conv, chains, tok, turns=1)
    a = plan_turn(chains, conv.request(), tok)
    b = plan_turn(chains, conv.request(), tok)
    commit_turn(chains, a, [2], "d")
    with pytest.raises(RuntimeError, match="session lock"):
        commit_turn(chains, b, [2], "d")


def test_chains_per_session_are_bounded_and_keep_the_main_line(tok: Tokenizer) -> None:
    main, chains = Conversation(), SessionChains(max_chains=3)
    main.user("Hi.")
    first, _ = main.turn(chains, tok, Answer(text="Hello."))
    for i in range(6):
        side = Conversation(system=f"Side task {i}.")
        side.user("x")
        side.turn(chains, tok, Answer(text="y"))
    assert len(chains.chains) == 3
    assert first.chain_id in chains.chains


def test_clamp_max_new_tokens() -> None:
    assert clamp_max_new_tokens(100, input_len=50, context_length=1000) == 100
    assert clamp_max_new_tokens(32000, input_len=900, context_length=1000) == 100
    assert clamp_max_new_tokens(None, input_len=900, context_length=1000) == 100
    assert clamp_max_new_tokens(5, input_len=999, context_length=1000) == 1
    with pytest.raises(ContextOverflow, match="prompt is too long: 1000 tokens > 999"):
        clamp_max_new_tokens(5, input_len=1000, context_length=1000)


def test_tito_check_finds_a_split_word(tok: Tokenizer) -> None:
    whole = tok.encode("hello world")
    assert tito_check(tok, whole).ok
    split = tok.encode("hel") + tok.encode("lo") + tok.encode(" world")
    result = tito_check(tok, split)
    assert not result.ok
    assert result.first_divergence == 0
    assert result.reencoded_ids == whole
    prefix = tok.encode("Hi,")
    later = prefix + split
    assert tok.encode(tok.decode(later))[: len(prefix)] == prefix
    assert tito_check(tok, later).first_divergence == len(prefix)


class _ReorderingTokenizer:
    """A template that re-renders earlier messages once more follow (like Qwen3's thinking)."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.eos_token_ids = tok.eos_token_ids
        self.encode, self.decode = tok.encode, tok.decode

    def render(self, messages, tools=None, add_generation_prompt=True, **kw):  # type: ignore[no-untyped-def]
        text = self._tok.render(messages, tools, add_generation_prompt, **kw)
        return f"[{len(messages)} messages]" + text


def test_non_incremental_template_falls_back_to_a_full_render(tok: Tokenizer) -> None:
    bad = _ReorderingTokenizer(tok)
    conv, chains = Conversation(), SessionChains()
    conv.user("Hi.")
    conv.turn(chains, bad, Answer(text="Hello."))  # type: ignore[arg-type]
    conv.user("More.")
    req = conv.request()
    plan = plan_turn(chains, req, bad)  # type: ignore[arg-type]
    assert plan.action == "new" and "does not render" in plan.fallback
    assert plan.input_ids.tolist() == full_input_ids(req, bad)  # type: ignore[arg-type]


_DROPS_OLD_REASONING = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{{ '<|im_start|>' + m.role + '\\n' }}
{%- if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last_user -%}
{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}
{%- endif -%}
{{ m.content + '<|im_end|>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}
"""


def test_template_dropping_old_reasoning_keeps_the_emitted_thinking(tmp_path: Path) -> None:
    """Like Qwen3's template: a re-render would drop earlier thinking; the chain keeps it."""
    template = tmp_path / "drops-reasoning.jinja"
    template.write_text(_DROPS_OLD_REASONING)
    qwenish = load_tokenizer(str(TOKENIZER_DIR), chat_template=str(template))
    conv, chains = Conversation(tools=[]), SessionChains()
    conv.user("What is 2+2?")
    answer = Answer(text="4", thinking="Two plus two is four.")
    emitted = qwenish.encode("<think>\nTwo plus two is four.\n</think>\n\n4<|im_end|>")
    first, _ = conv.turn(chains, qwenish, answer, output_ids=emitted)
    conv.user("And 3+3?")
    req = conv.request()
    plan = plan_turn(chains, req, qwenish)
    assert_extends_with_output(plan, first, emitted)
    assert "<think>" not in qwenish.decode(full_input_ids(req, qwenish))
    assert qwenish.decode(plan.input_ids[plan.prefix_len :]) == (
        "\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_thinking_toggle_still_extends(tok: Tokenizer) -> None:
    conv, chains = Conversation(), SessionChains()
    conv.user("Hi.")
    conv.turn(chains, tok, Answer(text="Hello."))
    conv.user("Bye.")
    body = json.loads(conv.body())
    body["thinking"] = {"type": "disabled"}
    plan = plan_turn(chains, parse_request(json.dumps(body).encode()), tok)
    assert plan.action == "extend"


def test_nested_dispatch_returns_inside_the_subagent(tok: Tokenizer) -> None:
    main, chains = Conversation(), SessionChains()
    main.user("Go.")
    main.turn(chains, tok, Answer(text="x", tool_calls=[("toolu_outer", "Agent", {"prompt": "P"})]))
    note_dispatch(chains, ["toolu_outer"], ["P"])
    sub = Conversation(system="Subagent.")
    sub.user("P")
    sub.turn(chains, tok, Answer(text="y", tool_calls=[("toolu_inner", "Agent", {"prompt": "Q"})]))
    note_dispatch(chains, ["toolu_inner"], ["Q"])
    nested = Conversation(system="Nested subagent.")
    nested.user("Q")
    inner, _ = nested.turn(chains, tok, Answer(text="z"))
    assert (inner.reason, inner.dispatch_tool_use_id) == ("subagent", "toolu_inner")
    sub.tool_results(("toolu_inner", "z"))
    back, _ = sub.turn(chains, tok, Answer(text="done"))
    assert back.action == "extend" and back.returned_dispatch_ids == ("toolu_inner",)
    assert [d.tool_use_id for d in chains.pending_dispatches] == ["toolu_outer"]


def test_pending_dispatches_are_bounded() -> None:
    chains = SessionChains()
    note_dispatch(chains, [f"toolu_{i}" for i in range(MAX_PENDING_DISPATCHES + 10)])
    note_dispatch(chains, ["toolu_0"])  # already forgotten: noted again at the end
    assert len(chains.pending_dispatches) == MAX_PENDING_DISPATCHES
    assert chains.pending_dispatches[-1].tool_use_id == "toolu_0"


def test_echo_without_thinking_still_extends(tok: Tokenizer) -> None:
    """Clients may strip thinking from earlier turns; the chain keeps what the model emitted."""
    conv, chains = Conversation(), SessionChains()
    conv.user("Hi.")
    answer = Answer(text="Hello.", thinking="Greet back.")
    first, out = conv.turn(chains, tok, answer)
    conv.messages[-1]["content"] = [b for b in answer.content() if b["type"] != "thinking"]
    conv.user("Bye.")
    plan = plan_turn(chains, conv.request(), tok)
    assert_extends_with_output(plan, first, out)
    assert "Greet back." in tok.decode(out)


def test_echo_with_different_thinking_does_not_extend(tok: Tokenizer) -> None:
    conv, chains = Conversation(), SessionChains()
    conv.user("Hi.")
    answer = Answer(text="Hello.", thinking="Greet back.")
    conv.turn(chains, tok, answer)
    conv.messages[-1]["content"][0]["thinking"] = "Something else."
    conv.user("Bye.")
    plan = plan_turn(chains, conv.request(), tok)
    assert plan.action == "new"
