"""The environment a sandbox's commands start from: named host variables only, never the rest.

A driver's own environment is full of things the agent must not see or be
steered by: the admin token (`TR_ADMIN_TOKEN`), the host's Claude Code config
dir (`CLAUDE_CONFIG_DIR`: every parallel agent would write its transcripts
there), provider switches (`CLAUDE_CODE_USE_BEDROCK=1` sends the agent past
the recorder), cloud keys. So a local sandbox inherits only what a program
needs to run at all (`HOST_VARIABLES`: the search path, the locale, CA bundle
settings, proxies when set); everything else is passed on purpose, with
`SandboxSpec.env` (`--sandbox-env`) and `AgentSpec.env` (`--agent-env`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

# Taken from the host when set: a program cannot run (PATH), read text (locale),
# verify TLS (CA bundles, corporate proxies) or reach the network without them.
HOST_VARIABLES = (
    "PATH",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TERM",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
    "PIP_CERT",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
)
_LOCALE = re.compile(r"^LC_[A-Z_]+$")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def host_basics(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` a sandbox inherits (`HOST_VARIABLES`, `LC_*`), no others."""
    kept = {k: v for k, v in environ.items() if k in HOST_VARIABLES or _LOCALE.match(k)}
    kept.setdefault("PATH", DEFAULT_PATH)
    return kept


def parse_assignments(pairs: Iterable[str], *, option: str) -> dict[str, str]:
    """`["KEY=VALUE", ...]` -> a dict; a malformed pair raises ValueError naming `option`."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not _NAME.match(key):
            raise ValueError(
                f"{option} takes KEY=VALUE with KEY a variable name (letters, digits, _): "
                f"got {pair!r}"
            )
        out[key] = value
    return out
