"""One command that records a complete agent session and replays it.

    python -m tools.quickstart [--db PATH] [--engine scripted|tiny] [--keep]

It starts a test engine (SGLang's `/generate` protocol; `scripted` replies
from a fixed script, `tiny` samples SmolLM2-135M on the CPU) and
`recorder serve` as real subprocesses on free loopback ports, opens a session
through the admin API, and drives a small coding agent with the official
`anthropic` SDK pointed at the recorder, the way Claude Code would be:
tool-use turns on the main line, an `Agent` dispatch that runs a subagent
conversation, an auto-compaction (a summary request, then a new prefix that
starts from the summary), and a final answer. Tools run locally in a scratch
directory (a Bash tool limited to read-only commands, and a Write tool).
It then closes the session with a reward, prints the samples the server
built, stops both processes with SIGTERM and runs `replay stats`, `replay
show` and `replay reclassify` on the log, checking that the offline samples
equal the live ones byte for byte.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import click
import msgspec

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "tests" / "data" / "smollm2-tokenizer"
CHAT_TEMPLATE = REPO_ROOT / "recorder" / "model" / "templates" / "chatml-tools.jinja"
MODEL = "quickstart-model"


class QuickstartError(Exception):
    """A step failed; the message says which and what to look at."""


def say(message: str) -> None:
    click.echo(click.style("quickstart", fg="cyan", bold=True) + " " + message)


# --------------------------------------------------------------------------
# The agent's world: prompts, tool schemas, the scripted model's replies
# --------------------------------------------------------------------------

MAIN_SYSTEM = (
    "You are a careful coding agent working in a small Python repository. "
    "Use the tools to inspect files before changing them, delegate side "
    "investigations to a subagent with the Agent tool, and finish with a short "
    "report of what you changed."
)
SUBAGENT_SYSTEM = (
    "You are a read-only research subagent. Answer the task you are given by "
    "inspecting files with the Bash tool, then reply with a concise report."
)
TASK = (
    "Add a script hello.py to this repository that prints a greeting using "
    "greet() from greet.py, and tell me what the repository contains."
)
FOLLOW_UP = "Now make hello.py greet the name given as its first command-line argument."
SUMMARY_REQUEST = (
    "Your task is to create a detailed summary of the conversation so far, paying "
    "close attention to the user's explicit requests and your previous actions. "
    "Reply with the summary only."
)
CONTINUATION = (
    "This session is being continued from a previous conversation that ran out of "
    "context. The conversation is summarized below:\n{summary}"
)

TOOLS: list[dict[str, Any]] = [
    {
        "name": "Bash",
        "description": "Run a read-only shell command (ls, cat, head, tail, wc, grep, "
        "pwd, echo) in the repository and return its output.",
        "input_schema": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command to run"},
                "description": {"type": "string", "description": "What it does, briefly"},
            },
            "required": ["command"],
        },
    },
    {
        "name": "Write",
        "description": "Write a file in the repository, replacing it if it exists.",
        "input_schema": {
            "type": "object",
            "properties": {
                "file_path": {"type": "string", "description": "Path relative to the repo"},
                "content": {"type": "string", "description": "The whole new file content"},
            },
            "required": ["file_path", "content"],
        },
    },
    {
        "name": "Agent",
        "description": "Launch a subagent to research a question on its own and return its report.",
        "input_schema": {
            "type": "object",
            "properties": {
                "description": {"type": "string", "description": "A 3-5 word task summary"},
                "prompt": {"type": "string", "description": "The task for the subagent"},
                "subagent_type": {"type": "string"},
            },
            "required": ["description", "prompt"],
        },
    },
]
SUBAGENT_TOOLS = [TOOLS[0]]

WORKSPACE_FILES = {
    "README.md": "# greeter\n\nA tiny greeting library used by the recorder quickstart.\n",
    "greet.py": 'def greet(name: str) -> str:\n    return f"Hello, {name}!"\n',
    "notes.txt": "Conventions: scripts live at the top level and import greet() from "
    "greet.py.\nEvery greeting ends with an exclamation mark.\n",
}

HELLO_V1 = 'from greet import greet\n\nprint(greet("world"))\n'
HELLO_V2 = (
    "import sys\n\nfrom greet import greet\n\n"
    'name = sys.argv[1] if len(sys.argv) > 1 else "world"\nprint(greet(name))\n'
)
SUBAGENT_PROMPT = (
    "Read notes.txt and README.md and report the repository's conventions in two sentences."
)
SUMMARY = (
    "The user asked for a script hello.py that prints a greeting with greet() from "
    "greet.py. I listed the repository (README.md, greet.py, notes.txt), read greet.py, "
    "had a subagent report the conventions (top-level scripts, import greet(), greetings "
    "end with '!'), wrote hello.py and checked its content. The task is complete."
)


def tool_call(name: str, arguments: dict[str, Any], preface: str = "") -> str:
    """A tool call as our chat template's models write it (hermes / qwen25 style)."""
    body = json.dumps({"name": name, "arguments": arguments})
    return f"{preface}<tool_call>\n{body}\n</tool_call>"


