"""Helpers for the rollout driver's tests: the shipped tasks, a recorder with a scripted
"model" that fixes (or botches) them, and leak counters. Imported by basename (this
folder has no __init__.py, like the sandbox suite's helpers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recorder.model.tokenizer import Tokenizer, load_tokenizer
from recorder.rollout.sandbox.local import marked_pids
from recorder.rollout.tasks import Task, load_tasks
from tests.server.conftest import FIXTURE_TOKENIZER, Harness, make_harness
from tools.tasks.build import build_all
from tools.tasks.policy import task_policy

CONTEXT = 200_000


def shipped_tasks() -> dict[str, Task]:
    tasks, errors = load_tasks(build_all())
    assert not errors, errors
    return {t.instance_id: t for t in tasks}


def chat_tokenizer() -> Tokenizer:
    return load_tokenizer(str(FIXTURE_TOKENIZER), chat_template="chatml-tools")


async def policy_recorder(
    tokenizer: Tokenizer, db_url: str, *, wrong: bool = False, **policy: Any
) -> Harness:
    """A recorder whose scripted engine answers each shipped task with its fix."""
    return await make_harness(
        tokenizer,
        db_url,
        engine_kwargs={
            "context_length": CONTEXT,
            "default_reply": task_policy(tokenizer, wrong=wrong, **policy),
        },
        context_length=CONTEXT,
    )


async def sandbox_ids(h: Harness, session_id: str) -> list[str]:
    """The sandboxes a rollout's log says it created."""
    from recorder.log import events as ev

    created = [e for e in await h.payloads(session_id, ev.SandboxEvent)]
    return [str(e.detail["sandbox_id"]) for e in created if e.kind == "sandbox_created"]


def leftovers(root: Path, ids: list[str]) -> list[str]:
    """Sandbox directories left under `root`, and processes still marked with one of `ids`."""
    dirs = [p.name for p in root.iterdir()] if root.exists() else []
    procs = [f"pid {pid}" for sid in ids for pid in marked_pids(sid)]
    return dirs + procs
