"""The real Claude Code CLI (2.1.197 and 2.1.330) through the recorder, one scenario at a time.

The scenarios are tools/claude_traffic.py's (the script that recorded
tests/data/claude_traffic): a Read/Edit/Bash rollout, background and
synchronous subagents, `/compact` after a tool result, ToolSearch (and calling
the tool it loaded), reading a PNG, and nonessential traffic on. Each runs once per module (`_RUNS`); two
kinds of test read the run:

- `test_wire_*`: the CLI finishes, the recorder refused nothing, and the
  blocks it sent reached the model the documented way;
- `test_tokens_*`: every engine output token of the session lands in a
  trained segment of the right kind, or is masked for a reason the session
  states (chain identity and segmentation, issue 16).
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from recorder.log import events as ev
from recorder.model.tokenizer import Tokenizer
from tests.conftest import (
    CLAUDE_CODE_VERSIONS,
    _create_database,
    _drop_database,
    _postgres_admin_url,
    claude_code_binary,
)
from tests.server.conftest import make_harness
from tools.claude_traffic import (
    SCENARIOS,
    CaptureProxy,
    cli_env,
    responder,
    run_cli,
    run_scenario,
)

pytestmark = pytest.mark.claude


@dataclass
class ScenarioRun:
    """What one CLI run left: its outcome, the session's log, its rendered prompts, its samples."""

    name: str
    version: str
    codes: list[int]
    results: list[dict[str, Any]]
    outputs: list[str]
    events: list[ev.AnyEvent]
    prompts: dict[int, str]  # turn -> the prompt the engine got, decoded
    schemas: list[str | None]  # the json_schema of each engine request
    bodies: list[dict[str, Any]]  # every Messages request body, as the CLI sent it
    closed: dict[str, Any]
    workdir: Path  # where the CLI ran (its files after the run)

    def of(self, type_: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, type_)]

    @property
    def engine_tokens(self) -> int:
        return self.tokens_of(set(self.prompts))

    def tokens_of(self, turns: set[int]) -> int:
        return sum(r.output_ids.length for r in self.of(ev.GenerateResult) if r.turn in turns)

    def turns_with(self, needle: str) -> set[int]:
        return {turn for turn, prompt in self.prompts.items() if needle in prompt}

    @property
    def trained_tokens(self) -> int:
        return sum(sum(s["loss_mask"]) for s in self.closed["samples"])

    def kinds(self) -> list[str]:
        return [s["kind"] for s in self.closed["segments"]]


_RUNS: dict[tuple[str, str, str], ScenarioRun] = {}


async def _run(
    tokenizer: Tokenizer, db_url: str, root: Path, version: str, name: str
) -> ScenarioRun:
    scenario = SCENARIOS[name]
    binary = claude_code_binary(version)
    h = await make_harness(
        tokenizer,
        db_url,
        context_length=scenario.context_length,
        engine_kwargs={
            "context_length": 200_000,
            "default_reply": responder(tokenizer, scenario.rules(root / "work")),
        },
    )
    try:
        sid = await h.open_session(instance_id=f"{version}-{name}")
        runs = await run_scenario(scenario, binary, h.url, sid, root)
        prompts = {
            r.turn: tokenizer.decode(await h.array(r.input_ids))  # type: ignore[arg-type]
            for r in await h.payloads(sid, ev.RenderedInput)
            if isinstance(r, ev.RenderedInput)
        }
        schemas = [r.json_schema for r in h.engine.requests]
        bodies = [
            json.loads(bytes(await h.array(r.body)))  # type: ignore[arg-type]
            for r in await h.payloads(sid, ev.MessagesRequest)
            if isinstance(r, ev.MessagesRequest)
        ]
        events = await h.payloads(sid)
        status, closed = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
        assert status == 200, closed
    finally:
        await h.close()
    return ScenarioRun(
        name=name,
        version=version,
        codes=[code for code, _, _ in runs],
        results=[lines[-1] if lines else {} for _, lines, _ in runs],
        outputs=[text for _, _, text in runs],
        events=events,
        prompts=prompts,
        schemas=schemas,
        bodies=bodies,
        closed=closed,
        workdir=root / "work",
    )


