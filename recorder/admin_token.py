"""The admin token: always one, from the environment, a file, or generated into a file.

The admin API (open/close sessions, samples) is never open: a browser page or the
agent under training must not reach it. A token on the command line shows in the
process list, so the environment (TR_ADMIN_TOKEN) or a file is preferred; without
either, one is generated once and kept in a file only its owner can read, where the
trainer (and `recorder rollout`) can find it.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

ENV_TOKEN = "TR_ADMIN_TOKEN"
ENV_TOKEN_FILE = "TR_ADMIN_TOKEN_FILE"


class AdminTokenError(Exception):
    """The token file cannot be used; the message says how to fix it."""


def new_admin_token() -> str:
    return secrets.token_urlsafe(32)


def default_token_file() -> Path:
    """`$XDG_STATE_HOME/trajectory-recorder/admin-token` (default ~/.local/state/...)."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "trajectory-recorder" / "admin-token"


def read_token_file(path: Path) -> str:
    """The token in `path`; refuses a file others can read (it would not be a secret)."""
    try:
        mode = path.stat().st_mode
        token = path.read_text().strip()
    except OSError as exc:
        raise AdminTokenError(f"cannot read the admin token file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AdminTokenError(
            f"the admin token file {path} is readable by others: run `chmod 600 {path}`"
        )
    if not token:
        raise AdminTokenError(f"the admin token file {path} is empty: delete it or write a token")
    return token


def write_token_file(path: Path, token: str) -> None:
    """Create `path` 0600 with `token`; an existing file is never overwritten."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")


def resolve_admin_token(token: str | None, token_file: Path | None) -> tuple[str, str]:
    """(token, where it came from): the given token, else the file's, else a new one there."""
    if token:
        return token, "--admin-token / " + ENV_TOKEN
    path = token_file or default_token_file()
    if path.exists():
        return read_token_file(path), f"read from {path}"
    try:
        write_token_file(path, new_admin_token())
    except FileExistsError:
        pass  # another server created it meanwhile: use that one
    except OSError as exc:
        raise AdminTokenError(
            f"cannot create the admin token file {path}: {exc.strerror} "
            f"(pass --admin-token-file PATH or set {ENV_TOKEN})"
        ) from None
    return read_token_file(path), f"generated into {path} (mode 0600)"
