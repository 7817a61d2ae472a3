"""The live middleware: the Anthropic Messages API in front of SGLang, recording every turn.

Endpoints (errors always `{"type": "error", "error": {"type", "message"}}`):
  agent   POST /v1/messages[?beta=true]   JSON or SSE; session id as Bearer / x-api-key
          POST /v1/messages/count_tokens  the chat template's real token count
          GET /v1/models, GET /health, HEAD /
  admin   POST /sessions                  open (metadata, optional id, reopen)
  (token) GET /sessions/{id}              inspect
          POST /sessions/{id}/close       reward + close -> samples (replay reducer)
          GET /sessions/{id}/samples      samples of a closed session again

Modules: `context` (config + shared objects), `app` (aiohttp app, start/stop),
`api` / `admin` (routes), `turn` (the per-request pipeline), `sessions`
(registry + per-session lock), `journal` (ordered, batched appends),
`restore` (state from the log), `answer` / `responders` / `sse` (the
Anthropic answer as JSON or events), `errors`, `auth`, `commands`
(`recorder serve`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recorder.server.app import RecorderServer, create_app, free_port, make_context
    from recorder.server.context import LIVE_RULES_VERSION, ServerConfig, ServerContext

# Loaded on first use: the dialects import this package's leaf modules
# (answer, errors, sse), and loading the app here would import them back.
_EXPORTS = {
    "LIVE_RULES_VERSION": "context",
    "RecorderServer": "app",
    "ServerConfig": "context",
    "ServerContext": "context",
    "create_app": "app",
    "make_context": "app",
    "free_port": "app",
}
__all__ = [
    "LIVE_RULES_VERSION",
    "RecorderServer",
    "ServerConfig",
    "ServerContext",
    "create_app",
    "free_port",
    "make_context",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
