"""The live middleware: Anthropic Messages API in front of SGLang, recording every turn.

`ServerContext` + `create_app` / `RecorderServer` for embedding and tests;
`recorder serve` (in `commands`) for production.
"""

from recorder.server.app import RecorderServer, create_app, free_port
from recorder.server.context import LIVE_RULES_VERSION, ServerConfig, ServerContext

__all__ = [
    "LIVE_RULES_VERSION",
    "RecorderServer",
    "ServerConfig",
    "ServerContext",
    "create_app",
    "free_port",
]