@pytest.fixture
async def scenario_run(
    request: pytest.FixtureRequest, tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> ScenarioRun:
    """The run of (version, scenario, backend), made by the first test that asks for it."""
    version, name, backend = key = request.param
    if key not in _RUNS:
        root = tmp_path_factory.mktemp(f"claude-{version}-{name}")
        if backend == "sqlite":
            url = f"sqlite+aiosqlite:///{root / 'runs.db'}"
            _RUNS[key] = await _run(tokenizer, url, root, version, name)
        else:
            admin = _postgres_admin_url()
            url = await _create_database(admin)
            try:
                _RUNS[key] = await _run(tokenizer, url, root, version, name)
            finally:
                await _drop_database(admin, url)
    return _RUNS[key]


def _cases(
    *names: str,
    versions: tuple[str, ...] = CLAUDE_CODE_VERSIONS,
) -> list[Any]:
    """Parameters of `scenario_run`: every recorded version of each scenario, on both stores."""
    return [
        pytest.param((v, n, b), id=f"{v}-{n}-{b}")
        for n in names
        for v in versions
        for b in ("sqlite", "postgres")
        if v in SCENARIOS[n].versions
    ]


ALL = tuple(n for n in SCENARIOS if "compaction" not in n and n != "context_limit")


def _with_engine_tokens(run: ScenarioRun) -> None:
    """The CLI finished each run, and the recorder answered every request it was sent."""
    for result, output in zip(run.results, run.outputs, strict=True):
        assert result.get("type") == "result" and not result.get("is_error"), output[-3000:]
    assert run.of(ev.RequestRejected) == []
    assert run.of(ev.TurnFailed) == []
    assert run.engine_tokens > 0


@pytest.mark.parametrize("scenario_run", _cases(*ALL), indirect=True)
async def test_wire_every_request_is_served(scenario_run: ScenarioRun) -> None:
    _with_engine_tokens(scenario_run)


@pytest.mark.parametrize("scenario_run", _cases("image"), indirect=True)
async def test_wire_image_reaches_the_model_as_its_placeholder(scenario_run: ScenarioRun) -> None:
    last = scenario_run.prompts[max(scenario_run.prompts)]
    assert "<tool_response>\n[image: image/png, " in last
    assert scenario_run.results[-1]["result"] == "Done."


@pytest.mark.parametrize("scenario_run", _cases("tool_search"), indirect=True)
async def test_wire_tool_reference_loads_the_deferred_tool(scenario_run: ScenarioRun) -> None:
    prompts = scenario_run.prompts
    first, last = prompts[min(prompts)], prompts[max(prompts)]
    assert '"name": "NotebookEdit"' not in first  # deferred: not in the tool list
    loaded = last.rpartition("<tool_response>")[2]
    assert loaded.lstrip().startswith('<tools>\n{"type": "function", "function": {"name": "Note')


@pytest.mark.parametrize("scenario_run", _cases("compact_then_work"), indirect=True)
async def test_wire_empty_system_message_renders_no_empty_block(
    scenario_run: ScenarioRun,
) -> None:
    """After /compact 2.1.330 sends `{"role": "system", "content": []}`: the engine sees none."""
    assert any(
        m["role"] == "system" and not m["content"]
        for body in scenario_run.bodies
        for m in body["messages"]
    )
    for prompt in scenario_run.prompts.values():
        assert "<|im_start|>system\n<|im_end|>" not in prompt


@pytest.mark.parametrize(
    "scenario_run", _cases("nonessential", versions=("2.1.197",)), indirect=True
)
async def test_wire_title_request_is_honoured(scenario_run: ScenarioRun) -> None:
    """2.1.197 asks for a title under a JSON schema: the engine decodes under that schema."""
    (schema,) = [s for s in scenario_run.schemas if s is not None]
    assert json.loads(schema)["required"] == ["title"]
    assert scenario_run.turns_with("sentence-case title")


@pytest.mark.parametrize("scenario_run", _cases(*ALL), indirect=True)
async def test_wire_no_thinking_block_unless_asked(scenario_run: ScenarioRun) -> None:
    """The scripted engine emits no reasoning: nothing to hide, nothing shown."""
    for sent in scenario_run.of(ev.ResponseSent):
        assert all(b["type"] != "thinking" for b in sent.content)


# -- every engine token lands in a trained segment of the right kind ---------------------------


def _all_trained(run: ScenarioRun) -> None:
    _with_engine_tokens(run)
    assert run.trained_tokens == run.engine_tokens, (run.kinds(), run.closed["diagnostics"])
    assert not any(s.get("dropped") for s in run.closed["segments"])


@pytest.mark.parametrize("scenario_run", _cases("coding"), indirect=True)
async def test_tokens_coding_rollout_has_no_false_fork(scenario_run: ScenarioRun) -> None:
    """Read, Edit (re-sent with `replace_all: false` added), Bash, done: one chain."""
    decisions = scenario_run.of(ev.ChainDecision)
    assert [d.action for d in decisions] == ["new"] + ["extend"] * (len(decisions) - 1)
    assert len(decisions) == 4
    _all_trained(scenario_run)
    assert scenario_run.kinds() == ["final"]


@pytest.mark.parametrize("scenario_run", _cases("deferred_call"), indirect=True)
async def test_wire_a_tool_loaded_by_tool_search_is_called_and_run(
    scenario_run: ScenarioRun,
) -> None:
    """Read, ToolSearch loads the deferred NotebookEdit, the model calls it, the CLI runs it."""
    uses = [
        b["name"]
        for s in scenario_run.of(ev.ResponseSent)
        for b in s.content
        if b["type"] == "tool_use"
    ]
    assert uses == ["Read", "ToolSearch", "NotebookEdit"]
    (first, *_), last = scenario_run.bodies, scenario_run.bodies[-1]
    assert "NotebookEdit" not in {t["name"] for t in first["tools"]}  # deferred, not yet loaded
    assert "Updated cell c1" in json.dumps(last["messages"][-1])  # the CLI ran the call
    assert "print('nb-fixed')" in (scenario_run.workdir / "nb.ipynb").read_text()
    assert scenario_run.results[-1]["result"] == "The notebook cell is fixed."


@pytest.mark.parametrize(
    "scenario_run", _cases("image", "tool_search", "deferred_call"), indirect=True
)
async def test_tokens_image_and_tool_search_rollouts(scenario_run: ScenarioRun) -> None:
    """One chain: a loaded tool (2.1.330 then lists it in `tools`) is no compaction or fork."""
    decisions = scenario_run.of(ev.ChainDecision)
    assert [d.action for d in decisions] == ["new"] + ["extend"] * (len(decisions) - 1)
    _all_trained(scenario_run)
    assert scenario_run.kinds() == ["final"]


@pytest.mark.parametrize(
    "scenario_run",
    _cases(
        "subagent_sync",
        "subagent_background",
    ),
    indirect=True,
)
async def test_tokens_subagent_is_linked_to_its_dispatch(scenario_run: ScenarioRun) -> None:
    _all_trained(scenario_run)
    dispatched = [
        b["id"]
        for s in scenario_run.of(ev.ResponseSent)
        for b in s.content
        if b["type"] == "tool_use" and b["name"] in ("Agent", "Task")
    ]
    subagents = [s for s in scenario_run.closed["segments"] if s["kind"] == "subagent"]
    assert [s["dispatch_tool_use_id"] for s in subagents] == dispatched
    assert scenario_run.kinds()[-1] == "final"


@pytest.mark.parametrize("scenario_run", _cases("compact"), indirect=True)
async def test_tokens_compaction_after_a_tool_result_drops_nothing(
    scenario_run: ScenarioRun,
) -> None:
    """The summary request re-sends the history without the last answer: not a fork of it."""
    _all_trained(scenario_run)
    assert scenario_run.kinds()[-1] == "final"
    assert not any("abandoned" in d for d in scenario_run.closed["diagnostics"])


@pytest.mark.parametrize(
    "scenario_run",
    _cases("nonessential", versions=("2.1.197",)),
    indirect=True,
)
async def test_tokens_side_requests_are_their_own_kind(scenario_run: ScenarioRun) -> None:
    """The title request is a `side` segment, untrained by default, never `final`."""
    _with_engine_tokens(scenario_run)
    title = scenario_run.turns_with("sentence-case title")
    segments = scenario_run.closed["segments"]
    assert [s["kind"] for s in segments] == ["side", "final"]
    assert set(segments[0]["turns"]) == title
    assert "side_requests" in (segments[0]["dropped"] or "")  # left out: no sample trains it
    main = scenario_run.engine_tokens - scenario_run.tokens_of(title)
    assert scenario_run.trained_tokens == main == segments[1]["trainable_tokens"]


@pytest.mark.parametrize("scenario_run", _cases("no_tools"), indirect=True)
async def test_tokens_without_tools_the_conversation_is_final(scenario_run: ScenarioRun) -> None:
    """`--tools ""` with nonessential traffic: no request offers tools. 2.1.197 asks for a
    title first; the conversation still takes the main line and `final`, the title is `side`."""
    _with_engine_tokens(scenario_run)
    assert scenario_run.results[-1]["result"] == "I cannot run echo here: no tools."
    assert all(not b.get("tools") for b in scenario_run.bodies)
    title = scenario_run.turns_with("sentence-case title")
    segments = scenario_run.closed["segments"]
    assert bool(title) == (scenario_run.version == "2.1.197")  # 2.1.330 -p sends no title
    if title:
        assert [s["kind"] for s in segments] == ["side", "final"]
        assert set(segments[0]["turns"]) == title
    else:
        assert [s["kind"] for s in segments] == ["final"]
    main = scenario_run.engine_tokens - scenario_run.tokens_of(title)
    assert scenario_run.trained_tokens == main == segments[-1]["trainable_tokens"] > 0


@pytest.mark.parametrize(
    "scenario_run", _cases("nonessential", versions=("2.1.330",)), indirect=True
)
async def test_tokens_nonessential_on_without_side_requests(scenario_run: ScenarioRun) -> None:
    """2.1.330 in print mode sends no title request: the run is one trained chain."""
    assert not scenario_run.turns_with("sentence-case title")
    _all_trained(scenario_run)
    assert scenario_run.kinds() == ["final"]


async def test_claude_code_versions_are_the_pinned_ones() -> None:
    """tools/setup.sh's pins are what the tests run (a stale install would test another CLI)."""
    for version in CLAUDE_CODE_VERSIONS:
        proc = await asyncio.create_subprocess_exec(
            claude_code_binary(version), "--version", stdout=asyncio.subprocess.PIPE
        )
        out, _ = await proc.communicate()
        assert out.decode().split()[0] == version


# -- the context limit (README: "Claude Code settings for a training run") --------------------


@pytest.mark.parametrize(
    "scenario_run", _cases("context_limit", versions=("2.1.197",)), indirect=True
)
async def test_context_limit_ends_a_2_1_197_rollout(scenario_run: ScenarioRun) -> None:
    """Over the recorder's context length: a 400 "prompt is too long", and 2.1.197 gives up."""
    # Usually one 400; a CLI that timed out under load re-sends the same request first.
    rejected = scenario_run.of(ev.RequestRejected)
    assert rejected and all(
        r.status == 400 and r.message.startswith("prompt is too long") for r in rejected
    )
    assert scenario_run.codes == [1]
    assert scenario_run.results[-1]["result"] == "Prompt is too long"


@pytest.mark.parametrize(
    "scenario_run", _cases("context_limit", versions=("2.1.330",)), indirect=True
)
async def test_context_limit_makes_2_1_330_compact(scenario_run: ScenarioRun) -> None:
    """2.1.330 answers the 400 with a compaction (a summary request) and finishes the task."""
    # Usually one 400; a CLI that timed out under load re-sends the same request first.
    rejected = scenario_run.of(ev.RequestRejected)
    assert rejected and all(r.message.startswith("prompt is too long") for r in rejected)
    summaries = scenario_run.turns_with("Your task is to create a detailed summary")
    assert len(summaries) == 1
    assert max(scenario_run.prompts) > min(summaries)  # the task went on after it
    assert scenario_run.codes == [0]
    assert scenario_run.results[-1]["result"] == "I read it twice."
    # Every engine token is trained: the work before the compaction and the
    # summary end as `wipe` segments, the task's end is `final`.
    assert scenario_run.trained_tokens == scenario_run.engine_tokens > 0
    segments = scenario_run.closed["segments"]
    assert not any(s.get("dropped") for s in segments)
    assert scenario_run.kinds()[-1] == "final" and set(scenario_run.kinds()[:-1]) == {"wipe"}
    (summary,) = [s for s in segments if set(s["turns"]) == summaries]
    assert summary["kind"] == "wipe"


@pytest.mark.parametrize(
    "scenario_run", _cases("partial_compaction", "partial_compaction_3"), indirect=True
)
async def test_compaction_at_the_context_limit_trains_every_answer(
    scenario_run: ScenarioRun,
) -> None:
    """The CLI learns the limit from a 400 and compacts the head of the conversation.

    The summary request re-sends only the head, so it forks the main chain
    early; the answers after the head (acted on: kept verbatim after the
    summary) must still be trained, in the old context's `wipe` segment.
    """
    run = scenario_run
    assert run.codes == [0] * len(run.codes), run.outputs[-1][-2000:]
    assert run.results[-1]["result"] == "I read the tail."
    rejected = run.of(ev.RequestRejected)
    assert rejected and all(r.message.startswith("prompt is too long") for r in rejected)
    summaries = run.turns_with("Your task is to create a detailed summary")
    assert len(summaries) >= (1 if run.name == "partial_compaction" else 3)
    acc = run.closed["token_accounting"]
    assert acc["trained"] == acc["engine output"] == run.engine_tokens > 0, acc
    assert run.trained_tokens == run.engine_tokens
    assert not [d for d in run.closed["diagnostics"] if "abandoned" in d]
    assert run.kinds()[-1] == "final" and set(run.kinds()[:-1]) == {"wipe"}
    assert not any(s.get("dropped") for s in run.closed["segments"])


@pytest.mark.parametrize("version", CLAUDE_CODE_VERSIONS)
async def test_skip_permissions_as_root_needs_is_sandbox(version: str, tmp_path: Path) -> None:
    """As root, `--dangerously-skip-permissions` works only with IS_SANDBOX=1 (README)."""
    env = cli_env(
        "http://127.0.0.1:9", "unused", tmp_path, {"IS_SANDBOX": "", "CLAUDE_CODE_MAX_RETRIES": "0"}
    )
    code, _, text = await run_cli(
        claude_code_binary(version), "hi", tmp_path, env, allowed="Bash", resume=False
    )
    if os.geteuid() == 0:
        assert code != 0 and "cannot be used with root/sudo privileges" in text
    else:
        assert "cannot be used with root/sudo privileges" not in text


async def test_title_request_refused_leaves_2_1_197_working(
    tokenizer: Tokenizer, sqlite_url: str, tmp_path: Path
) -> None:
    """A 400 for the title request (its JSON output format) and 2.1.197 goes on without a title.

    The recorder honours the format instead (test_wire_title_request_is_honoured);
    this is why a 400 would have been safe too.
    """
    scenario = SCENARIOS["nonessential"]
    h = await make_harness(
        tokenizer,
        sqlite_url,
        context_length=scenario.context_length,
        engine_kwargs={
            "context_length": 200_000,
            "default_reply": responder(tokenizer, scenario.rules(tmp_path / "work")),
        },
    )

    def refuse(body: Any) -> str | None:
        wants_format = isinstance(body, dict) and (body.get("output_config") or {}).get("format")
        return "output_config.format: not supported" if wants_format else None

    proxy = CaptureProxy(h.url, tmp_path / "captures", refuse=refuse)
    try:
        sid = await h.open_session()
        await proxy.start()
        (run,) = await run_scenario(
            scenario, claude_code_binary("2.1.197"), proxy.url, sid, tmp_path
        )
        code, lines, text = run
        assert code == 0 and lines[-1]["result"] == "It printed side-marker.", text[-2000:]
        records = [
            json.loads(p.read_text()) for p in sorted((tmp_path / "captures").glob("*.json"))
        ]
        assert [r.get("status") for r in records if r["body"]][:1] == [400]  # the title, refused
        assert len(await h.payloads(sid, ev.ResponseSent)) == 2  # the main line: Bash, then done
    finally:
        await proxy.stop()
        await h.close()


# -- what the CLI changes in the tool calls it echoes ----------------------------------------


def _schema_defaults(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        t["name"]: {
            k: p["default"]
            for k, p in t["input_schema"].get("properties", {}).items()
            if "default" in p
        }
        for t in body.get("tools") or []
    }


@pytest.mark.parametrize("scenario_run", _cases("coding", "tool_inputs"), indirect=True)
async def test_echoed_tool_calls_differ_only_by_key_order_and_schema_defaults(
    scenario_run: ScenarioRun,
) -> None:
    """The normalisations both CLIs apply to the tool calls the recorder answered.

    Measured: keys are put in schema order (`Write`, `Bash`) and a schema
    default the call left out is added first (`Edit`'s `replace_all: false`);
    nothing else changes (an unknown key is echoed as sent, with an error).
    Key order does not matter to message digests; the added default does
    (the false fork of issue 16, traffic-chains).
    """
    sent = {
        b["id"]: b
        for r in scenario_run.of(ev.ResponseSent)
        for b in r.content
        if b["type"] == "tool_use"
    }
    echoed: dict[str, dict[str, Any]] = {}
    defaults: dict[str, dict[str, Any]] = {}
    for body in scenario_run.bodies:
        defaults.update(_schema_defaults(body))
        for m in body["messages"]:
            if m["role"] == "assistant" and isinstance(m["content"], list):
                echoed.update({b["id"]: b for b in m["content"] if b["type"] == "tool_use"})
    assert set(echoed) == set(sent)
    added_defaults = 0
    for tool_id, ours in sent.items():
        theirs = echoed[tool_id]
        assert theirs["name"] == ours["name"]
        added = {k: v for k, v in theirs["input"].items() if k not in ours["input"]}
        assert added == {k: defaults[ours["name"]][k] for k in added}, (ours, theirs)
        assert {**theirs["input"], **ours["input"]} == theirs["input"]
        if added:
            assert list(theirs["input"])[: len(added)] == list(added)  # placed first
            added_defaults += 1
    # coding: its Edit left `replace_all` out; tool_inputs: every call gave all its defaults.
    assert added_defaults == (1 if scenario_run.name == "coding" else 0)


@pytest.mark.parametrize("scenario_run", _cases("tool_inputs"), indirect=True)
async def test_tokens_reordered_tool_calls_extend_their_chain(scenario_run: ScenarioRun) -> None:
    """Write, Read with offset/limit, Bash with options, Edit with replace_all, a bad key."""
    decisions = scenario_run.of(ev.ChainDecision)
    assert [d.action for d in decisions] == ["new"] + ["extend"] * (len(decisions) - 1)
    assert len(decisions) == 6
    _all_trained(scenario_run)