def scripted_replies() -> list[str]:
    """What the scripted model says, in request order (the driver is sequential)."""
    return [
        # main line: explore
        tool_call(
            "Bash",
            {"command": "ls", "description": "List the repository"},
            "I'll start by looking at what the repository contains.\n",
        ),
        "<think>\nThere is a README, greet.py and notes.txt. I should read greet.py before "
        "writing the script.\n</think>\n\n" + tool_call("Bash", {"command": "cat greet.py"}),
        tool_call(
            "Agent",
            {
                "description": "Report repo conventions",
                "prompt": SUBAGENT_PROMPT,
                "subagent_type": "general-purpose",
            },
            "I'll have a subagent check the project's conventions.\n",
        ),
        # subagent
        tool_call("Bash", {"command": "cat notes.txt README.md"}),
        "Scripts live at the top level and import greet() from greet.py. Every greeting "
        "ends with an exclamation mark.",
        # main line: write and check
        tool_call("Write", {"file_path": "hello.py", "content": HELLO_V1}),
        tool_call("Bash", {"command": "cat hello.py"}),
        "Done. The repository holds README.md, greet.py (the greet() function) and "
        'notes.txt (conventions). I added hello.py, which prints greet("world").',
        # compaction: the summary
        SUMMARY,
        # after compaction: a new prefix
        "<think>\nThe summary says hello.py prints a fixed name; I need sys.argv.\n</think>"
        "\n\n" + tool_call("Write", {"file_path": "hello.py", "content": HELLO_V2}),
        tool_call("Bash", {"command": "cat hello.py"}),
        "hello.py now greets the name given as its first argument and falls back to "
        '"world" when there is none.',
    ]


# --------------------------------------------------------------------------
# Local tools
# --------------------------------------------------------------------------

READ_ONLY_COMMANDS = frozenset({"ls", "cat", "head", "tail", "wc", "grep", "pwd", "echo"})
MAX_TOOL_OUTPUT = 4000


@dataclass
class ToolOutcome:
    text: str
    is_error: bool = False


def run_bash(workspace: Path, arguments: dict[str, Any]) -> ToolOutcome:
    """Run one read-only command (no shell) in the workspace."""
    command = arguments.get("command")
    if not isinstance(command, str) or not command.strip():
        return ToolOutcome("Bash: `command` must be a non-empty string", True)
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        return ToolOutcome(f"Bash: cannot parse the command: {exc}", True)
    if argv[0] not in READ_ONLY_COMMANDS:
        allowed = ", ".join(sorted(READ_ONLY_COMMANDS))
        return ToolOutcome(f"Bash: only read-only commands run in this demo ({allowed})", True)
    try:
        done = subprocess.run(
            argv, cwd=workspace, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ToolOutcome(f"Bash: {exc}", True)
    output = (done.stdout + done.stderr)[:MAX_TOOL_OUTPUT]
    return ToolOutcome(output or "(no output)", done.returncode != 0)


def run_write(workspace: Path, arguments: dict[str, Any]) -> ToolOutcome:
    """Write a file inside the workspace (never outside it)."""
    path, content = arguments.get("file_path"), arguments.get("content")
    if not isinstance(path, str) or not isinstance(content, str):
        return ToolOutcome("Write: `file_path` and `content` must be strings", True)
    target = (workspace / path).resolve()
    if not target.is_relative_to(workspace.resolve()):
        return ToolOutcome(f"Write: {path} is outside the repository", True)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content)
    return ToolOutcome(f"Wrote {len(content.encode())} bytes to {path}")


