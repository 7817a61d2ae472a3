"""The agent: a CLI coding agent (Claude Code by default) run headless in the sandbox.

The agent is pointed at the recorder (`ANTHROPIC_BASE_URL` = the recorder as
the *sandbox* reaches it, `ANTHROPIC_AUTH_TOKEN` = the session id), with
nonessential traffic, telemetry and the auto-updater off, `IS_SANDBOX=1` (so
`--dangerously-skip-permissions` runs as root) and a `HOME` and Claude config
dir inside the sandbox (parallel agents never share a config file or a
transcript directory). Its environment is explicit (`agent_env`): the
sandbox's own (never the driver's, see sandbox/environment.py), these
variables, then `AgentSpec.env` (`--agent-env`). Provider switches a sandbox
image might set (Bedrock, Vertex) are turned off: the agent talks to the
recorder only. The CLI is found in the sandbox or npm-installed there,
pinned. `command` is a template, so another CLI agent can be dropped in.
"""

from __future__ import annotations

import collections
import json
import os
import posixpath
import shlex
from pathlib import Path
from typing import Any

import msgspec

from recorder.rollout.errors import InfraError
from recorder.rollout.sandbox import CommandTimeout, Sandbox
from recorder.rollout.workspace import tail

CLAUDE_CODE_PACKAGE = "@anthropic-ai/claude-code"
CLAUDE_CODE_VERSION = "2.1.197"
# The repository's own pinned install (tools/setup.sh): the local sandbox's default.
REPO_CLI = Path(__file__).resolve().parents[2] / "tools" / "claude-code" / "node_modules" / ".bin"
NO_TURN_LIMIT = 100_000
# Characters of the agent's output kept for a run that times out (its last result record).
_TAIL_KEPT = 1024 * 1024


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
    # The agent's own retries of a failed API call (Claude Code retries a 529 ten
    # times with backoff by default: minutes before a dead engine is noticed).
    max_retries: int = 2
    # Claude Code compacts once its context reaches this share of the recorder's
    # context length (`compaction_env`); None leaves the CLI's own settings alone.
    compact_at: float | None = 0.8


class AgentRun(msgspec.Struct, frozen=True, kw_only=True):
    """How the agent ended: `stop` is "exited" or "wall_budget" (killed at the deadline)."""

    stop: str
    exit_code: int | None
    duration_s: float
    result: dict[str, Any] = {}  # the CLI's final `result` record (stream-json), if any
    output_tail: str = ""

    @property
    def api_error(self) -> str | None:
        """The API error the agent ended on, if it ended on one."""
        text = str(self.result.get("result", ""))
        if self.result.get("is_error") and "API Error" in text:
            return text
        return None


def local_binary() -> str | None:
    """The CLI for the local sandbox: $TR_CLAUDE_BIN, else the repository's tools/claude-code."""
    found = os.environ.get("TR_CLAUDE_BIN")
    if found:
        return found
    cli = REPO_CLI / "claude"
    return str(cli) if cli.exists() else None


async def ensure_agent(sb: Sandbox, spec: AgentSpec) -> str:
    """The agent CLI's path in the sandbox, installing `package@version` when it is missing
    ("" when the command does not name `{agent}`: another agent, nothing to install)."""
    if "{agent}" not in spec.command:
        return ""
    name = posixpath.basename(spec.binary or "claude")
    probe = f"test -x {shlex.quote(spec.binary)}" if spec.binary else f"command -v {name}"
    found = await sb.exec(probe, timeout_s=60)
    if found.exit_code == 0:
        return spec.binary or found.stdout.strip()
    if not spec.install:
        raise InfraError(
            "agent_install", f"the agent CLI {spec.binary or name} is not in the sandbox"
        )
    prefix = posixpath.join(sb.workdir, ".agent")
    installed = await sb.exec(
        f"npm install --silent --no-audit --no-fund --prefix {shlex.quote(prefix)} "
        f"{shlex.quote(f'{spec.package}@{spec.version}')}",
        timeout_s=900,
    )
    binary = posixpath.join(prefix, "node_modules", ".bin", name)
    if installed.exit_code != 0:
        said = (installed.stderr + installed.stdout).strip() or await _npm_log_tail(sb)
        raise InfraError(
            "agent_install",
            f"npm install {spec.package}@{spec.version} exited {installed.exit_code}: "
            f"{tail(said, 800) or '(no output, no npm log)'}; "
            "use a sandbox image with node/npm, or set AgentSpec.binary",
        )
    return binary


async def _npm_log_tail(sb: Sandbox) -> str:
    """The error lines of npm's newest debug log (else its end): `--silent` prints nothing
    when it fails."""
    found = await sb.exec(
        'log=$(ls -t "${npm_config_cache:-$HOME/.npm}"/_logs/*.log 2>/dev/null | head -n 1); '
        '[ -n "$log" ] || exit 0; errors=$(grep -E "^[0-9]+ error " "$log" | head -n 8); '
        'if [ -n "$errors" ]; then printf "%s\\n" "$errors"; else tail -n 20 "$log"; fi',
        timeout_s=30,
    )
    return found.stdout.strip()


