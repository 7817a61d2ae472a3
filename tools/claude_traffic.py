"""Record real Claude Code traffic through the recorder, with a scripted engine.

    python -m tools.claude_traffic --out /tmp/captures [--version 2.1.330] [--scenario coding]

Each scenario runs the real CLI (`claude -p`, IS_SANDBOX=1, a throwaway HOME,
ANTHROPIC_BASE_URL = a capturing proxy in front of the recorder server,
ANTHROPIC_AUTH_TOKEN = the session id) against a scripted engine that answers by
what the *latest* turn of the prompt says (`Rule`), so the same script drives
the main line, subagents, compaction and side requests whatever order the CLI
sends them in. Every request the CLI sends is written, as it arrives, to
`<out>/<version>/<scenario>/NNN.json` (method, path, headers without the
token, body, and the recorder's status). tests/data/claude_traffic/ holds a
compact copy (`--fixtures`); tests/server/test_claude_traffic.py runs the
same scenarios live.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import json
import os
import struct
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from recorder.model.tokenizer import Tokenizer
from tools.test_engine.core import GenRequest
from tools.test_engine.scripted import WORDS, Reply

REPO = Path(__file__).resolve().parents[1]
CLAUDE_DIRS = {"2.1.197": "claude-code", "2.1.330": "claude-code-2.1.330"}
FIXTURES = REPO / "tests" / "data" / "claude_traffic"

HELLO_PY = 'def greet() -> str:\n    return "helo world"\n\n\nprint(greet())\n'


def tool_call(name: str, arguments: dict[str, Any], preface: str = "") -> str:
    """Engine text that the qwen25 parser turns into one `tool_use` block."""
    call = json.dumps({"name": name, "arguments": arguments})
    return f"{preface}<tool_call>\n{call}\n</tool_call>"


@dataclass(frozen=True)
class Rule:
    """Answer `reply` when `marker` is in the prompt's latest turn (or its system text)."""

    marker: str
    reply: str
    in_system: bool = False
    token_delay_s: float | None = None  # a slow answer (lets the CLI's side requests come)


def prompt_parts(text: str) -> tuple[str, str]:
    """(system text, latest turn) of a ChatML prompt that ends in a generation prompt.

    The latest turn is everything after the previous assistant turn (the tool
    results or user message the model answers now); on a first request, every
    message after the system block.
    """
    first_user = text.find("<|im_start|>user")
    gen = text.rfind("<|im_start|>assistant")
    prev = text.rfind("<|im_start|>assistant", 0, gen)
    start = text.find("<|im_end|>", prev) if prev >= 0 else first_user
    return text[: max(first_user, 0)], text[start:gen]


def responder(tokenizer: Tokenizer, rules: list[Rule]) -> Callable[[GenRequest], Reply]:
    """The scripted engine's reply function: the first rule whose marker fits, else 'Done.'.

    A reply's `{n}` becomes how many times its rule has answered (1, 2, ...): a
    real model's summaries differ from round to round, and two identical ones
    would make two conversations the same tokens.
    """
    fired = [0] * len(rules)

    def reply(req: GenRequest) -> Reply:
        system, latest = prompt_parts(tokenizer.decode(req.input_ids))
        for i, rule in enumerate(rules):
            if rule.marker in (system if rule.in_system else latest):
                fired[i] += 1
                text = rule.reply.replace("{n}", str(fired[i]))
                return Reply(text=text, token_delay_s=rule.token_delay_s)
        return Reply(text="Done.")

    return reply


def tiny_png() -> bytes:
    """A valid 2x2 RGB PNG (the image the `image` scenario reads)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    raw = b"".join(b"\x00" + b"\xff\x00\x00" * 2 for _ in range(2))
    ihdr = struct.pack(">IIBBBBB", 2, 2, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


@dataclass(frozen=True)
class Scenario:
    """One CLI run (plus follow-up runs with --continue), and the engine's rules for it."""

    name: str
    prompt: str
    rules: Callable[[Path], list[Rule]]
    allowed_tools: str = "Read,Edit,Bash,Agent,ToolSearch,Write"
    follow_ups: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    versions: tuple[str, ...] = ("2.1.197", "2.1.330")
    # The recorder's context length (the engine's is 200k): the CLI assumes 1M for its models.
    context_length: int = 200_000
    args: tuple[str, ...] = ()  # more CLI arguments (e.g. `--tools ""`)


