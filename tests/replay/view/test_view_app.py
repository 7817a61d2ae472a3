"""`replay view` without a browser: the read-only store, the runs index, the pages'
numbers against `replay show`'s reduction, escaping, and the token rule."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import sqlalchemy as sa
from aiohttp.test_utils import TestClient, TestServer
from builders import Log, small_logs, write_to

from recorder.log.events import NewEvent, SessionOpened
from recorder.log.store import EventStore, open_store
from recorder.log.store.base import StoreError
from replay import close_session_samples
from replay.reclassify import reclassify
from replay.rules import Rules
from replay.view import charts
from replay.view.app import INDEX, make_app
from replay.view.index import Query, RunIndex, select
from replay.view.readonly import open_readonly
from replay.view.serve import FRESH, is_loopback, view_token

EVIL = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'


async def _client(store: EventStore, token: str | None = None) -> AsyncIterator[TestClient]:
    client = TestClient(TestServer(make_app(store, Rules(), token=token, tokenizer=None)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def logged(store_url: str) -> AsyncIterator[tuple[EventStore, EventStore]]:
    """(writer store with small_logs + an evil session, the viewer's read-only store)."""
    writer = await open_store(store_url, create=True)
    for log in small_logs():
        await write_to(writer, log)
    evil = Log("e-evil").open(instance_id=EVIL, group_index=0)
    body = json.dumps(
        {
            "system": "s",
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": EVIL}],
                },
            ],
        }
    ).encode()
    evil.turn([1, 2, 3], [10, 2], body=body)
    evil.reward(0.25).close()
    await write_to(writer, evil)
    reader = await open_readonly(store_url)
    try:
        yield writer, reader
    finally:
        await reader.close()
        await writer.close()


async def test_readonly_store_refuses_writes(logged: tuple[EventStore, EventStore]) -> None:
    writer, reader = logged
    assert len(await reader.session_ids()) == 5
    with pytest.raises((StoreError, sa.exc.DBAPIError)):
        await reader.save_projection("viewer-must-not-write", [])
    assert "viewer-must-not-write" not in await writer.projection_names()
    before = await writer.last_position()
    # An append went through a read-write connection of the store's own and was written.
    with pytest.raises((StoreError, sa.exc.DBAPIError, sqlite3.Error)):
        await reader.append(
            "viewer-session", [NewEvent(event=SessionOpened(session_id="viewer-session"))]
        )
    assert await writer.last_position() == before


async def test_sqlite_viewer_never_blocks_the_writer(sqlite_url: str) -> None:
    """A reader transaction held open (a slow page) must not delay an append."""
    writer = await open_store(sqlite_url, create=True)
    reader = await open_readonly(sqlite_url)
    try:
        await write_to(writer, small_logs()[0])
        async with reader.read_engine.connect() as conn:  # type: ignore[attr-defined]
            await conn.execute(sa.text("SELECT COUNT(*) FROM events"))  # snapshot held
            await asyncio.wait_for(write_to(writer, small_logs()[1]), timeout=30)
        path = sa.make_url(sqlite_url).database
        assert path is not None
        with sqlite3.connect(path) as db:
            (n,) = db.execute("SELECT COUNT(DISTINCT session_id) FROM events").fetchone()
        assert n == 2
    finally:
        await reader.close()
        await writer.close()


async def test_index_follows_the_log(sqlite_url: str) -> None:
    writer = await open_store(sqlite_url, create=True)
    reader = await open_readonly(sqlite_url)
    try:
        logs = small_logs()
        await write_to(writer, logs[0])
        index = RunIndex(reader)
        await index.refresh()
        assert list(index.rows) == ["a-linear"]
        row = index.rows["a-linear"]
        assert (row.status, row.reward, row.n_turns, row.tito_failed) == ("completed", 1.0, 2, 1)
        before = row.last_position
        await write_to(writer, logs[3])
        await index.refresh()
        assert set(index.rows) == {"a-linear", "d-failed"}
        assert index.rows["d-failed"].status == "failed"
        assert index.rows["a-linear"].last_position == before
        assert index.rows["a-linear"].trained is None  # no projection yet
        await reclassify(writer, Rules())
        await index.refresh()
        for sid in ("a-linear", "d-failed"):
            result = await close_session_samples(writer, sid)
            assert index.rows[sid].trained == sum(sum(s.loss_mask) for s in result.samples)
    finally:
        await reader.close()
        await writer.close()


async def test_select_filters_sorts_and_groups(logged: tuple[EventStore, EventStore]) -> None:
    _, reader = logged
    index = RunIndex(reader)
    await index.refresh()
    rows = list(index.rows.values())
    by_reward = select(rows, Query(sort="reward", desc=True))
    assert [r.session_id for r in by_reward][:3] == ["a-linear", "b-compact", "e-evil"]
    assert [r.session_id for r in select(rows, Query(status="failed"))] == ["d-failed"]
    assert [r.session_id for r in select(rows, Query(instance="i-c"))] == ["c-subagent"]
    assert [r.session_id for r in select(rows, Query(group="i-b#g0"))] == ["b-compact"]
    assert [r.session_id for r in select(rows, Query(text="COMPACT"))] == ["b-compact"]
    assert {r.session_id for r in select(rows, Query(outcome="passed"))} == {
        "a-linear",
        "b-compact",
        "e-evil",
    }


