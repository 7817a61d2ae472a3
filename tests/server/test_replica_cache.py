"""What a replica keeps cached (issue 24, item 2), on a real Postgres shared by two replicas.

A replica's sessions are a cache of the log. Without the close watch
(closes.py) a session served on replica A and closed on replica B stayed on A
as `open`, with its token chains, for as long as A lived: each test below
shows that state first (the watch not yet run, or switched off) and then that
one poll of the log (one `--close-watch-interval`) drops it, under the
README's sticky recipe (turns hashed by session token, every admin close on
one replica) and under random routing. The memory bound is tested with
sessions bigger than it: the cache never holds more, and a session that had
to leave memory is rebuilt from the log for its next turn with the very
tokens it would have had if it had stayed.
"""

from __future__ import annotations

import asyncio
import random
import zlib
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest

from recorder.model.tokenizer import Tokenizer
from recorder.server.closes import CloseWatch
from tests.server.conftest import Harness, make_harness
from tests.server.test_lifecycle import _admin, _start_serve
from tools.test_engine.scripted import ScriptedEngine

SESSIONS = 8
TURNS = 2


async def _health(base: str) -> Any:
    async with aiohttp.ClientSession() as http, http.get(base + "/health") as resp:
        return await resp.json()


async def _turn(base: str, sid: str, text: str) -> None:
    client = anthropic.AsyncAnthropic(base_url=base, api_key=sid, max_retries=0)
    try:
        await client.messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": text}]
        )
    finally:
        await client.close()


def _hashed(bases: list[str], token: str) -> str:
    """The README's sticky recipe: a consistent hash of the bearer token picks the replica."""
    return bases[zlib.crc32(token.encode()) % len(bases)]


@pytest.mark.postgres
@pytest.mark.parametrize("routing", ["sticky", "random"])
async def test_one_poll_drops_every_session_closed_on_the_other_replica(
    tokenizer: Tokenizer, postgres_url: str, routing: str
) -> None:
    """Sessions served on both replicas, closed on either (sticky: all closes on the
    admin token's replica). Before the watch polls, a replica holds sessions closed
    elsewhere as open (the defect); after one poll each, neither does, in its cache
    and in `/health` `sessions_open`, and the dropped ones are refused as closed."""
    from recorder.log.store import open_store

    rng = random.Random(24)
    h = await make_harness(tokenizer, postgres_url, admin_token="tok", close_watch_interval_s=0)
    store = await open_store(postgres_url)
    other = await h.server_on(store)
    servers = [h.server, other]
    bases = [h.url, other.url]
    watches = [CloseWatch(s.ctx.store, s.ctx.registry) for s in servers if s is not None]
    try:
        for watch in watches:
            assert await watch.poll() == 0  # the head this replica starts from
        route = (lambda token: _hashed(bases, token)) if routing == "sticky" else None

        def pick(token: str) -> str:
            return route(token) if route is not None else rng.choice(bases)

        ids = [
            (await _admin(pick("tok"), "POST", "/sessions", {}))["session_id"]
            for _ in range(SESSIONS)
        ]
        for t in range(TURNS):
            for sid in ids:
                await _turn(pick(sid), sid, f"turn {t}")
        closed_on = {sid: pick("tok") for sid in ids}
        for sid, base in closed_on.items():
            assert (await _admin(base, "POST", f"/sessions/{sid}/close", {"reward": 1.0}))["status"]
        stale = [
            sum(
                1
                for sid in ids
                if closed_on[sid] != base
                and (state := server.ctx.registry.cached(sid)) is not None
                and state.status == "open"
            )
            for base, server in zip(bases, servers, strict=True)
            if server is not None
        ]
        before = [(await _health(base))["sessions_open"] for base in bases]
        assert before == stale and sum(stale) > 0, (before, stale)  # what the watch is for

        dropped = [await watch.poll() for watch in watches]
        after = [await _health(base) for base in bases]
        print(f"\n{routing}: open before the poll {before}, dropped {dropped}")
        assert dropped == stale
        assert [a["sessions_open"] for a in after] == [0, 0], after
        assert [a["sessions_closed_elsewhere"] for a in after] == stale
        for server in servers:
            assert server is not None
            assert server.ctx.registry.open_count() == 0
            held = [sid for sid in ids if server.ctx.registry.cached(sid) is not None]
            # What is left is what this replica closed itself (bounded among the closed).
            assert all(closed_on[sid] == server.url for sid in held), held
        sid = ids[0]
        client = anthropic.AsyncAnthropic(base_url=bases[0], api_key=sid, max_retries=0)
        try:
            with pytest.raises(anthropic.APIStatusError) as refused:
                await client.messages.create(
                    model="m", max_tokens=8, messages=[{"role": "user", "content": "after"}]
                )
        finally:
            await client.close()
        assert refused.value.status_code == 409
    finally:
        await other.stop(grace_s=1)
        await store.close()
        await h.close()


