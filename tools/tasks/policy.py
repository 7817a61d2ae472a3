"""A scripted "model" for the shipped tasks: the tool calls of a correct (or a wrong) fix.

Used as the scripted engine's `default_reply` (tests, the rollout quickstart
and tools/bench_rollout.py). For a prompt that holds a task's problem
statement it answers with one Bash tool call that edits the file; once the
prompt holds that call (the next turn), it answers with a short final text.
The template is chatml-tools (`<tool_call>{json}</tool_call>`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from recorder.model.tokenizer import Tokenizer
from tools.test_engine.core import GenRequest
from tools.test_engine.scripted import Reply

MARKER = "TR-FIX-APPLIED"

# instance_id -> (the key phrase of its problem statement, correct fix, wrong fix)
FIXES: dict[str, tuple[str, str, str]] = {
    "calc-add": (
        "returns the difference of its arguments instead of their sum",
        "sed -i '0,/return a - b/s//return a + b/' calc.py",
        "sed -i '0,/return a - b/s//return a * b/' calc.py",
    ),
    "greet-punctuation": (
        'must return "Hello, Ada!"',
        """sed -i 's/return "Hello " + name/return "Hello, " + name + "!"/' greet.py""",
        """sed -i 's/return "Hello " + name/return "Hello, " + name/' greet.py""",
    ),
    "wordcount-trailing-newline": (
        "counts one line too many",
        "sed -i 's/len(text.split(\"\\\\n\"))/len(text.splitlines())/' wc.py",
        "printf '\\n# looked at it\\n' >> wc.py",
    ),
}


def tool_call(command: str) -> str:
    call = json.dumps({"name": "Bash", "arguments": {"command": command, "description": "fix"}})
    return f"I will fix the bug.\n<tool_call>\n{call}\n</tool_call>"


def task_policy(
    tokenizer: Tokenizer, *, wrong: bool = False, token_delay_s: float | None = None
) -> Callable[[GenRequest], Reply]:
    """A `default_reply` for ScriptedEngine that solves (or, `wrong`, botches) each task."""

    def reply(req: GenRequest) -> Reply:
        prompt = tokenizer.decode(req.input_ids)
        if MARKER in prompt:
            return Reply(
                text="I fixed the bug; the tests should pass now.", token_delay_s=token_delay_s
            )
        for phrase, good, bad in FIXES.values():
            if phrase in prompt:
                cmd = f"{bad if wrong else good} && echo {MARKER}"
                return Reply(text=tool_call(cmd), token_delay_s=token_delay_s)
        return Reply(text="I do not know this task.", token_delay_s=token_delay_s)

    return reply