async def test_pages_show_what_the_reducer_builds(logged: tuple[EventStore, EventStore]) -> None:
    """Each session page's sample table holds `close_session_samples`' numbers
    (what `replay show` prints); each sample's token endpoint returns its tokens."""
    writer, reader = logged
    async for client in _client(reader):
        runs = await client.get("/", params={"per": "2", "sort": "session", "dir": "asc"})
        html = await runs.text()
        assert runs.status == 200 and "a-linear" in html and "c-subagent" not in html
        assert "page 1 of 3" in html
        for sid in ("a-linear", "b-compact", "c-subagent", "d-failed"):
            result = await close_session_samples(writer, sid)
            page = await client.get(f"/session/{sid}")
            text = await page.text()
            assert page.status == 200
            assert text.count('<tr class="sample ') == len(result.samples)
            for i, s in enumerate(result.samples):
                assert f'<td class="num ntok">{len(s.tokens)}</td>' in text
                assert f'<td class="num trainable">{sum(s.loss_mask)}</td>' in text
                got = await (await client.get(f"/session/{sid}/sample/{i}/tokens")).json()
                assert [r[0] for r in got["rows"]] == s.tokens[: len(got["rows"])]
                masks = [r[2] for r in got["rows"][s.prompt_len :]]
                assert masks == s.loss_mask[: len(masks)]
                assert got["total"] == len(s.tokens)
        assert (await client.get("/session/nope")).status == 404
        assert (await client.get("/session/a-linear/turn/1")).status == 200
        sample = await (await client.get("/session/a-linear/sample/0")).text()
        regions = sample[sample.index('<ul id="regions">') :]
        assert "TITO mismatch" in regions.split("</ul>")[0]  # turn 1 failed TITO
        assert (await client.get("/session/a-linear/sample/99")).status == 404
        rules = await (await client.get("/rules", params={"dry_run": "1"})).text()
        assert Rules().version in rules and 'id="new-sessions">5<' in rules
        assert await writer.projection_names() == []  # the dry run wrote nothing


async def test_log_text_is_escaped(logged: tuple[EventStore, EventStore]) -> None:
    _, reader = logged
    async for client in _client(reader):
        for path in ("/", "/session/e-evil", "/session/e-evil/turn/0", "/?q=%3Cscript%3E"):
            resp = await client.get(path)
            html = await resp.text()
            assert resp.status == 200
            assert "<script>window" not in html and "<img src=x" not in html, path
            assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
        turn = await (await client.get("/session/e-evil/turn/0")).text()
        assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in turn


async def test_token_required_when_configured(logged: tuple[EventStore, EventStore]) -> None:
    _, reader = logged
    async for client in _client(reader, token="s3cret"):
        assert (await client.get("/")).status == 401
        assert (await client.get("/", params={"token": "wrong"})).status == 401
        ok = await client.get("/", params={"token": "s3cret"})
        assert ok.status == 200
        assert (await client.get("/api/position")).status == 200  # the cookie it set
        client.session.cookie_jar.clear()
        assert (await client.get("/api/position")).status == 401
        bearer = await client.get("/api/position", headers={"Authorization": "Bearer s3cret"})
        assert bearer.status == 200


def test_non_loopback_bind_needs_a_token(tmp_path: Path) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.1")
    fresh, where = view_token("127.0.0.1", None, None)  # loopback: a token of its own
    assert where == FRESH and len(fresh) >= 32 and fresh != view_token("::1", None, None)[0]
    token, where = view_token("0.0.0.0", None, tmp_path / "tok")
    assert token and "generated" in where and (tmp_path / "tok").stat().st_mode & 0o077 == 0
    assert view_token("0.0.0.0", "given", None)[0] == "given"


def test_charts_escape_labels_and_scale() -> None:
    svg = str(charts.bars("outcomes", [(EVIL, 3.0), ("passed", 1.0)]))
    assert "<script>" not in svg and "&lt;script&gt;" in svg
    heights = [float(h) for h in re.findall(r'height="([\d.]+)" fill', svg)]
    assert heights[0] == pytest.approx(3 * heights[1], abs=0.2)  # 0.1 px rounding
    hist = str(charts.histogram("reward", [0.0, 0.0, 0.5, 1.0], bins=2))
    assert re.findall(r"<title>([^<]*)</title>", hist) == ["0: 2", "0.5: 2"]


