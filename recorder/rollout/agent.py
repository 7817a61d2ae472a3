"""The agent: a CLI coding agent (Claude Code by default) run headless in the sandbox."""

from __future__ import annotations

import msgspec

CLAUDE_CODE_PACKAGE = "@anthropic-ai/claude-code"
CLAUDE_CODE_VERSION = "2.1.197"


class AgentSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How to run the agent. `command` is a shell template: `{agent}` is the CLI's path,
    `{prompt_file}` the file holding the problem statement, `{max_turns}` the turn budget."""

    command: str = (
        "{agent} -p --output-format stream-json --verbose "
        "--dangerously-skip-permissions --max-turns {max_turns} < {prompt_file}"
    )
    binary: str | None = None  # the CLI inside the sandbox; None: on PATH, else installed
    package: str = CLAUDE_CODE_PACKAGE
    version: str = CLAUDE_CODE_VERSION
    install: bool = True  # npm-install `package@version` when the CLI is missing
    env: dict[str, str] = {}