# --------------------------------------------------------------------------
# The agent loop (official anthropic SDK)
# --------------------------------------------------------------------------


def as_param(block: Any) -> dict[str, Any]:
    """A response content block as the client sends it back in the history."""
    if block.type == "text":
        return {"type": "text", "text": block.text}
    if block.type == "thinking":
        return {"type": "thinking", "thinking": block.thinking, "signature": block.signature}
    if block.type == "tool_use":
        return {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
    raise QuickstartError(f"unexpected content block type {block.type!r} in a response")


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text").strip()


def brief(text: str, width: int = 70) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


@dataclass
class Agent:
    """A minimal Claude-Code-like loop: ask, run the tool calls, send results back."""

    client: Any
    workspace: Path
    max_tokens: int
    max_turns: int = 8
    turns: int = 0
    dispatches: int = 0
    log: Callable[[str], None] = say

    def ask(
        self,
        label: str,
        system: str,
        tools: list[dict[str, Any]],
        messages: list[dict[str, Any]],
        *,
        stream: bool,
    ) -> Any:
        turn = self.turns  # numbered from 0, like the server's log and `replay show`
        self.turns += 1
        kwargs = {
            "model": MODEL,
            "max_tokens": self.max_tokens,
            "system": system,
            "tools": tools,
            "messages": messages,
        }
        if stream:
            with self.client.messages.stream(**kwargs) as events:
                reply = events.get_final_message()
        else:
            reply = self.client.messages.create(**kwargs)
        calls = [
            f"{b.name}({brief(json.dumps(b.input), 40)})"
            for b in reply.content
            if b.type == "tool_use"
        ]
        what = ", ".join(calls) if calls else repr(brief(text_of(reply), 60))
        mode = "stream" if stream else "json  "
        self.log(f"  {label:<9} turn {turn:>2} [{mode}] {reply.stop_reason:<10} {what}")
        return reply

    def run(
        self,
        label: str,
        system: str,
        tools: list[dict[str, Any]],
        messages: list[dict[str, Any]],
        *,
        stream: bool,
    ) -> str:
        """Loop until the model answers without tool calls; returns its final text."""
        for _ in range(self.max_turns):
            reply = self.ask(label, system, tools, messages, stream=stream)
            messages.append({"role": "assistant", "content": [as_param(b) for b in reply.content]})
            uses = [b for b in reply.content if b.type == "tool_use"]
            if not uses:
                return text_of(reply)
            results = [self.execute(b) for b in uses]
            messages.append({"role": "user", "content": results})
        self.log(f"  {label}: stopped after {self.max_turns} turns without a final answer")
        return text_of(reply)

    def execute(self, use: Any) -> dict[str, Any]:
        if use.name == "Agent":
            outcome = self.subagent(use.input)
        elif use.name == "Bash":
            outcome = run_bash(self.workspace, use.input)
        elif use.name == "Write":
            outcome = run_write(self.workspace, use.input)
        else:
            outcome = ToolOutcome(f"unknown tool {use.name!r}", True)
        result: dict[str, Any] = {
            "type": "tool_result",
            "tool_use_id": use.id,
            "content": outcome.text,
        }
        if outcome.is_error:
            result["is_error"] = True
        return result

    def subagent(self, arguments: dict[str, Any]) -> ToolOutcome:
        """A separate conversation (own system prompt and tools); its report is the result."""
        prompt = arguments.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            return ToolOutcome("Agent: `prompt` must be a non-empty string", True)
        self.dispatches += 1
        self.log(f"  subagent dispatched: {brief(prompt, 60)!r}")
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        report = self.run("subagent", SUBAGENT_SYSTEM, SUBAGENT_TOOLS, messages, stream=False)
        self.log("  subagent returned its report to the main line")
        return ToolOutcome(report or "(the subagent returned no text)")


def drive_session(agent: Agent) -> None:
    """Task, compaction, follow-up: the shape of a long Claude Code session."""
    say("main line: the task")
    messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    agent.run("main", MAIN_SYSTEM, TOOLS, messages, stream=True)
    if agent.dispatches == 0:
        say("  (the model dispatched no subagent: expected with a tiny real model)")

    say("auto-compaction: the demo's context window is tiny, so the client asks for a summary")
    messages.append({"role": "user", "content": SUMMARY_REQUEST})
    summary = text_of(agent.ask("compact", MAIN_SYSTEM, TOOLS, messages, stream=True))

    say("main line continues from a new prefix that starts with the summary")
    fresh: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": CONTINUATION.format(summary=summary or "(empty)")},
                {"type": "text", "text": FOLLOW_UP},
            ],
        }
    ]
    final = agent.run("main", MAIN_SYSTEM, TOOLS, fresh, stream=True)
    say(f"final answer: {brief(final, 90)!r}")