def _coding(wd: Path) -> list[Rule]:
    path = str(wd / "hello.py")
    return [
        Rule("Fix the greeting", tool_call("Read", {"file_path": path}, "I will read it.\n")),
        Rule(
            "helo world",
            tool_call(
                "Edit",
                {"file_path": path, "old_string": "helo world", "new_string": "hello world"},
                "Fixing the typo.\n",
            ),
        ),
        Rule(
            str(wd / "hello.py"),
            tool_call(
                "Bash",
                {"command": "python3 hello.py | tr a-z A-Z", "description": "Run the script"},
            ),
        ),
        Rule("HELLO WORLD", "The greeting is fixed and the script prints HELLO WORLD."),
    ]


def _subagent(background: bool | None) -> Callable[[Path], list[Rule]]:
    def rules(wd: Path) -> list[Rule]:
        dispatch: dict[str, Any] = {
            "description": "Count lines",
            "prompt": "SUBTASK: count the lines of hello.py with wc.",
            "subagent_type": "general-purpose",
        }
        if background is not None:
            dispatch["run_in_background"] = background
        return [
            Rule("SUBRESULT", "The subagent found 5 lines. Done."),
            Rule(
                "SUBTASK",
                tool_call(
                    "Bash",
                    {"command": f"wc -l < {wd / 'hello.py'} | sed s/^/LINES=/"},
                    "Counting.\n",
                ),
            ),
            Rule("LINES=", "SUBRESULT: hello.py has 5 lines."),
            Rule("Use a subagent", tool_call("Agent", dispatch, "Dispatching a subagent.\n")),
            Rule("sync", "Waiting for the subagent to finish."),
        ]

    return rules


def _compact(wd: Path) -> list[Rule]:
    return [
        Rule("summary", "<analysis>ran echo</analysis>\n<summary>The user ran echo.</summary>"),
        Rule("Say the marker", tool_call("Bash", {"command": "echo compact-marker"})),
    ]


def _tool_search(wd: Path) -> list[Rule]:
    return [
        Rule(
            "Find the notebook tool",
            tool_call("ToolSearch", {"query": "select:NotebookEdit", "max_results": 1}),
        ),
        Rule("tool_reference", "NotebookEdit is loaded. Done."),
    ]


NOTEBOOK = {
    "cells": [
        {
            "cell_type": "code",
            "id": "c1",
            "metadata": {},
            "source": ["print('nb-marker broken')"],
            "outputs": [],
            "execution_count": None,
        }
    ],
    "metadata": {},
    "nbformat": 4,
    "nbformat_minor": 5,
}


def _deferred_call(wd: Path) -> list[Rule]:
    """Read a notebook, load the deferred NotebookEdit with ToolSearch, then call it."""
    path = str(wd / "nb.ipynb")
    edit = {"notebook_path": path, "cell_id": "c1", "new_source": "print('nb-fixed')"}
    return [
        Rule("nb-fixed", "The notebook cell is fixed."),
        Rule('"name": "NotebookEdit"', tool_call("NotebookEdit", edit, "Editing the cell.\n")),
        Rule("nb-marker broken", tool_call("ToolSearch", {"query": "select:NotebookEdit", "max_results": 1})),
        Rule("Fix the notebook", tool_call("Read", {"file_path": path})),
    ]  # fmt: skip


def _image(wd: Path) -> list[Rule]:
    return [
        Rule("Describe pixel.png", tool_call("Read", {"file_path": str(wd / "pixel.png")})),
    ]


def _nonessential(wd: Path) -> list[Rule]:
    return [
        Rule("sentence-case title", '{"title": "Echo a marker"}', in_system=True),
        Rule("Say the marker", tool_call("Bash", {"command": "echo side-marker"})),
        Rule("side-marker", "It printed side-marker."),
    ]


