"""The benchmarks' shared harness (tools/benchkit): the pieces every benchmark's figures rest on.

A wrong interval union inflates or hides the store's share of a turn; an
engine span that silently goes missing makes a turn's engine time zero and
its "middleware" time the whole turn; a header that drifts from its rows
puts a number under the wrong column; a Chat Completions twin that
translates differently compares two different conversations. Each is
attacked here with the real code (real dialect parsers, real processes).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import pytest

from recorder.dialects import ANTHROPIC, OPENAI_CHAT
from tools.benchkit import wire
from tools.benchkit.conversation import Conversation, tool_call_reply
from tools.benchkit.engine import fixture_tokenizer
from tools.benchkit.floor import generate_body, prompt_tokens, sse_answer, tool_call
from tools.benchkit.memory import status_bytes
from tools.benchkit.procs import measure_in_child
from tools.benchkit.slime_peer import TokenDifference, check_slime_src, token_difference
from tools.benchkit.stats import (
    Span,
    engine_seconds,
    ints,
    median,
    overlap,
    pct,
    rank_ms,
    slope,
    union_length,
)
from tools.benchkit.table import Columns, print_grid


def test_union_length_counts_overlapping_time_once() -> None:
    assert union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]) == 4.0
    assert union_length([]) == 0.0


def test_overlap_clips_spans_to_the_window_and_drops_those_outside() -> None:
    spans = [Span(0.0, 2.0), Span(3.0, 4.0), Span(9.0, 10.0)]
    assert overlap(1.0, 3.5, spans) == [(1.0, 2.0), (3.0, 3.5)]


def test_engine_seconds_sums_only_spans_wholly_inside_the_turn() -> None:
    spans = [Span(0.0, 1.0, 0.3), Span(1.5, 2.0, 0.2), Span(1.9, 3.0, 5.0)]
    assert engine_seconds(spans, 0.0, 2.0, "turn 1") == pytest.approx(0.5)


def test_engine_seconds_refuses_a_turn_without_an_engine_span() -> None:
    # A zero would make the whole turn count as middleware time.
    with pytest.raises(RuntimeError, match="turn 7"):
        engine_seconds([Span(5.0, 6.0, 1.0)], 0.0, 2.0, "turn 7")


def test_percentiles_and_ranks_in_ms() -> None:
    seconds = [0.001 * k for k in range(1, 11)]
    assert pct(seconds, 50) == pytest.approx(5.5)
    assert rank_ms(seconds, 0.9) == pytest.approx(9.0)  # a measured value, not interpolated
    assert math.isnan(pct([], 50)) and math.isnan(median([]))


def test_slope_and_option_lists() -> None:
    assert slope([0, 1, 2, 3], [10, 12, 14, 16]) == pytest.approx(2.0)
    assert math.isnan(slope([1], [1]))
    assert ints("1000, 10000,") == [1000, 10000]


def test_columns_rows_line_up_with_their_header() -> None:
    table = Columns(
        [("name", 8, "<"), ("n", 4, ">"), ("ms", 7, ">")], sep=" | ", edges=("| ", " |")
    )
    header, row = table.header(), table.row("turn", 30, "12.5")
    assert header == "| name     |    n |      ms |"
    assert [i for i, c in enumerate(row) if c == "|"] == [
        i for i, c in enumerate(header) if c == "|"
    ]
    assert table.rule() == "|----------|------|---------|"
    assert Columns([("a", 3, ">")]).rule() == "---"


def test_print_grid_sizes_columns_to_the_widest_cell(capsys: pytest.CaptureFixture[str]) -> None:
    print_grid(("benchmark", "ratio"), [("batched", "0.9x"), ("a much longer name", "12.0x")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == lines[2] == lines[-1] == "-" * 18 + "  " + "-" * 5
    assert lines[3] == "batched".ljust(18) + "  " + "0.9x".ljust(5)


def test_the_chat_completions_twin_is_the_same_conversation() -> None:
    """bench_middleware --dialect openai-chat compares the two wires on one conversation."""
    conversation = Conversation()
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "/a.py"}}
    conversation.add_answer([{"type": "text", "text": "I will read it."}, call])
    conversation.add_tool_result(30)
    body = conversation.body()
    messages, _ = asyncio.run(ANTHROPIC.parse(body))
    chat, _ = asyncio.run(OPENAI_CHAT.parse(wire.chat_body(body)))
    assert chat.messages == messages.messages
    assert chat.tools == messages.tools
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool"]


def test_a_conversation_refuses_a_tool_result_without_a_call() -> None:
    conversation = Conversation()
    conversation.add_answer([{"type": "text", "text": "Done."}])
    with pytest.raises(RuntimeError, match="without a tool call"):
        conversation.add_tool_result(10)


def test_measure_in_child_returns_the_last_json_line(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(
        "import json, sys\nprint('noise')\nprint(json.dumps({'args': sys.argv[1:]}))\n"
    )
    assert measure_in_child(str(script), ["a", "b"], "child") == {"args": ["a", "b"]}


def test_measure_in_child_fails_with_the_child_output(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text("import sys\nprint('what went wrong', file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(SystemExit, match="what went wrong"):
        measure_in_child(str(script), [], "child")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_status_bytes_reads_this_process_memory() -> None:
    assert status_bytes("VmHWM") >= status_bytes("VmRSS") > 0
    with pytest.raises(RuntimeError, match="NoSuchField"):
        status_bytes("NoSuchField")


def test_token_difference_finds_the_one_differing_middle() -> None:
    same = token_difference([1, 2, 3], [1, 2, 3])
    assert same == TokenDifference(3, 3, 3, 0) and same.identical
    ours, theirs = [5, 1, 2, 9, 7, 8], [5, 1, 4, 4, 4, 7, 8]
    diff = token_difference(ours, theirs)
    assert (diff.head, diff.tail, diff.identical) == (2, 2, False)
    assert diff.middles(ours, theirs) == ([2, 9], [4, 4, 4])


def test_token_difference_never_counts_a_token_in_both_head_and_tail() -> None:
    # One rendering extends the other: the tail must not reach back into the head.
    assert token_difference([1, 2, 3], [1, 2, 3, 3]).middles([1, 2, 3], [1, 2, 3, 3]) == ([], [3])
    diff = token_difference([1, 2, 2, 3], [1, 2, 3])
    assert (diff.head, diff.tail) == (2, 1)
    assert diff.middles([1, 2, 2, 3], [1, 2, 3]) == ([2], [])


def test_slime_src_must_be_a_slime_checkout(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="THUDM/slime"):
        check_slime_src(tmp_path)
    (tmp_path / "slime" / "agent" / "adapters").mkdir(parents=True)
    (tmp_path / "slime" / "agent" / "adapters" / "anthropic.py").write_text("")
    assert check_slime_src(tmp_path) == tmp_path.resolve()


def test_floor_sends_a_generate_body_of_n_ids_and_answers_a_parsable_stream() -> None:
    """The floor's wire is real: SGLang-shaped ids, and an answer our bench client
    reads back as a text block and the tool call the engine wrote."""
    body = json.loads(generate_body(1234))
    assert len(body["input_ids"]) == 1234 and body["return_logprob"] is True
    assert prompt_tokens(3_100) == 2_900 and 97_000 < prompt_tokens(550_000) < 101_000
    text, call = tool_call(tool_call_reply(fixture_tokenizer(), 7, 3))
    assert text == "I will read the next file to find the failing test."
    assert call is not None and call["name"] == "Read"
    _, content, usage = wire.parse_sse(sse_answer(text, call, 1234, 50))
    assert [b["type"] for b in content] == ["text", "tool_use"]
    assert content[0]["text"] == text and content[1]["input"] == call["arguments"]
    assert usage == {"input_tokens": 1234, "output_tokens": 50}
    assert tool_call("no call here") == ("no call here", None)
