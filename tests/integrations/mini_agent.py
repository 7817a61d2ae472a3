"""A trivial coding agent for the hook tests: `python mini_agent.py PROMPT_FILE`.

Speaks the Anthropic Messages API to $ANTHROPIC_BASE_URL (the recorder) with
the session id as its key, offers one tool (Bash), runs the model's Bash calls
in the current directory and sends the results back until the model answers
without a tool call. Its last line is a Claude-Code-style stream-json result
record, which the rollout driver reads. Stands in for the Claude Code CLI so
the hooks' end-to-end test needs no real CLI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anthropic

BASH = {
    "name": "Bash",
    "description": "Run a shell command in the repository.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
        "required": ["command"],
    },
}


def run_bash(arguments: dict[str, Any]) -> str:
    done = subprocess.run(
        str(arguments.get("command", "")), shell=True, capture_output=True, text=True, timeout=60
    )
    return (done.stdout + done.stderr)[-4000:] or f"(exit {done.returncode})"


def main(prompt_file: str, max_turns: int = 6) -> None:
    client = anthropic.Anthropic(max_retries=1, timeout=120)
    prompt = Path(prompt_file).read_text()
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    text, turns = "", 0
    while turns < max_turns:
        turns += 1
        reply = client.messages.create(
            model="test-model", max_tokens=256, system="You fix bugs.", tools=[BASH],
            messages=messages,
        )  # fmt: skip
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        text = "".join(b.text for b in reply.content if b.type == "text")
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            break
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": u.id, "content": run_bash(u.input)}
                    for u in uses
                ],
            }
        )
    record = {"type": "result", "subtype": "success", "is_error": False, "num_turns": turns,
              "result": text}  # fmt: skip
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