def _tool_inputs(wd: Path) -> list[Rule]:
    """Tool calls the way a model may write them (key order, optional keys, an unknown key)."""
    notes = str(wd / "notes.txt")
    return [
        Rule("has been updated", tool_call("Bash", {"command": "echo step-five-ok", "x": 1})),
        Rule("step-five-ok", "All done."),
        Rule("Exercise the tools", tool_call("Write", {"content": "one\ntwo\nthree\nfour\n", "file_path": notes})),
        Rule("2\ttwo", tool_call("Bash", {"timeout": 60000, "command": "echo step-three-ok",
                                           "run_in_background": False, "description": "Echo"})),
        Rule("step-three-ok", tool_call("Edit", {"file_path": notes, "old_string": "four",
                                                 "new_string": "FOUR", "replace_all": True})),
        Rule("notes.txt", tool_call("Read", {"file_path": notes, "offset": 2, "limit": 2})),
    ]  # fmt: skip


def _context_limit(wd: Path) -> list[Rule]:
    return [
        Rule("Your task is to create a detailed summary", "<summary>Read big.txt.</summary>"),
        Rule("Read big.txt", tool_call("Read", {"file_path": str(wd / "big.txt")})),
        Rule("1\talpha", tool_call("Bash", {"command": f"cat {wd / 'big.txt'}"})),
        Rule("zulu-end", "I read it twice."),
    ]


def _partial_compaction(wd: Path) -> list[Rule]:
    """Each follow-up's output (~3.7k tokens) takes the session over the context length: the
    CLI learns the limit from the 400 and compacts the head of the conversation, keeping the
    answers after it verbatim after the summary."""
    big = str(wd / "big.txt")
    return [
        Rule("Your task is to create a detailed summary", "<summary>Head, then tails ({n}).</summary>"),
        Rule("Show the head", tool_call("Bash", {"command": f"echo HEAD-SHOWN; head -c 12000 {big}"})),
        Rule("tail", tool_call("Bash", {"command": f"echo TAIL-SHOWN; tail -c 12000 {big}"}, "Reading it.\n")),
        Rule("HEAD-SHOWN", "Done."),
        Rule("TAIL-SHOWN", "I read the tail."),
    ]  # fmt: skip


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("coding", "Fix the greeting in hello.py and run it.", _coding),
        Scenario(
            "subagent_background",
            "Use a subagent to count the lines of hello.py.",
            _subagent(True),
            versions=("2.1.330",),
        ),
        Scenario(
            "subagent_sync", "Use a subagent to count the lines of hello.py.", _subagent(False)
        ),
        Scenario("compact", "Say the marker with echo.", _compact, follow_ups=("/compact",)),
        Scenario(
            "compact_then_work",  # 2.1.33x: the turn after /compact holds an empty system message
            "Say the marker with echo.",
            _compact,
            follow_ups=("/compact", "Say the marker with echo once more."),
            versions=("2.1.330",),
        ),
        Scenario(
            "tool_search",
            "Find the notebook tool.",
            _tool_search,
            env={"ENABLE_TOOL_SEARCH": "true"},
            versions=("2.1.330",),
        ),
        Scenario(
            "deferred_call",
            "Fix the notebook nb.ipynb in the current directory.",
            _deferred_call,
            env={"ENABLE_TOOL_SEARCH": "true"},
            versions=("2.1.330",),
        ),
        Scenario("image", "Describe pixel.png in the current directory.", _image),
        Scenario(
            "nonessential",
            "Say the marker with echo.",
            _nonessential,
            env={"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": ""},
        ),
        Scenario(
            "no_tools",  # a main line that offers no tools, beside the title request
            "Say the marker with echo.",
            lambda wd: [
                Rule("sentence-case title", '{"title": "Greeting"}', in_system=True),
                Rule("Say the marker", "I cannot run echo here: no tools.", token_delay_s=0.2),
            ],
            env={"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": ""},
            args=("--tools", ""),
        ),
        Scenario("tool_inputs", "Exercise the tools.", _tool_inputs),
        Scenario(
            "context_limit",  # the 2nd (2.1.197) or 3rd (2.1.330) request is over 24k tokens
            "Read big.txt, then cat it.",
            _context_limit,
            context_length=24_000,
        ),
        Scenario(
            "partial_compaction",
            "Show the head of big.txt.",
            _partial_compaction,
            follow_ups=("Now show its tail.",),
            versions=("2.1.330",),
            context_length=18_000,
        ),
        Scenario(
            "partial_compaction_3",
            "Show the head of big.txt.",
            _partial_compaction,
            follow_ups=("Now show its tail.", "Show its tail again.", "Once more, its tail."),
            versions=("2.1.330",),
            context_length=18_000,
        ),
    )
}