# --------------------------------------------------------------------------
# Child processes
# --------------------------------------------------------------------------


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path


@dataclass
class Children:
    """Our subprocesses; whatever is still running at exit gets SIGTERM, then SIGKILL."""

    running: list[Child] = field(default_factory=list)

    def start(self, name: str, args: Sequence[str], log_path: Path, env: dict[str, str]) -> Child:
        log_file = log_path.open("wb")
        try:
            proc = subprocess.Popen(
                [sys.executable, *args],
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches us; we stop the children in order
            )
        finally:
            log_file.close()
        child = Child(name, proc, log_path)
        self.running.append(child)
        return child

    def stop(self, child: Child, timeout_s: float = 30) -> int:
        """SIGTERM and wait (SIGKILL after `timeout_s`); returns the exit code."""
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
            try:
                child.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        with contextlib.suppress(ValueError):
            self.running.remove(child)
        return child.proc.returncode

    def stop_all(self) -> None:
        for child in list(reversed(self.running)):
            self.stop(child, timeout_s=10)


def log_tail(child: Child, lines: int = 15) -> str:
    try:
        text = child.log_path.read_text(errors="replace")
    except OSError:
        return ""
    tail = "\n".join(text.splitlines()[-lines:])
    return f"--- last lines of {child.name} log ({child.log_path}) ---\n{tail}"


def free_port() -> int:
    from tools.test_engine.launch import free_port as pick

    return pick()


