"""Token authentication for the Ray clusters the tests and benchmarks start.

`recorder rollout --ray` refuses a cluster that answers callers without a token
when its rollouts use local sandboxes (`recorder/rollout/cluster.py`,
`refuse_open_cluster`), so every cluster started on this machine for them runs
with Ray's token authentication, as the README tells users to run theirs. Ray
reads these variables when it is imported, and the nodes a process starts
inherit them: call `use_token_auth` before the first `import ray`.
"""

from __future__ import annotations

import secrets
from collections.abc import MutableMapping


def use_token_auth(environ: MutableMapping[str, str]) -> None:
    """`RAY_AUTH_MODE=token` and a fresh token in `environ`, unless it names its own."""
    environ.setdefault("RAY_AUTH_MODE", "token")
    if not environ.get("RAY_AUTH_TOKEN") and not environ.get("RAY_AUTH_TOKEN_PATH"):
        environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