def agent_env(sb: Sandbox, spec: AgentSpec, *, base_url: str, session_id: str) -> dict[str, str]:
    """What the agent's command gets on top of the sandbox's environment (nothing from
    the driver's own: a host `CLAUDE_CONFIG_DIR` or `CLAUDE_CODE_USE_BEDROCK` has no say)."""
    home = posixpath.join(sb.workdir, "home")
    return {
        "HOME": home,
        "CLAUDE_CONFIG_DIR": posixpath.join(home, ".claude"),
        "CLAUDE_CODE_USE_BEDROCK": "0",
        "CLAUDE_CODE_USE_VERTEX": "0",
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": session_id,
        # Either header carries the session id (a host key must never leak through).
        "ANTHROPIC_API_KEY": session_id,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "IS_SANDBOX": "1",
        "CLAUDE_CODE_MAX_RETRIES": str(spec.max_retries),
        **spec.env,
    }


# Claude Code's auto-compaction, as measured with 2.1.197 and 2.1.330 (README, "Claude Code
# settings"): it compacts once its token count reaches CLAUDE_AUTOCOMPACT_PCT_OVERRIDE percent
# of (window - 20,000), where window is CLAUDE_CODE_AUTO_COMPACT_WINDOW, taken as at least
# 100,000 (30k, 40k, 80k and 100k gave the same threshold). Its token count is the last
# answer's usage (the recorder's own token count) plus its estimate of the newer messages.
_SUMMARY_RESERVE = 20_000
_MIN_WINDOW = 100_000


def compaction_env(context_length: int, compact_at: float) -> dict[str, str]:
    """Environment that makes Claude Code compact before the recorder's context limit.

    The CLI does not know the recorder's context length: it assumes its model's
    window (1M tokens), reaches the limit, gets a 400 `prompt is too long` and
    compacts only then. With these settings it compacts once its context reaches
    `compact_at` of `context_length`; the rest of the window is room for the turn
    that crossed the line and for the summary request and its answer.
    """
    if not 0 < compact_at <= 1:
        raise ValueError(f"compact_at must be in (0, 1], got {compact_at}")
    window = max(_MIN_WINDOW, context_length + _SUMMARY_RESERVE)
    percent = int(100 * compact_at * context_length / (window - _SUMMARY_RESERVE))
    return {
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(window),
        "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": str(max(1, percent)),
    }


def agent_command(spec: AgentSpec, *, binary: str, prompt_file: str, max_turns: int | None) -> str:
    return spec.command.format(
        agent=shlex.quote(binary),
        prompt_file=shlex.quote(prompt_file),
        max_turns=max_turns if max_turns is not None else NO_TURN_LIMIT,
    )


def parse_agent_result(stdout: str) -> dict[str, Any]:
    """The last `{"type": "result", ...}` record of a stream-json transcript ({} if none)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{") and '"result"' in line:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("type") == "result":
                return {k: record.get(k) for k in ("subtype", "is_error", "num_turns", "result")}
    return {}


async def run_agent(
    sb: Sandbox,
    spec: AgentSpec,
    *,
    binary: str,
    repo: str,
    prompt: str,
    env: dict[str, str],
    timeout_s: float,
    max_turns: int | None,
) -> AgentRun:
    """Run the agent to its end, or kill it when `timeout_s` runs out."""
    prompt_file = posixpath.join(sb.workdir, "prompt.txt")
    await sb.write_file(prompt_file, prompt)
    await sb.exec(f"mkdir -p {shlex.quote(env['HOME'])}", timeout_s=30)
    cmd = agent_command(spec, binary=binary, prompt_file=prompt_file, max_turns=max_turns)
    out: collections.deque[str] = collections.deque()  # the output's tail, for a timeout
    kept = [0]

    def keep(text: str) -> None:
        out.append(text)
        kept[0] += len(text)
        while kept[0] > _TAIL_KEPT and len(out) > 1:
            kept[0] -= len(out.popleft())

    handle = await sb.start(cmd, cwd=repo, env=env, on_stdout=keep)
    try:
        result = await handle.wait(max(timeout_s, 0.0))
    except CommandTimeout:
        text = "".join(out)
        return AgentRun(
            stop="wall_budget",
            exit_code=None,
            duration_s=timeout_s,
            result=parse_agent_result(text),
            output_tail=tail(text),
        )
    finally:
        await handle.kill()
    return AgentRun(
        stop="exited",
        exit_code=result.exit_code,
        duration_s=result.duration_s,
        result=parse_agent_result(result.stdout),
        output_tail=tail(result.stdout + result.stderr),
    )