def wait_healthy(child: Child, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise QuickstartError(
                f"{child.name} exited with code {child.proc.returncode} while starting\n"
                + log_tail(child)
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.2)
    raise QuickstartError(
        f"{child.name} did not become healthy in {timeout_s:.0f}s\n" + log_tail(child)
    )


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


# --------------------------------------------------------------------------
# Admin API
# --------------------------------------------------------------------------


def admin_call(url: str, token: str, path: str, body: dict[str, Any]) -> bytes:
    """POST a JSON body with the admin token; the raw JSON answer."""
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        raise QuickstartError(f"POST {path} answered HTTP {exc.code}: {detail}") from None
    except OSError as exc:
        raise QuickstartError(f"POST {path} failed: {exc}") from None


# --------------------------------------------------------------------------
# Samples: the live close answer vs the offline projection
# --------------------------------------------------------------------------


def print_samples(result: Any) -> None:
    kinds = [s.metadata.get("segment_kind", "placeholder") for s in result.samples]
    say(
        f"session closed: status {result.status}, reward {result.reward}, "
        f"{result.turns_total} turns, {len(result.samples)} samples "
        f"(segment kinds, chronological: {', '.join(kinds) or 'none'})"
    )
    for i, sample in enumerate(result.samples):
        say(
            f"  sample {i}: {kinds[i]:<9} {sample.status:<9} prompt {sample.prompt_len:>5} + "
            f"response {sample.response_len:>5} tokens, {sum(sample.loss_mask):>4} trainable, "
            f"reward {sample.reward:.3f}"
        )
    for line in result.diagnostics:
        say(f"  · {line}")


async def projected_digest(db: str, session_id: str) -> tuple[str, str]:
    """(projection name, digest) of the session in the newest `replay reclassify` projection."""
    from recorder.log.store import open_store
    from replay.reclassify import SAMPLES_PREFIX

    store = await open_store(db)
    try:
        names = [n for n in await store.projection_names() if n.startswith(SAMPLES_PREFIX)]
        if not names:
            raise QuickstartError("replay reclassify wrote no samples projection")
        rows = await store.load_projection(names[-1])
    finally:
        await store.close()
    if session_id not in rows:
        raise QuickstartError(f"projection {names[-1]} has no row for session {session_id}")
    return names[-1], rows[session_id][1]


def run_replay(args: Sequence[str]) -> None:
    command = ["replay", *args]
    say("$ " + shlex.join(command))
    done = subprocess.run(
        [sys.executable, "-m", "replay.cli", *args], cwd=REPO_ROOT, env=child_env(), check=False
    )
    if done.returncode != 0:
        raise QuickstartError(f"`{shlex.join(command)}` exited with code {done.returncode}")


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


@dataclass
class Options:
    db: Path
    engine: str
    keep: bool
    save_samples: Path | None


def prepare_db(db: Path) -> None:
    """Start from an empty log: remove the SQLite file and its WAL companions."""
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
            path.unlink(missing_ok=True)
    except OSError as exc:
        raise QuickstartError(f"cannot prepare the event log at {db}: {exc}") from None


@contextlib.contextmanager
def scratch_dir(keep: bool) -> Iterator[Path]:
    """A temporary directory, kept when asked to or when the run fails (for its logs)."""
    path = Path(tempfile.mkdtemp(prefix="recorder-quickstart-"))
    try:
        yield path
    except BaseException:
        say(f"kept the scratch directory (workspace, engine and server logs): {path}")
        raise
    if keep:
        say(f"kept the scratch directory (workspace, engine and server logs): {path}")
    else:
        shutil.rmtree(path, ignore_errors=True)


def start_engine(children: Children, kind: str, scratch: Path) -> tuple[Child, str]:
    port = free_port()
    args = ["-m", "tools.test_engine", "--backend", kind, "--port", str(port)]
    if kind == "scripted":
        script = scratch / "engine-script.json"
        script.write_text(json.dumps({"replies": scripted_replies()}, indent=2))
        args += ["--script", str(script), "--tokenizer", str(TOKENIZER_DIR)]
    else:
        args += ["--seed", "0"]  # sampled, but the same run every time
    url = f"http://127.0.0.1:{port}"
    say(
        f"starting the {kind} test engine on {url}"
        + (" (loads SmolLM2-135M on the CPU: may take a minute)" if kind == "tiny" else "")
    )
    child = children.start("engine", args, scratch / "engine.log", child_env())
    wait_healthy(child, url, timeout_s=300 if kind == "tiny" else 60)
    return child, url


def start_server(
    children: Children, engine_url: str, db: Path, admin_token: str, scratch: Path
) -> tuple[Child, str]:
    port = free_port()
    args = [
        "-m", "recorder.cli", "serve",
        "--db", str(db),
        "--engine", engine_url,
        "--tokenizer", str(TOKENIZER_DIR),
        "--chat-template", str(CHAT_TEMPLATE),
        "--tool-parser", "qwen25",
        "--reasoning-parser", "qwen3",
        "--port", str(port),
        "--model-name", MODEL,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    say(f"starting `recorder serve` on {url} (event log: {db})")
    # The admin token travels in the environment, not on the command line.
    child = children.start(
        "recorder", args, scratch / "recorder.log", child_env(TR_ADMIN_TOKEN=admin_token)
    )
    return child, url


def record_session(opts: Options, children: Children, scratch: Path) -> tuple[str, Any]:
    """Engine + server up, one agent session recorded and closed; both stopped."""
    from replay.samples import SessionResult

    engine, engine_url = start_engine(children, opts.engine, scratch)
    admin_token = secrets.token_hex(16)
    server, server_url = start_server(children, engine_url, opts.db, admin_token, scratch)
    import anthropic  # takes a few seconds: let the server boot meanwhile

    wait_healthy(server, server_url, timeout_s=60)

    opened = admin_call(
        server_url,
        admin_token,
        "/sessions",
        {"instance_id": "quickstart-greeter", "sample_index": 0, "group_index": 0},
    )
    session_id = str(json.loads(opened)["session_id"])
    say(f"opened session {session_id} (POST /sessions with the admin token)")
    say(f"the agent uses ANTHROPIC_BASE_URL={server_url} ANTHROPIC_AUTH_TOKEN={session_id}")

    workspace = scratch / "repo"
    workspace.mkdir()
    for name, content in WORKSPACE_FILES.items():
        (workspace / name).write_text(content)

    # What Claude Code gets as ANTHROPIC_BASE_URL / ANTHROPIC_AUTH_TOKEN. An explicit
    # auth_token also keeps the SDK from sending a real ANTHROPIC_API_KEY from the env.
    client = anthropic.Anthropic(
        base_url=server_url, auth_token=session_id, max_retries=0, timeout=120
    )
    agent = Agent(client, workspace, max_tokens=48 if opts.engine == "tiny" else 512)
    try:
        drive_session(agent)
    except anthropic.APIError as exc:
        raise QuickstartError(f"the agent's request failed: {exc}\n{log_tail(server)}") from None

    say("closing the session with reward 1.0 (POST /sessions/{id}/close)")
    answer = admin_call(server_url, admin_token, f"/sessions/{session_id}/close", {"reward": 1.0})
    if opts.save_samples is not None:
        opts.save_samples.write_bytes(answer)
    result = msgspec.json.decode(answer, type=SessionResult)
    print_samples(result)

    say("stopping the recorder and the engine (SIGTERM)")
    code = children.stop(server)
    if code != 0:
        raise QuickstartError(
            f"recorder serve exited with code {code} on SIGTERM\n" + log_tail(server)
        )
    children.stop(engine)
    return session_id, result


def replay_the_log(db: Path, session_id: str, live: Any) -> None:
    from replay.samples import result_digest

    run_replay(["stats", "--db", str(db)])
    run_replay(["show", "--db", str(db), "--session", session_id])
    run_replay(["reclassify", "--db", str(db)])
    name, digest = asyncio.run(projected_digest(str(db), session_id))
    if digest != result_digest(live):
        raise QuickstartError(
            f"offline samples ({name}, digest {digest}) differ from the live close "
            f"(digest {result_digest(live)}): a reducer determinism bug"
        )
    say(f"offline samples in {name} == the live close's samples, byte for byte (digest {digest})")


def run(opts: Options) -> None:
    children = Children()
    atexit.register(children.stop_all)
    try:
        prepare_db(opts.db)
        with scratch_dir(opts.keep) as scratch:
            started = time.monotonic()
            session_id, live = record_session(opts, children, scratch)
            replay_the_log(opts.db, session_id, live)
            say(f"done in {time.monotonic() - started:.1f}s; the event log is {opts.db}")
    finally:
        children.stop_all()


def _raise_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@click.command()
@click.option(
    "--db",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("quickstart.db"),
    show_default=True,
    help="SQLite event log to write (overwritten).",
)
@click.option(
    "--engine",
    type=click.Choice(["scripted", "tiny"]),
    default="scripted",
    show_default=True,
    help="scripted: fixed replies, instant; tiny: SmolLM2-135M on the CPU.",
)
@click.option(
    "--keep",
    is_flag=True,
    help="Keep the scratch directory (agent workspace, engine and server logs).",
)
@click.option(
    "--save-samples",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the live close answer (samples JSON) to this file.",
)
def main(db: Path, engine: str, keep: bool, save_samples: Path | None) -> None:
    """Record one multi-turn agent session through the recorder, then replay it."""
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    opts = Options(
        db=db.resolve(),
        engine=engine,
        keep=keep,
        save_samples=save_samples.resolve() if save_samples else None,
    )
    try:
        run(opts)
    except QuickstartError as exc:
        fail(str(exc))
    except Exception as exc:  # a bug somewhere: show where, then fail like any other step
        traceback.print_exc()
        fail(f"unexpected {type(exc).__name__}: {exc}")


def fail(message: str) -> NoReturn:
    click.echo(click.style("quickstart failed: ", fg="red", bold=True) + message, err=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