@pytest.mark.postgres
async def test_serve_options_drop_closes_made_elsewhere_and_off_keeps_them(
    tokenizer: Tokenizer, postgres_url: str
) -> None:
    """Two `recorder serve` processes: A with `--close-watch-interval 0.1`, B with 0 (the
    code before the watch). Every session is served on both and closed on the other
    replica of its first turn. A drops every session B closed; B, the peer, still
    holds as open every one A closed. `/health` reports the options as given."""
    async with ScriptedEngine(tokenizer, context_length=4096) as engine:
        a = await _start_serve(
            engine.url, postgres_url, "--close-watch-interval", "0.1", "--max-cached-mb", "64"
        )
        b = await _start_serve(engine.url, postgres_url, "--close-watch-interval", "0")
        bases = [a[1], b[1]]
        try:
            health_a, health_b = await _health(bases[0]), await _health(bases[1])
            assert (health_a["close_watch_s"], health_a["sessions_max_mb"]) == (0.1, 64)
            assert (health_b["close_watch_s"], health_b["sessions_max_mb"]) == (0, 4096)
            ids = [
                (await _admin(bases[i % 2], "POST", "/sessions", {}))["session_id"]
                for i in range(SESSIONS)
            ]
            for i, sid in enumerate(ids):
                for t in range(TURNS):
                    await _turn(bases[(i + t) % 2], sid, f"turn {t}")
            for i, sid in enumerate(ids):
                await _admin(bases[(i + 1) % 2], "POST", f"/sessions/{sid}/close", {})
            for _ in range(400):
                health_a = await _health(bases[0])
                if health_a["sessions_open"] == 0:
                    break
                await asyncio.sleep(0.05)
            health_b = await _health(bases[1])
            print(f"\nwatch on: {health_a}\nwatch off: {health_b}")
            assert health_a["sessions_open"] == 0, health_a
            assert health_a["sessions_closed_elsewhere"] == SESSIONS // 2
            assert health_b["sessions_open"] == SESSIONS // 2, health_b  # the defect, kept
            assert health_b["sessions_closed_elsewhere"] == 0
        finally:
            for proc, _ in (a, b):
                proc.terminate()
                await proc.wait()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(["alpha", "bravo", "delta", "kilo", "zulu"]) for _ in range(words))


async def _conversations(h: Harness, sessions: int, turns: int, bound: int | None) -> list[str]:
    """`sessions` conversations of `turns` turns, taken in turn (each turn sends the whole
    conversation so far); after each turn the cache holds at most `bound` bytes."""
    rng = random.Random(7)
    ids = [await h.open_session() for _ in range(sessions)]
    history: dict[str, list[dict[str, Any]]] = {sid: [] for sid in ids}
    for t in range(turns):
        for sid in ids:
            messages = history[sid]
            messages.append({"role": "user", "content": f"turn {t}: " + _text(rng, 400)})
            answer = await h.client(sid).messages.create(
                model="m", max_tokens=16, messages=messages
            )
            messages.append({"role": "assistant", "content": answer.content[0].text})  # type: ignore[union-attr]
            if bound is not None:
                assert h.ctx.registry.held_total <= bound
    return ids


async def test_the_memory_bound_holds_and_an_evicted_session_resumes_token_exact(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """Six sessions of about 30 KB each under a 0.1 MB bound: after every turn the cache
    holds at most 0.1 MB (`held_total`, `/health` `sessions_held_mb`); sessions leave
    memory and are rebuilt from the log; the engine gets, turn for turn, the same
    prompt tokens as a server with no bound that kept every session, and the
    sessions' samples are the same."""
    bound_mb = 0.1
    bound = int(bound_mb * (1 << 20))
    bounded = await make_harness(
        tokenizer, f"sqlite+aiosqlite:///{tmp_path / 'a.db'}", max_cached_mb=bound_mb
    )
    kept = await make_harness(tokenizer, f"sqlite+aiosqlite:///{tmp_path / 'b.db'}")
    try:
        ids = await _conversations(bounded, 6, 3, bound)
        kept_ids = await _conversations(kept, 6, 3, None)
        registry = bounded.ctx.registry
        assert registry.shed > 0 and registry.loads > 0, (registry.shed, registry.loads)
        assert kept.ctx.registry.shed == 0 and kept.ctx.registry.held_total > bound
        assert bounded.engine.requests and len(bounded.engine.requests) == len(kept.engine.requests)
        for shed, whole in zip(bounded.engine.requests, kept.engine.requests, strict=True):
            assert shed.input_ids == whole.input_ids
        assert bounded.http is not None
        async with bounded.http.get(bounded.url + "/health") as resp:
            health = await resp.json()
        assert health["sessions_held_mb"] <= bound_mb and health["sessions_shed"] > 0, health
        for sid, kept_sid in zip(ids, kept_ids, strict=True):
            status, samples = await bounded.admin("POST", f"/sessions/{sid}/close", {})
            assert status == 200, samples
            status, kept_samples = await kept.admin("POST", f"/sessions/{kept_sid}/close", {})
            assert status == 200, kept_samples
            assert [
                (s["tokens"], s["loss_mask"], s["rollout_logprobs"]) for s in samples["samples"]
            ] == [
                (s["tokens"], s["loss_mask"], s["rollout_logprobs"])
                for s in kept_samples["samples"]
            ]
    finally:
        await bounded.close()
        await kept.close()