def claude_binary(version: str) -> Path:
    return REPO / "tools" / CLAUDE_DIRS[version] / "node_modules" / ".bin" / "claude"


def make_workdir(wd: Path) -> None:
    wd.mkdir(parents=True, exist_ok=True)
    (wd / "hello.py").write_text(HELLO_PY)
    (wd / "pixel.png").write_bytes(tiny_png())
    (wd / "nb.ipynb").write_text(json.dumps(NOTEBOOK, indent=1))
    words = " ".join(WORDS[i % len(WORDS)] for i in range(3000))
    (wd / "big.txt").write_text(
        "\n".join(words[i : i + 100] for i in range(0, len(words), 100)) + "\nzulu-end\n"
    )


def cli_env(base_url: str, session_id: str, home: Path, extra: dict[str, str]) -> dict[str, str]:
    """The environment of a sandboxed training run (see README, "Claude Code settings")."""
    env = {
        **os.environ,
        "HOME": str(home),
        "IS_SANDBOX": "1",
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": session_id,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    env.pop("ANTHROPIC_API_KEY", None)
    for key, value in extra.items():
        if value:
            env[key] = value
        else:
            env.pop(key, None)
    return env


async def run_cli(
    binary: str,
    prompt: str,
    cwd: Path,
    env: dict[str, str],
    *,
    allowed: str,
    resume: bool,
    extra: tuple[str, ...] = (),
) -> tuple[int, list[dict[str, Any]], str]:
    """One `claude -p` run: (exit code, stream-json lines, raw output)."""
    args = [binary, "-p", prompt, "--allowedTools", allowed, "--output-format", "stream-json"]
    args += ["--verbose", "--dangerously-skip-permissions", *extra]
    if resume:
        args.append("--continue")
    proc = await asyncio.create_subprocess_exec(
        *args,
        cwd=cwd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=300)
    text = out.decode(errors="replace")
    lines = []
    for line in text.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                lines.append(json.loads(line))
    return proc.returncode or 0, lines, text


async def run_scenario(
    scenario: Scenario, binary: str, base_url: str, session_id: str, root: Path
) -> list[tuple[int, list[dict[str, Any]], str]]:
    """Run the scenario's prompt and follow-ups in `root` (workdir + HOME made here)."""
    wd, home = root / "work", root / "home"
    make_workdir(wd)
    home.mkdir(parents=True, exist_ok=True)
    env = cli_env(base_url, session_id, home, scenario.env)
    runs = []
    for i, prompt in enumerate((scenario.prompt, *scenario.follow_ups)):
        runs.append(
            await run_cli(
                binary,
                prompt,
                wd,
                env,
                allowed=scenario.allowed_tools,
                resume=i > 0,
                extra=scenario.args,
            )
        )
    return runs


class CaptureProxy:
    """Forward every request to the recorder; write it to `out/NNN.json` as it arrives.

    The capture keeps the request's method, path, headers (the auth token is
    replaced by "<session>") and body; the recorder's status and, for an
    error, its body are added once the answer is known. `refuse(body)`, when
    it returns a message, answers 400 with it instead of forwarding (to see
    what the CLI does when the recorder refuses a request).
    """

    def __init__(
        self, upstream: str, out: Path, refuse: Callable[[Any], str | None] | None = None
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.out = out
        self.refuse = refuse
        self.count = 0
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None
        self.url = ""

    async def start(self) -> str:
        self.out.mkdir(parents=True, exist_ok=True)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._http is not None
        raw = await request.read()
        self.count += 1
        path = self.out / f"{self.count:03d}.json"
        record = capture_record(request, raw)
        path.write_text(json.dumps(record, indent=1))
        refused = self.refuse(record["body"]) if self.refuse is not None else None
        if refused is not None:
            error = {"type": "invalid_request_error", "message": refused}
            record.update(status=400, error=json.dumps({"type": "error", "error": error}))
            path.write_text(json.dumps(record, indent=1))
            return web.json_response({"type": "error", "error": error}, status=400)
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")
        }
        async with self._http.request(
            request.method, self.upstream + request.path_qs, data=raw, headers=headers
        ) as upstream:
            record["status"] = upstream.status
            resp = web.StreamResponse(status=upstream.status)
            for k, v in upstream.headers.items():
                if k.lower() in ("content-type", "request-id", "retry-after"):
                    resp.headers[k] = v
            await resp.prepare(request)
            chunks = []
            async for chunk in upstream.content.iter_any():
                if upstream.status >= 400:
                    chunks.append(chunk)
                await resp.write(chunk)
            if chunks:
                record["error"] = b"".join(chunks).decode(errors="replace")
            path.write_text(json.dumps(record, indent=1))
            await resp.write_eof()
            return resp


def capture_record(request: web.Request, raw: bytes) -> dict[str, Any]:
    headers = dict(request.headers)
    for key in list(headers):
        if key.lower() in ("authorization", "x-api-key"):
            headers[key] = "<session>"
    body: Any
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = {"_base64": base64.b64encode(raw).decode()}
    return {"method": request.method, "path": request.path_qs, "headers": headers, "body": body}


def write_fixture(capture_dir: Path, dest: Path) -> None:
    """A compact copy of one scenario's captures: one gzipped JSON list, sorted keys."""
    records = [json.loads(p.read_text()) for p in sorted(capture_dir.glob("*.json"))]
    dest.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(records, sort_keys=True, separators=(",", ":")).encode()
    dest.write_bytes(gzip.compress(data, mtime=0))


def load_fixture(version: str, scenario: str) -> list[dict[str, Any]]:
    """The recorded requests of one scenario (tests/data/claude_traffic)."""
    path = FIXTURES / version / f"{scenario}.json.gz"
    return json.loads(gzip.decompress(path.read_bytes()))


async def record(version: str, scenario: Scenario, out: Path, work: Path, fixtures: bool) -> None:
    from recorder.log.store import open_store
    from recorder.model.engine import EngineClient
    from recorder.model.parsers import make_parser
    from recorder.model.tokenizer import load_tokenizer
    from recorder.server import RecorderServer, ServerConfig, make_context
    from replay.rules import load_rules
    from tools.test_engine.scripted import ScriptedEngine

    tokenizer = load_tokenizer(
        str(REPO / "tests" / "data" / "smollm2-tokenizer"), chat_template="chatml-tools"
    )
    root = work / version / scenario.name
    root.mkdir(parents=True, exist_ok=True)
    engine = ScriptedEngine(
        tokenizer,
        context_length=200_000,
        default_reply=responder(tokenizer, scenario.rules(root / "work")),
    )
    engine_url = await engine.start()
    store = await open_store(f"sqlite+aiosqlite:///{root / 'runs.db'}", create=True)
    client = EngineClient([engine_url], timeout_s=120, connect_timeout_s=2)
    await client.start()
    ctx = make_context(
        config=ServerConfig(context_length=scenario.context_length),
        store=store,
        engine=client,
        tokenizer=tokenizer,
        parser=make_parser("qwen25", "qwen3", "builtin"),
        rules=load_rules(None),
    )
    server = RecorderServer(ctx)
    await server.start()
    capture_dir = out / version / scenario.name
    proxy = CaptureProxy(server.url, capture_dir)
    try:
        await proxy.start()
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                server.url + "/sessions",
                json={"instance_id": scenario.name},
                headers={"Authorization": f"Bearer {ctx.config.admin_token}"},
            ) as r,
        ):
            sid = (await r.json())["session_id"]
        runs = await run_scenario(scenario, str(claude_binary(version)), proxy.url, sid, root)
        for code, lines, text in runs:
            last = lines[-1] if lines else {}
            print(
                f"{version} {scenario.name}: exit {code}, {last.get('subtype')} "
                f"{str(last.get('result'))[:80]!r}",
                file=sys.stderr,
            )
            if code != 0:
                print(text[-1500:], file=sys.stderr)
        if fixtures:
            write_fixture(capture_dir, FIXTURES / version / f"{scenario.name}.json.gz")
    finally:
        await proxy.stop()
        await server.stop(1)
        await store.close()
        await engine.stop()


def main() -> None:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/work/wt/captures"))
    parser.add_argument("--version", action="append", choices=sorted(CLAUDE_DIRS))
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    parser.add_argument("--fixtures", action="store_true", help="also rewrite tests/data copies")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for version in args.version or sorted(CLAUDE_DIRS):
            for name in args.scenario or SCENARIOS:
                scenario = SCENARIOS[name]
                if version in scenario.versions:
                    asyncio.run(record(version, scenario, args.out, Path(tmp), args.fixtures))


if __name__ == "__main__":
    main()
