"""Run the viewer: bind loopback by default; every bind needs a token (a fresh one on loopback)."""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from recorder.admin_token import resolve_admin_token
from replay.rules import Rules
from replay.view.app import make_app
from replay.view.readonly import open_readonly


def is_loopback(host: str) -> bool:
    """True when every address `host` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addrs = {info[4][0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


# Where a loopback view's own token is: only in the URL it prints.
FRESH = "in the URL above"


def view_token(host: str, token: str | None, token_file: Path | None) -> tuple[str, str]:
    """(token, where from). A loopback bind without one gets a fresh token of its own,
    shown only in the URL it prints: local sandboxes share this machine's loopback, and
    an audit's agent listed every session id (an agent's key) and prompt through a
    tokenless view. Any other bind takes the admin token rules (given, else the token
    file, else one generated into it)."""
    if is_loopback(host) and token is None and token_file is None:
        return secrets.token_urlsafe(24), FRESH
    return resolve_admin_token(token, token_file)


async def serve(
    db: str,
    rules: Rules,
    *,
    host: str,
    port: int,
    token: str | None,
    tokenizer: str | None,
    on_ready: Callable[[str], None],
) -> None:
    store = await open_readonly(db)
    try:
        app = make_app(store, rules, token=token, tokenizer=tokenizer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0]
        shown = f"[{bound[0]}]" if ":" in str(bound[0]) else bound[0]
        on_ready(f"http://{shown}:{bound[1]}/")
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
    finally:
        await store.close()
