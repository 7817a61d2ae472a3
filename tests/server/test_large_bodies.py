"""One near-limit body must not stall the server (issue 15).

A session sends a body of many megabytes while another session keeps taking
turns and `/health` keeps being polled. The claims are relative, never a
timing threshold: while the big request is in flight, the other session's
turns complete and `/health` answers. Each test prints the RSS the process
gained while the big body was handled (`pytest -s` shows it).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from array import array
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from recorder.dialects.translate import parse_request
from recorder.log import events as ev
from recorder.model.admission import min_prompt_tokens
from recorder.model.tokenizer import Tokenizer
from tests.server.conftest import Harness, make_harness

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


@contextmanager
def peak_rss() -> Iterator[list[int]]:
    """Sample this process's RSS on a thread; yields [peak gain in bytes] once done."""
    base = _rss()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.005):
            peak[0] = max(peak[0], _rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    gained = [0]
    try:
        yield gained
    finally:
        stop.set()
        sampler.join()
        gained[0] = max(peak[0], _rss()) - base


def big_body(n_chars: int) -> bytes:
    text = "word " * (n_chars // 5)
    return json.dumps(
        {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
    ).encode()


@pytest.fixture
async def wide_harness(tokenizer: Tokenizer, sqlite_url: str) -> AsyncIterator[Harness]:
    """A context of 1M tokens: an 8 MB text passes the length bound and is tokenized."""
    h = await make_harness(
        tokenizer,
        sqlite_url,
        context_length=1_000_000,
        engine_kwargs={"context_length": 1_000_000},
    )
    try:
        yield h
    finally:
        await h.close()


async def _post(h: Harness, sid: str, raw: bytes) -> tuple[int, Any]:
    assert h.http is not None
    headers = {"Authorization": f"Bearer {sid}", "Content-Type": "application/json"}
    async with h.http.post(h.url + "/v1/messages", data=raw, headers=headers) as resp:
        return resp.status, json.loads(await resp.read())


async def _keep_busy(h: Harness, sid: str, done: asyncio.Event) -> tuple[int, int]:
    """Turns of `sid` and `/health` answers completed before `done` is set."""
    assert h.http is not None
    turns = healths = 0
    small = json.dumps(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    )
    while not done.is_set():
        status, _ = await _post(h, sid, small.encode())
        assert status == 200
        if not done.is_set():
            turns += 1
        async with h.http.get(h.url + "/health") as resp:
            assert resp.status == 200
        if not done.is_set():
            healths += 1
    return turns, healths


async def _race(h: Harness, raw: bytes) -> tuple[int, Any, int, int, int]:
    """Send `raw` from one session while another keeps busy; (status, body, turns, healths, rss)."""
    big, other = await h.open_session(), await h.open_session()
    status, _ = await _post(h, other, big_body(10))  # the other session is warm
    assert status == 200
    done = asyncio.Event()
    busy = asyncio.create_task(_keep_busy(h, other, done))
    await asyncio.sleep(0)
    with peak_rss() as gained:
        status, data = await _post(h, big, raw)
        done.set()
    turns, healths = await busy
    rejected = await h.payloads(big, ev.RequestRejected)
    assert len(rejected) == 1 and rejected[0].status == status
    return status, data, turns, healths, gained[0]


async def test_tokenizing_a_big_body_leaves_other_sessions_running(wide_harness: Harness) -> None:
    h = wide_harness
    raw = big_body(8_000_000)
    status, data, turns, healths, gained = await _race(h, raw)
    # 1.6M tokens > 1M: tokenized (piece by piece) until the count passed the
    # context, then refused with that count (issue 24: tokenizing stops there).
    assert status == 400 and "prompt is too long: at least 100" in data["error"]["message"], data
    print(
        f"\n8 MB body, tokenized: {turns} other turns, {healths} /health answers, "
        f"peak RSS +{gained / 2**20:.0f} MB"
    )
    assert turns >= 10 and healths >= 10, (turns, healths)


async def test_a_near_limit_body_is_refused_from_its_length(harness: Harness) -> None:
    h = harness
    raw = big_body(63 * 2**20)
    status, data, turns, healths, gained = await _race(h, raw)
    assert status == 400, data
    assert "prompt is too long: at least" in data["error"]["message"], data
    print(
        f"\n63 MB body, refused by length: {turns} other turns, {healths} /health answers, "
        f"peak RSS +{gained / 2**20:.0f} MB ({gained / len(raw):.1f}x the body)"
    )
    # The body itself is held a few times (bytes, decoded text, message dicts);
    # tokenizer state for 12M tokens would be gigabytes.
    assert gained < 8 * len(raw), gained


def test_the_length_bound_never_overcounts(tokenizer: Tokenizer) -> None:
    texts = [
        "word " * 2000,
        " " * 5000,
        "=" * 3000 + "\n" * 3000,
        "ünïcödé 漢字 🙂 " * 300,
        "<|im_start|>" * 400,
        "".join(chr(c) for c in range(32, 5000)),
    ]
    for text in texts:
        chat = parse_request(
            json.dumps(
                {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
            ).encode()
        )
        assert min_prompt_tokens(chat, tokenizer) <= len(tokenizer.encode(text)), text[:20]


def test_long_texts_encode_to_the_same_ids(tokenizer: Tokenizer) -> None:
    text = "def f(x):\n    return x * 2  # ünï 漢字\n" * 2000
    assert len(text) > 16 * 1024
    assert tokenizer.encode(text) == tokenizer._raw.encode(text, add_special_tokens=False).ids


class CountingTokenizer:
    """The real tokenizer, counting how many long texts it encodes at once."""

    def __init__(self, inner: Tokenizer) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.running = self.most = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, text: str) -> list[int]:
        with self._counted(text):
            return self._inner.encode(text)

    def encode_array(self, text: str, limit: int | None = None) -> array:
        with self._counted(text):
            return self._inner.encode_array(text, limit)

    @contextmanager
    def _counted(self, text: str) -> Iterator[None]:
        if len(text) < 1_000_000:
            yield
            return
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            yield
        finally:
            with self._lock:
                self.running -= 1


async def test_big_bodies_are_tokenized_one_at_a_time(wide_harness: Harness) -> None:
    """Each holds ~90x its text while tokenized: three at once would triple the peak."""
    h = wide_harness
    spy = CountingTokenizer(h.ctx.tokenizer)
    h.ctx.tokenizer = spy  # type: ignore[assignment]
    sids = [await h.open_session() for _ in range(3)]
    raw = big_body(5_500_000)  # 1.1M tokens: tokenized, then refused as too long
    answers = await asyncio.gather(*(_post(h, sid, raw) for sid in sids))
    assert [status for status, _ in answers] == [400, 400, 400], answers
    assert spy.most == 1