def test_lanes_draw_each_turn_and_fork() -> None:
    from replay.view.model import Lane

    main = Lane(0, None, "first", [0, 1, 2, 5], "wipe")
    sub = Lane(1, 0, "subagent", [3, 4], "subagent")
    svg = str(charts.lanes([main, sub], "/session/s/turn/"))
    assert re.findall(r'href="/session/s/turn/(\d+)"', svg) == ["0", "1", "2", "5", "3", "4"]
    assert svg.count("<path") == 1  # the subagent forks off chain 0 after its turn 2


def _cells(html: str, name: str) -> dict[str, str]:
    """The projection row `name`'s cells (inner HTML) by their last class."""
    row = html[html.index(f'data-name="{name}"') :].split("</tr>")[0]
    cells = re.findall(r'<td class="([^"]+)">(.*?)</td>', row, flags=re.S)
    return {k.split()[-1]: v.strip() for k, v in cells}


def _kv(cell: str) -> dict[str, int]:
    """A cell's `<span data-kind="k">k 3</span>` items as {"k": 3}."""
    items = re.findall(r'<span data-(?:kind|status)="([^"]+)">[^<]* (\d+)</span>', cell)
    return {k: int(v) for k, v in items}


async def test_rules_page_counts_each_projection(logged: tuple[EventStore, EventStore]) -> None:
    """Per summary projection, the Rules page shows what `replay stats` says of a
    reduction under that projection's rules, and what the projection rows hold."""
    from replay.reclassify import SUMMARY_PREFIX, SessionSummary
    from replay.rules import PRESETS
    from replay.stats import log_stats

    writer, reader = logged
    async for client in _client(reader):
        empty = await (await client.get("/rules")).text()
        assert 'id="projections">none yet' in empty
        runs = {}
        for rules in (Rules(), PRESETS["collapse-final"]):
            report = await reclassify(writer, rules)
            runs[report.summary_projection] = (rules, report)
        html = await (await client.get("/rules")).text()
        assert html.count('<tr class="projection"') == 2
        for name, (rules, report) in runs.items():
            cells = _cells(html, name)
            stats = await log_stats(writer, rules)
            assert rules.version in html[html.index(f'data-name="{name}"') :].split("</tr>")[0]
            assert int(cells["covers"]) == report.covers_position
            assert int(cells["sessions"]) == stats.sessions == report.sessions
            assert int(cells["samples"]) == stats.samples == report.samples
            assert int(cells["trainable"]) == stats.trainable_tokens == report.trainable_after
            assert stats.segment_kinds and stats.sample_statuses  # nothing vacuous
            assert _kv(cells["segment-kinds"]) == stats.segment_kinds
            assert _kv(cells["sample-statuses"]) == stats.sample_statuses
            assert _kv(cells["sample-kinds"]) == report.kinds_after
            rows = await writer.load_projection(name)
            decoder = msgspec.msgpack.Decoder(SessionSummary)
            by_status = Counter(decoder.decode(p).status for _c, _d, p in rows.values())
            assert _kv(cells["session-statuses"]) == dict(by_status)
            assert name.startswith(SUMMARY_PREFIX)
        # collapse-final keeps one sample per session, fan-out more: the rows differ
        counts = [int(_cells(html, n)["samples"]) for n in runs]
        assert counts[0] > counts[1]


async def test_runs_page_answers_while_the_index_is_built(sqlite_url: str) -> None:
    """While a fold is under way (the startup build of a big log), pages answer at
    once with the sessions indexed so far and an "indexing N of M" line; the
    position API reports the progress the open page polls for."""
    writer = await open_store(sqlite_url, create=True)
    reader = await open_readonly(sqlite_url)
    logs = small_logs()
    try:
        await write_to(writer, logs[0])
        async for client in _client(reader):
            index = client.server.app[INDEX]
            await index.refresh()  # after the startup build
            assert "a-linear" in await (await client.get("/")).text()
            await write_to(writer, logs[1])
            mid = await writer.last_position()
            for log in logs[2:]:
                await write_to(writer, log)
            head = await writer.last_position()
            await index.refresh(until=mid)
            async with index._lock:  # a fold under way, as at startup
                assert index.indexing
                page = await asyncio.wait_for(client.get("/"), timeout=30)
                html = await page.text()
                assert page.status == 200
                shown = set(re.findall(r'data-session="([^"]+)"', html))
                assert shown == {"a-linear", "b-compact"}
                line = html[html.index('id="indexing"') :].split("</p>")[0]
                assert f"{mid} of {head} events" in line
                pos = await (await client.get("/api/position")).json()
                assert (pos["position"], pos["head"], pos["indexing"]) == (mid, head, True)
                assert pos["sessions"] == 2
                assert (await client.get("/session/a-linear")).status == 200
            html = await (await client.get("/")).text()
            assert 'id="indexing"' not in html
            shown = set(re.findall(r'data-session="([^"]+)"', html))
            assert shown == {log.session_id for log in logs}
            pos = await (await client.get("/api/position")).json()
            assert (pos["position"], pos["indexing"]) == (head, False)
    finally:
        await reader.close()
        await writer.close()
