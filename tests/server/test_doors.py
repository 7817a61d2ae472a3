"""Open doors (issue 15): the admin API is always authenticated, JSON only, and no
secret reaches a log line, an error, or another user of the machine."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from recorder.admin_token import AdminTokenError, read_token_file, resolve_admin_token
from recorder.dialects.errors import error_payload
from recorder.redact import RedactingFilter, redact, register_secret
from tests.server.conftest import FIXTURE_TOKENIZER, Harness
from tests.server.test_e2e import ask


async def test_agent_cannot_close_its_own_session(harness: Harness) -> None:
    """No --admin-token given: still a token, and the agent's key is not it."""
    h = harness
    assert h.http is not None and len(h.config.admin_token) >= 32
    sid = await h.open_session()
    await ask(h.client(sid), [{"role": "user", "content": "hi"}], stream=False)
    for key in ({"Authorization": f"Bearer {sid}"}, {"x-api-key": sid}):
        async with h.http.post(
            h.url + f"/sessions/{sid}/close", json={"reward": 1.0}, headers=key
        ) as resp:
            assert resp.status == 401, await resp.text()
    status, data = await h.admin("POST", f"/sessions/{sid}/close", {"reward": 0.25})
    assert status == 200, data
    assert {s["reward"] for s in data["samples"]} == {0.25}


async def test_a_session_id_cannot_be_the_admin_token(harness: Harness) -> None:
    status, data = await harness.admin(
        "POST", "/sessions", {"session_id": harness.config.admin_token}
    )
    assert status == 400 and "secret" in data["error"]["message"]
    assert harness.config.admin_token not in str(data)


async def test_admin_bodies_must_be_json(harness: Harness) -> None:
    """The CORS-simple POST a browser page may send to loopback is refused."""
    h = harness
    assert h.http is not None
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = h.admin_headers()
        if content_type:
            headers["Content-Type"] = content_type
        async with h.http.post(h.url + "/sessions", data=b"{}", headers=headers) as resp:
            data = await resp.json()
            assert resp.status == 415, (content_type, data)
            assert "application/json" in data["error"]["message"]
    async with h.http.post(
        h.url + "/sessions", data=b"{}", headers={"Content-Type": "text/plain"}
    ) as resp:
        assert resp.status == 401  # no token: refused before the body is looked at
    sid = await h.open_session()
    status, _ = await h.admin("GET", f"/sessions/{sid}")  # no body, no content type: fine
    assert status == 200


def test_redact_urls_keywords_and_registered_secrets() -> None:
    register_secret("tok-abcdef-123")
    text = (
        "connect postgresql+asyncpg://trainer:hunter2@db:5432/runs failed; "
        "dsn host=db password=hunter2 user=x; token tok-abcdef-123"
    )
    clean = redact(text)
    assert "hunter2" not in clean and "tok-abcdef-123" not in clean
    assert "postgresql+asyncpg://trainer:***@db:5432/runs" in clean
    assert redact("sqlite+aiosqlite:////tmp/runs.db") == "sqlite+aiosqlite:////tmp/runs.db"
    assert "hunter2" not in error_payload("api_error", text)["error"]["message"]


def test_log_filter_redacts_arguments_and_tracebacks() -> None:
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "db %s", ("pg://u:pw1@h/d",), None)
    try:
        raise OSError("cannot reach pg://u:pw1@h/d")
    except OSError:
        record.exc_info = sys.exc_info()
    RedactingFilter().filter(record)
    assert "pw1" not in record.getMessage() and "pw1" not in (record.exc_text or "")


async def test_store_error_answer_is_redacted(harness: Harness) -> None:
    """A store failure whose text carries the URL reaches the client without its password."""
    h = harness
    sid = await h.open_session()
    secret_url = "postgresql+asyncpg://trainer:hunter2@db/runs"

    async def failing_append(*args: Any, **kwargs: Any) -> Any:
        from recorder.log.store import StoreError

        raise StoreError(f"could not write to {secret_url}")

    h.store.append_batch = failing_append  # type: ignore[method-assign]
    h.store.append = failing_append  # type: ignore[method-assign]
    async with h.http.post(  # type: ignore[union-attr]
        h.url + "/v1/messages",
        json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-api-key": sid},
    ) as resp:
        body = await resp.text()
    assert resp.status >= 500 and "hunter2" not in body, body


def test_token_file_created_0600_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "state" / "admin-token"
    token, where = resolve_admin_token(None, path)
    assert str(path) in where and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert resolve_admin_token(None, path)[0] == token  # the next start reuses it
    assert resolve_admin_token("given", path)[0] == "given"
    path.chmod(0o644)
    with pytest.raises(AdminTokenError, match="chmod 600"):
        read_token_file(path)


async def test_sqlite_log_and_wal_are_private(harness: Harness, sqlite_url: str) -> None:
    sid = await harness.open_session()
    await ask(harness.client(sid), [{"role": "user", "content": "hi"}], stream=False)
    db = Path(sqlite_url.split("///", 1)[1])
    for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        assert path.exists(), path
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


async def _wait_healthy(base: str, proc: subprocess.Popen[bytes]) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        while proc.poll() is None:
            try:
                async with http.get(base + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)


async def test_serve_startup_log_names_the_token_file_not_the_token(
    tokenizer: Any, tmp_path: Path
) -> None:
    """`recorder serve` without a token: one is generated into a 0600 file the log names."""
    from recorder.server import free_port
    from tools.test_engine.scripted import ScriptedEngine

    token_file = tmp_path / "admin-token"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TR_ADMIN_TOKEN")}
    env["TR_ADMIN_TOKEN_FILE"] = str(token_file)
    async with ScriptedEngine(tokenizer, context_length=4096) as engine:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "recorder.cli", "serve", "--db", str(tmp_path / "r.db"),
             "--engine", engine.url, "--tokenizer", str(FIXTURE_TOKENIZER),
             "--chat-template", "chatml-tools", "--port", str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        try:
            await _wait_healthy(f"http://127.0.0.1:{port}", proc)
        finally:
            proc.terminate()
            out = (await asyncio.to_thread(proc.communicate, timeout=60))[0].decode()
    token = token_file.read_text().strip()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert f"admin API token: generated into {token_file}" in out, out
    assert token not in out
