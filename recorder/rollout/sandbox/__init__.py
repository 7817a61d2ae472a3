"""Sandboxes: `await open_sandbox(spec)` returns a running sandbox of the spec's backend.

Backends are imported lazily (the `e2b` SDK is an optional extra), the way
`recorder.log.store.open_store` picks a store by URL.
"""

from __future__ import annotations

from recorder.rollout.sandbox.base import (
    CommandHandle,
    CommandTimeout,
    ExecResult,
    OutputCallback,
    Sandbox,
    SandboxBootError,
    SandboxError,
    SandboxGone,
    SandboxSpec,
)

__all__ = [
    "CommandHandle",
    "CommandTimeout",
    "ExecResult",
    "OutputCallback",
    "Sandbox",
    "SandboxBootError",
    "SandboxError",
    "SandboxGone",
    "SandboxSpec",
    "open_sandbox",
]

BACKENDS = ("local", "e2b")


async def open_sandbox(spec: SandboxSpec) -> Sandbox:
    """Create and return a running sandbox; raises `SandboxBootError` if it cannot."""
    if spec.backend == "local":
        from recorder.rollout.sandbox.local import LocalSandbox

        return await LocalSandbox.create(spec)
    if spec.backend == "e2b":
        from recorder.rollout.sandbox.e2b import E2BSandbox

        return await E2BSandbox.create(spec)
    raise ValueError(f"unknown sandbox backend {spec.backend!r}: use one of {', '.join(BACKENDS)}")
