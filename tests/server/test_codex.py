"""The real Codex CLI (`@openai/codex`, Responses wire API) as the client, recorded and reduced.

Codex runs `codex exec` against the recorder as a custom model provider
(PROTOCOLS.md), in a throwaway HOME; the scripted engine answers with a
tool call that writes a file, then a final message.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from recorder.log import events as ev
from replay.load import load_session
from replay.reducer import reduce_session
from replay.samples import encode_sample
from tests.conftest import REPO, missing
from tests.server.conftest import make_harness, tool_call_text

pytestmark = pytest.mark.codex

CODEX_VERSION = "0.169.0"
"""The Codex CLI tools/setup.sh pins (into tools/codex, git-ignored)."""


def codex_binary() -> str:
    found = os.environ.get("TR_CODEX_BIN")
    local = REPO / "tools" / "codex" / "node_modules" / ".bin" / "codex"
    if found is None and local.exists():
        found = str(local)
    if found is None:
        missing(f"Codex CLI {CODEX_VERSION} is not installed", "run tools/setup.sh (needs npm)")
    return found


def codex_command(binary: str, url: str, task: str) -> list[str]:
    """`codex exec` against the recorder as a custom Responses provider; the key is $TR_SESSION."""
    return [
        binary, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
        "-c", "model_provider=rec",
        "-c", 'model_providers.rec.name="rec"',
        "-c", f'model_providers.rec.base_url="{url}/v1"',
        "-c", 'model_providers.rec.env_key="TR_SESSION"',
        "-c", 'model_providers.rec.wire_api="responses"',
        "-m", "test-model", task,
    ]  # fmt: skip


async def test_codex_writes_a_file_through_the_recorder(
    tokenizer: Any, sqlite_url: str, tmp_path: Path
) -> None:
    codex = codex_binary()
    h = await make_harness(
        tokenizer, sqlite_url, context_length=200_000, engine_kwargs={"context_length": 200_000}
    )
    try:
        h.engine.push(
            tool_call_text(
                "exec_command", {"cmd": "printf hello > a.txt"}, preface="Writing it.\n"
            ),
            "Wrote hello to a.txt. Done.",
        )
        sid = await h.open_session(instance_id="codex-smoke")
        home, work = tmp_path / "home", tmp_path / "work"
        home.mkdir()
        work.mkdir()
        env = {**os.environ, "HOME": str(home), "TR_SESSION": sid}
        env.pop("OPENAI_API_KEY", None)
        proc = await asyncio.create_subprocess_exec(
            *codex_command(codex, h.url, "Write hello to a.txt"),
            cwd=work,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=180)
        assert proc.returncode == 0, out.decode()[-3000:]
        assert (work / "a.txt").read_text() == "hello"
        assert "Wrote hello to a.txt" in out.decode()

        requests = await h.payloads(sid, ev.MessagesRequest)
        assert [r.dialect for r in requests] == ["openai-responses"] * 2  # type: ignore[attr-defined]
        assert all(r.stream for r in requests)  # type: ignore[attr-defined]
        decisions = await h.payloads(sid, ev.ChainDecision)
        assert [(d.action, d.reason) for d in decisions] == [  # type: ignore[attr-defined]
            ("new", "first"),
            ("extend", "extends"),
        ]
        status, live = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 1.0})
        assert status == 200 and not live["placeholder"], live
        (sample,) = live["samples"]
        results = await h.payloads(sid, ev.GenerateResult)
        emitted = sum(r.output_ids.length for r in results)  # type: ignore[attr-defined]
        assert sum(sample["loss_mask"]) == emitted

        log = await load_session(h.store, sid)
        offline = reduce_session(log.events, log.arrays, h.ctx.rules)
        assert [encode_sample(s) for s in offline.samples] == [
            encode_sample(s) for s in _live_samples(live)
        ]
    finally:
        await h.close()


def _live_samples(live: dict[str, Any]) -> list[Any]:
    import msgspec

    from replay.samples import Sample

    return [msgspec.convert(s, Sample) for s in live["samples"]]
