"""slime's agent middleware as a benchmark peer: its real `AnthropicAdapter`, run from a checkout.

`python -m tools.benchkit.slime_peer --slime-src DIR --engine URL --port N`
serves `slime.agent.adapters.anthropic.AnthropicAdapter` (THUDM/slime, read
from DIR, never copied here) the way slime's own coding-agent rollout serves
it (`examples/coding_agent_rl/generate.py`: `run_app_in_thread` with
`handler_cancellation` and its `FilteredAccessLogger`), in front of the
benchmark's engine. Every turn it renders the whole history with the HF
tokenizer's chat template, calls `/generate` with the ids, decodes and parses
the output with SGLang's parsers, answers, and records the turn in its
`TrajectoryManager`. A session is opened by its first request: the sid is the
request's bearer token (or `x-api-key`), so `SlimeProcess.open_session` only
draws a fresh one.

Set up as `benchkit.recorder` sets up ours, so the two render the same model's
prompts:
- tokenizer: a transformers tokenizer of the repository's fixture
  (`tests/data/smollm2-tokenizer`, the one the recorder loads);
- chat template: that directory's template is plain ChatML without tools, so
  the HF tokenizer is given the recorder's own `chatml-tools` template file
  (rendered by transformers' jinja, whose `tojson` the recorder's matches);
- tool parser `qwen25`, no reasoning parser (the recorder's benchmark flags).

Shim (ours, in this launcher; slime's code is untouched): slime's parsing
imports `sglang.srt.function_call...` and `sglang.srt.entrypoints.openai.protocol`
lazily, and `import sglang` runs SGLang's package `__init__`, which needs triton
(a GPU stack absent here). `recorder.model.sglang_compat` registers `sglang` as
a bare package first, so those same modules import on CPU, as they do in the
recorder. slime imports torch (`slime.utils.types`): the CPU wheel serves.

`POST /bench/prompt_ids` (added by this launcher, not slime's) answers the ids
slime's turn pipeline renders for a Messages body (its own `_preprocess_body`,
`_translate` and `_render_token_ids`), so a benchmark can compare them with
the ids our chain sent for the same request (`token_difference`).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tools.benchkit.engine import TOKENIZER
from tools.benchkit.memory import ProcessMemory
from tools.benchkit.procs import REPO, python_module
from tools.benchkit.wire import wait_healthy
from tools.test_engine.launch import free_port

TEMPLATE = REPO / "recorder" / "model" / "templates" / "chatml-tools.jinja"
PROMPT_IDS_PATH = "/bench/prompt_ids"
ADAPTER_MODULE = Path("slime", "agent", "adapters", "anthropic.py")
# What slime's parsing imports from SGLang (slime.agent.parsing), reached without sglang/__init__.
SGLANG_MODULES = ("srt.function_call.function_call_parser", "srt.entrypoints.openai.protocol")


def check_slime_src(slime_src: Path) -> Path:
    """`slime_src` resolved, if it is a slime checkout; else SystemExit saying what to pass."""
    root = slime_src.expanduser().resolve()
    if not (root / ADAPTER_MODULE).is_file():
        raise SystemExit(
            f"--slime-src {slime_src}: no {ADAPTER_MODULE} there; pass the root of a "
            "THUDM/slime checkout (git clone https://github.com/THUDM/slime)"
        )
    return root


class SlimeProcess:
    """slime's AnthropicAdapter (from `slime_src`) in a child process, in front of `engine_url`.

    `log`: its output goes to a new temporary file (`log_file`), as
    `RecorderProcess(log=True)` does. Served the way the benchmarks serve a
    `RecorderProcess` (`url`, `proc`, `wait_healthy`, `open_session`, `stop`).
    """

    def __init__(
        self,
        slime_src: Path,
        engine_url: str,
        *,
        log: bool = False,
        tool_parser: str = "qwen25",
        reasoning_parser: str | None = None,
    ) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        args = [
            "--slime-src", str(check_slime_src(slime_src)), "--engine", engine_url,
            "--port", str(port), "--tool-parser", tool_parser,
        ]  # fmt: skip
        if reasoning_parser:
            args += ["--reasoning-parser", reasoning_parser]
        self.log_file: Path | None = None
        if log:
            self.log_file = Path(tempfile.mkstemp(prefix="bench_slime_", suffix=".log")[1])
            with self.log_file.open("wb") as out:  # the child keeps its own descriptor
                self.proc = python_module(
                    "tools.benchkit.slime_peer", *args, stdout=out, stderr=subprocess.STDOUT
                )
        else:
            self.proc = python_module("tools.benchkit.slime_peer", *args)
        self.memory = ProcessMemory(self.proc.pid)

    async def wait_healthy(self, http: aiohttp.ClientSession) -> None:
        """Until slime's `/healthz` answers (importing torch and SGLang takes seconds)."""
        exited = self.proc.poll
        await wait_healthy(http, self.url, exited, self._what(), timeout_s=300, path="/healthz")

    async def open_session(self, http: aiohttp.ClientSession) -> str:
        """A fresh sid: slime has no session API, a sid's first request opens its trajectory."""
        return f"slime-{uuid.uuid4().hex}"

    async def prompt_ids(self, http: aiohttp.ClientSession, body: bytes) -> list[int]:
        """The ids slime's turn pipeline renders for the Messages request `body`."""
        async with http.post(self.url + PROMPT_IDS_PATH, data=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{self._what()}: {resp.status} {await resp.text()}")
            return [int(i) for i in await resp.json()]

    def rss(self) -> int:
        return self.memory.rss()

    async def stop(self) -> None:
        self.proc.terminate()
        await asyncio.to_thread(self.proc.wait, 60)

    def _what(self) -> str:
        where = f" (its output: {self.log_file})" if self.log_file else ""
        return f"slime's adapter{where}"


# --------------------------------------------------------------------------
# Comparing its prompt with ours (pure)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenDifference:
    """Where two renderings of one request differ: a shared head and tail around one middle."""

    ours: int  # tokens in our rendering
    theirs: int
    head: int  # leading tokens both share
    tail: int  # trailing tokens both share, after the head

    @property
    def identical(self) -> bool:
        return self.ours == self.theirs == self.head

    def middles(self, ours: list[int], theirs: list[int]) -> tuple[list[int], list[int]]:
        """The differing tokens of each rendering (empty when identical)."""
        return ours[self.head : self.ours - self.tail], theirs[self.head : self.theirs - self.tail]


def token_difference(ours: list[int], theirs: list[int]) -> TokenDifference:
    """The longest shared head, then the longest shared tail of what is left."""
    head = 0
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            break
        head += 1
    tail = 0
    limit = min(len(ours), len(theirs)) - head
    while tail < limit and ours[-1 - tail] == theirs[-1 - tail]:
        tail += 1
    return TokenDifference(len(ours), len(theirs), head, tail)


# --------------------------------------------------------------------------
# The child process: slime's adapter served
# --------------------------------------------------------------------------


def _import_slime(slime_src: Path) -> None:
    """Put the checkout first on sys.path and SGLang's parser modules within reach (the shim)."""
    from recorder.model import sglang_compat

    sys.path.insert(0, str(slime_src))
    for module in SGLANG_MODULES:
        sglang_compat.load(module)
    import slime

    found = Path(slime.__file__ or "").resolve()
    if slime_src not in found.parents:
        raise SystemExit(f"`import slime` found {found}, not the checkout {slime_src}")


def build_adapter(
    slime_src: Path,
    engine_url: str,
    tool_parser: str,
    reasoning_parser: str | None,
    tokenizer_dir: Path = TOKENIZER,
    template: Path = TEMPLATE,
) -> Any:
    """slime's AnthropicAdapter over a transformers tokenizer of our fixture with our template."""
    _import_slime(slime_src)
    if reasoning_parser:
        from recorder.model import sglang_compat

        sglang_compat.load("srt.parser.reasoning_parser")
    import transformers
    from slime.agent.adapters.anthropic import AnthropicAdapter
    from slime.agent.adapters.common import _render_token_ids

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.chat_template = template.read_text()
    adapter = AnthropicAdapter(
        tokenizer=tok,
        sglang_url=engine_url,
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
    )

    async def prompt_ids(request: web.Request) -> web.Response:
        body = await request.json()
        adapter._preprocess_body(body)
        translated, tools = adapter._translate(body)
        return web.json_response(_render_token_ids(translated, tok, tools=tools))

    adapter.app.router.add_post(PROMPT_IDS_PATH, prompt_ids)
    return adapter


def serve(args: argparse.Namespace) -> None:
    """Serve the adapter as slime's coding-agent rollout does, until SIGTERM or SIGINT."""
    slime_src = check_slime_src(args.slime_src)
    # Blocked before the app's thread starts (it inherits the mask): sigwait below takes them.
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    adapter = build_adapter(slime_src, args.engine, args.tool_parser, args.reasoning_parser)
    from slime.agent.aiohttp_threaded import FilteredAccessLogger, run_app_in_thread

    handle = run_app_in_thread(
        adapter.app,
        host="127.0.0.1",
        port=args.port,
        thread_name="anthropic-adapter",
        runner_kwargs={"handler_cancellation": True, "access_log_class": FilteredAccessLogger},
    )
    print(f"slime AnthropicAdapter from {slime_src} on {handle.port}", flush=True)
    signal.sigwait(stop)
    handle.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--slime-src", type=Path, required=True, help="a THUDM/slime checkout")
    ap.add_argument("--engine", required=True, help="the SGLang (or scripted) engine's URL")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tool-parser", default="qwen25", help="SGLang tool-call parser name")
    ap.add_argument("--reasoning-parser", default=None, help="SGLang reasoning parser name")
    serve(ap.parse_args(argv))


if __name__ == "__main__":
    main()
