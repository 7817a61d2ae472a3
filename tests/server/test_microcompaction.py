"""Claude Code's micro-compaction, many rounds, through the real server and reducer.

Claude Code (2.1.197's binary holds the string and its keep-recent routine) replaces the
content of old tool results with `[Old tool result content cleared]` once enough tokens
can be saved. Each round changes earlier history, so the conversation forks and the branch
it left becomes a `wipe` segment of its own: the tokens the model saw there are not the
ones the next request carries. Every answer was acted on (a later request answers its tool
call), so every engine token belongs to a segment; the default segment cap (the first 7
segments plus the final one) then leaves the middle ones out, and says so.
"""

from __future__ import annotations

import copy
from typing import Any

from replay.load import load_session
from replay.reducer import reduce_session
from replay.rules import Rules
from tests.server.conftest import Harness, tool_call_text
from tests.server.test_e2e import ask, echo, tool_result

CLEARED = "[Old tool result content cleared]"


def clear_old_results(history: list[dict[str, Any]], keep: int) -> list[dict[str, Any]]:
    """The history with every tool result but the last `keep` cleared, as Claude Code sends it."""
    cleared = copy.deepcopy(history)
    results = [
        block
        for message in cleared
        if message["role"] == "user" and isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_result"
    ]
    for block in results[: max(0, len(results) - keep)]:
        block["content"] = CLEARED
    return cleared


async def test_eleven_rounds_put_every_acted_on_token_in_a_segment(harness: Harness) -> None:
    steps = 24
    sid = await harness.open_session(instance_id="microcompaction")
    client = harness.client(sid)
    harness.engine.push(
        *[tool_call_text("Bash", {"command": f"echo step{i}"}, preface=f"Step {i}.\n") for i in range(steps)],
        "All steps done.",
    )  # fmt: skip
    history: list[dict[str, Any]] = [{"role": "user", "content": "Do the task in steps."}]
    for i in range(steps + 1):
        # A round every other request from the 4th on (11 in all), keeping the last result.
        sent = clear_old_results(history, keep=1) if i >= 3 and i % 2 else history
        message = await ask(client, sent, stream=False)
        if i == steps:
            break
        history = [*sent, echo(message)]
        history.append(tool_result(message.content[-1].id, f"output of step {i}: " + "lorem " * 20))
    status, closed = await harness.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
    assert status == 200, closed

    log = await load_session(harness.store, sid)
    uncapped = reduce_session(log.events, log.arrays, Rules(max_segments=None))
    accounting = uncapped.token_accounting
    assert accounting["trained"] == accounting["engine output"] > 0, accounting
    assert [s.kind for s in uncapped.segments] == ["wipe"] * 11 + ["final"]  # one per round
    # The default cap leaves the middle segments out, and the accounting names them.
    capped = closed["token_accounting"]
    left_out = {k: n for k, n in capped.items() if "left out: over max_segments=8" in k}
    assert left_out and capped["trained"] + sum(left_out.values()) == capped["engine output"]
