"""The recorder's admin API as the rollout driver uses it, over HTTP only.

Errors (both `RecorderError`): `RecorderUnreachable` (no connection, a
timeout or a 5xx: infrastructure, the rollout is aborted) and
`RecorderRefused` (a 4xx: the request was wrong; its message is the
recorder's own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aiohttp
import msgspec

from replay.samples import SessionResult


class RecorderError(Exception):
    """Base of the errors talking to the recorder."""


class RecorderUnreachable(RecorderError):
    """No answer (connection refused, timeout) or a 5xx: check that the recorder runs."""


class RecorderRefused(RecorderError):
    """The recorder answered 4xx; `status` and the recorder's message say why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"recorder answered {status}: {message}")
        self.status = status


class RolloutEvent(msgspec.Struct, frozen=True):
    kind: str
    detail: dict[str, Any] = {}


def local_admin_token() -> str | None:
    """The token in TR_ADMIN_TOKEN_FILE or the default token file, if one is readable."""
    import os
    from pathlib import Path

    from recorder.admin_token import (
        ENV_TOKEN_FILE,
        AdminTokenError,
        default_token_file,
        read_token_file,
    )

    path = Path(os.environ.get(ENV_TOKEN_FILE) or default_token_file())
    try:
        return read_token_file(path) if path.exists() else None
    except AdminTokenError:
        return None


class RecorderClient:
    """One HTTP connection pool to one recorder; use as `async with RecorderClient(url):`."""

    def __init__(self, url: str, admin_token: str | None = None, *, timeout_s: float = 120.0):
        """No `admin_token`: the one a recorder on this machine wrote to its token file."""
        self.url = url.rstrip("/")
        token = admin_token or local_admin_token()
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RecorderClient:
        self._http = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def _call(self, method: str, path: str, body: Any = None) -> bytes:
        assert self._http is not None, "use `async with RecorderClient(...)`"
        data = None if body is None else msgspec.json.encode(body)
        try:
            async with self._http.request(
                method,
                self.url + path,
                data=data,
                headers={"Content-Type": "application/json"} if data is not None else None,
            ) as resp:
                payload = await resp.read()
                if resp.status >= 500:
                    raise RecorderUnreachable(f"{method} {path}: {resp.status} {_message(payload)}")
                if resp.status >= 400:
                    raise RecorderRefused(resp.status, f"{method} {path}: {_message(payload)}")
                return payload
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise RecorderUnreachable(
                f"{method} {self.url}{path}: {type(exc).__name__}: {exc}; is the recorder running?"
            ) from exc

    async def open_session(
        self, session_id: str, metadata: dict[str, Any], config: dict[str, Any]
    ) -> dict[str, Any]:
        body = {"session_id": session_id, "metadata": metadata, "config": config}
        return msgspec.json.decode(await self._call("POST", "/sessions", body))

    async def append_events(self, session_id: str, events: Sequence[RolloutEvent]) -> None:
        if events:
            await self._call("POST", f"/sessions/{session_id}/events", {"events": list(events)})

    async def context_length(self) -> int:
        """The recorder's context length in tokens (`GET /health`)."""
        health = msgspec.json.decode(await self._call("GET", "/health"))
        return int(health["context_length"])

    async def inspect(self, session_id: str) -> dict[str, Any]:
        return msgspec.json.decode(await self._call("GET", f"/sessions/{session_id}"))

    async def close_session(
        self,
        session_id: str,
        *,
        status: str = "completed",
        reward: float | None = None,
        reward_detail: dict[str, Any] | None = None,
        reason: str = "",
    ) -> SessionResult:
        body: dict[str, Any] = {"status": status, "reason": reason}
        if reward is not None:
            body["reward"] = reward
            body["reward_detail"] = reward_detail or {}
        payload = await self._call("POST", f"/sessions/{session_id}/close", body)
        return msgspec.json.decode(payload, type=SessionResult)


def _message(payload: bytes) -> str:
    try:
        data = msgspec.json.decode(payload)
        return str(data["error"]["message"])
    except Exception:
        return payload[:500].decode(errors="replace")
