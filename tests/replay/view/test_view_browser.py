"""`replay view` in a real browser: Debian's chromium driven by Playwright.

Logs recorded by the quickstart (`tools/quickstart.py`) and by a real rollout
(`tools/quickstart_rollout.py`, Claude Code in a local sandbox) are served by
`replay view` as a subprocess; the tests click runs -> session -> turn ->
sample and check the numbers against `replay show` and `replay export`, that
nothing logs a console error, that text from the log never executes, and that
an open page shows a turn appended to a live log. Screenshots are kept under
artifacts/view/ (or $TR_ARTIFACTS).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from builders import Log, _rewrite_refs, write_to

from recorder.log.events import NewEvent
from recorder.log.store import open_store
from tests.conftest import REPO, claude_code_binary, missing

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("TR_CHROMIUM", "/usr/bin/chromium")
TOKENIZER = REPO / "tests" / "data" / "smollm2-tokenizer"
EVIL = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}


def _run(coro: Any) -> Any:
    """Run a coroutine to completion on another thread (Playwright's sync API keeps
    an event loop running on this one)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def artifacts() -> Path:
    out = Path(os.environ.get("TR_ARTIFACTS", REPO / "artifacts")) / "view"
    out.mkdir(parents=True, exist_ok=True)
    return out


# -------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("playwright is not installed", "bash tools/setup.sh (pip install playwright)")
    if not Path(CHROMIUM).exists():
        missing(f"no chromium at {CHROMIUM}", "bash tools/setup.sh (apt-get install chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM)
        try:
            yield b
        finally:
            b.close()


class Viewer:
    """`replay view --port 0` on a log, as a subprocess; `url` is where it listens."""

    def __init__(self, db: Path, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "replay.cli", "view", "--db", str(db), "--port", "0", *extra],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        # Loopback too needs the token: the view prints a fresh one in its URL.
        found = re.search(r"(http://\S+/)\?token=(\S+)", line)
        if found is None:
            self.proc.kill()
            raise AssertionError(f"replay view did not start: {line}{self.proc.stdout.read()}")
        self.url = found.group(1).rstrip("/")
        self.token = found.group(2)

    def page(self, browser: Any) -> Page:
        return Page(browser, self.url, self.token)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def quickstart_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("view-quickstart") / "qs.db"
    done = subprocess.run(
        [sys.executable, "-m", "tools.quickstart", "--db", str(db)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return db


@pytest.fixture(scope="module")
def rollout_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    claude_code_binary()
    done = subprocess.run(
        [sys.executable, "-m", "tools.quickstart_rollout", "--samples", "1", "--keep"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    kept = re.search(r"kept (\S+)", done.stdout)
    assert kept, done.stdout
    scratch = Path(kept.group(1))
    db = tmp_path_factory.mktemp("view-rollout") / "runs.db"
    shutil.copy(scratch / "runs.db", db)
    shutil.rmtree(scratch, ignore_errors=True)
    yield db


def _export(db: Path, tmp: Path) -> dict[str, list[dict[str, Any]]]:
    """`replay export` of the log: samples per session, in order."""
    out = tmp / "export.jsonl"
    subprocess.run(
        [sys.executable, "-m", "replay.cli", "export", "--db", str(db), "--out", str(out)],
        cwd=REPO,
        env=_env(),
        check=True,
        capture_output=True,
    )
    per: dict[str, list[dict[str, Any]]] = {}
    for line in out.read_text().splitlines():
        s = json.loads(line)
        per.setdefault(s["session_id"], []).append(s)
    return per


def _show_rows(db: Path, sid: str) -> list[list[str]]:
    """The sample rows `replay show` prints: [#, kind, turns, tokens, trainable, status, reward]."""
    out = subprocess.run(
        [sys.executable, "-m", "replay.cli", "show", "--db", str(db), "--session", sid],
        cwd=REPO,
        env=_env(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    table = out[out.index("samples under rules") :]
    rows = [[c.strip() for c in line.strip("│").split("│")] for line in table.splitlines()]
    return [r[:7] for r in rows if len(r) >= 7 and r[0].isdigit()]


def _tito_headings(db: Path, sid: str, turn: int) -> list[str]:
    """The comparison headings `replay tito --turn` prints ("title: N vs M ids, status")."""
    out = subprocess.run(
        [
            *(sys.executable, "-m", "replay.cli", "tito", "--db", str(db), "--session", sid),
            *("--turn", str(turn), "--tokenizer", str(TOKENIZER)),
        ],
        cwd=REPO,
        env=_env(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    found = [" ".join(x.split()) for x in re.findall(r"^(.*: \d+ vs \d+ ids, .*)$", out, re.M)]
    assert len(found) == 2, out
    return found


def _dry_run_counts(db: Path) -> list[str]:
    """(changed segmentation, changed samples, new) as `replay reclassify --dry-run` prints."""
    out = subprocess.run(
        [sys.executable, "-m", "replay.cli", "reclassify", "--db", str(db), "--dry-run"],
        cwd=REPO,
        env=_env(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    found = re.search(r"(\d+) sessions changed segmentation, (\d+) changed samples, (\d+) new", out)
    assert found, out
    return list(found.groups())


class Page:
    """A Playwright page that records console errors and page errors."""

    def __init__(self, browser: Any, base: str, token: str | None = None) -> None:
        self.page = browser.new_page(viewport={"width": 1300, "height": 900})
        if token is not None:  # an app made without one (in process) needs none
            self.page.set_extra_http_headers({"Authorization": f"Bearer {token}"})
        # Generous: the first turn page loads the tokenizer, on a shared 2-core machine.
        self.page.set_default_timeout(120_000)
        self.base = base
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))

    def goto(self, path: str) -> Any:
        resp = self.page.goto(self.base + path)
        assert resp is not None and resp.status == 200, path
        return self.page

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(artifacts() / f"{name}.png"))

    def load_all_tokens(self) -> None:
        """Scroll until the sample page has loaded every chunk of tokens."""
        p = self.page
        for _ in range(200):
            if p.get_attribute("#more", "data-done") == "1":
                return
            p.locator("#more").scroll_into_view_if_needed()
            p.wait_for_timeout(100)
        raise AssertionError("the sample's tokens never finished loading")


def _check_session(pg: Page, db: Path, sid: str, exported: list[dict[str, Any]], tag: str) -> None:
    """Session page vs `replay show` and `replay export`; then every turn and sample page."""
    p = pg.page
    shown = _show_rows(db, sid)
    rows = p.locator("#samples tbody tr")
    assert rows.count() == len(shown) == len(exported)
    for k, (want, exp) in enumerate(zip(shown, exported, strict=True)):
        cells = [c.strip() for c in rows.nth(k).locator("td").all_inner_texts()]
        assert cells[1] == want[1] == exp["metadata"]["segment_kind"]
        assert int(cells[3]) == int(want[3]) == len(exp["tokens"])
        assert int(cells[4]) == int(want[4]) == sum(exp["loss_mask"])
        assert float(cells[6]) == pytest.approx(exp["reward"])
    lanes = p.locator("#lanes .lane")
    assert lanes.count() >= len({e["metadata"]["chain_id"] for e in exported})
    pg.shot(f"{tag}-session")
    turn_hrefs = p.locator("#turn-links a").evaluate_all("els => els.map(e => e.href)")
    assert turn_hrefs
    for href in turn_hrefs:
        p.goto(href)
        assert p.locator("#n-output").inner_text().isdigit()
        assert p.locator("#output-tokens .tok").count() == int(p.locator("#n-output").inner_text())
    pg.shot(f"{tag}-turn")
    for k, exp in enumerate(exported):
        pg.goto(f"/session/{sid}")
        p.locator(f"#samples tbody tr >> nth={k} >> a").first.click()
        p.wait_for_url(re.compile(rf"/sample/{k}$"))
        pg.load_all_tokens()
        assert p.locator("#sample-tokens .tok").count() == len(exp["tokens"])
        assert p.locator("#sample-tokens .tok.m1").count() == sum(exp["loss_mask"])
        assert int(p.locator("#n-trainable").inner_text()) == sum(exp["loss_mask"])
        assert float(p.locator("#reward").inner_text()) == pytest.approx(exp["reward"])
        assert p.locator("#status").inner_text() == exp["status"]
        if k == 0:
            pg.shot(f"{tag}-sample")


# -------------------------------------------------------------- tests


def test_quickstart_log_click_through(browser: Any, quickstart_db: Path, tmp_path: Path) -> None:
    exported = _export(quickstart_db, tmp_path)
    viewer = Viewer(quickstart_db)
    try:
        # On loopback too: local sandboxes share it, so no page without the token.
        for path in ("/", f"/session/{next(iter(exported))}"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(viewer.url + path, timeout=30)
            assert refused.value.code == 401, path
        pg = viewer.page(browser)
        p = pg.goto("/")
        assert p.locator("tr.run").count() == len(exported) == 1
        assert p.locator("svg.chart").count() == 5
        pg.shot("quickstart-runs")
        (sid,) = exported
        p.locator("a.sid").first.click()
        p.wait_for_url(re.compile(r"/session/"))
        _check_session(pg, quickstart_db, sid, exported[sid], "quickstart")
        for turn in (0, 3):  # the page's TITO comparisons are `replay tito --turn`'s
            pg.goto(f"/session/{sid}/turn/{turn}")
            p.locator("#rerender").click()
            p.wait_for_url(re.compile(r"rerender=1"))
            shown = [" ".join(h.split()) for h in p.locator("h3").all_inner_texts()]
            assert shown == _tito_headings(quickstart_db, sid, turn)
        pg.shot("quickstart-tito")
        pg.goto("/rules")
        p.locator("#dry-run").click()
        p.wait_for_selector("#report")
        page_counts = [p.locator(f"#{k}").inner_text() for k in ("changed-seg", "changed-samples")]
        page_counts.append(p.locator("#new-sessions").inner_text())
        assert page_counts == _dry_run_counts(quickstart_db)
        pg.shot("quickstart-rules")
        assert pg.errors == [] and pg.dialogs == []
    finally:
        viewer.stop()


@pytest.mark.claude
def test_rollout_log_click_through(browser: Any, rollout_db: Path, tmp_path: Path) -> None:
    exported = _export(rollout_db, tmp_path)
    viewer = Viewer(rollout_db)
    try:
        pg = viewer.page(browser)
        p = pg.goto("/?sort=group")
        assert p.locator("tr.run").count() == len(exported) == 3
        assert p.locator("td.oc").all_inner_texts() == ["passed"] * 3
        assert p.locator("tr.ghead").count() == 3  # one group per task (one sample each)
        pg.shot("rollout-runs")
        sid = p.locator("tr.run").first.get_attribute("data-session")
        assert sid in exported
        p.locator("a.sid").first.click()
        p.wait_for_url(re.compile(r"/session/"))
        assert "passed" in p.locator("p.good").first.inner_text()
        assert p.locator("text=Diff the agent produced").count() == 1
        _check_session(pg, rollout_db, sid, exported[sid], "rollout")
        assert pg.errors == [] and pg.dialogs == []
    finally:
        viewer.stop()


def _evil_log(tok: Any) -> Log:
    log = Log("evil-session").open(instance_id=EVIL, group_index=0)
    body = json.dumps(
        {
            "system": EVIL,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "B"}]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": EVIL}],
                },
            ],
        }
    ).encode()
    prompt = list(tok.encode("tool said: " + EVIL))
    log.turn(prompt, [*tok.encode(EVIL), 2], body=body, tito_ok=False, reencoded=[1])
    return log.reward(0.5).close()


def test_nothing_from_the_log_runs(browser: Any, tmp_path: Path) -> None:
    """`<script>` and an `<img onerror>` in a tool result, the system prompt, the
    metadata and the very tokens: every page shows them as text, none runs."""
    from recorder.model.tokenizer import load_tokenizer

    db = tmp_path / "evil.db"

    async def write() -> None:
        store = await open_store(str(db), create=True)
        try:
            await write_to(store, _evil_log(load_tokenizer(str(TOKENIZER))))
        finally:
            await store.close()

    _run(write())
    viewer = Viewer(db, "--tokenizer", str(TOKENIZER))
    try:
        pg = viewer.page(browser)
        for path in ("/", "/session/evil-session", "/session/evil-session/turn/0"):
            p = pg.goto(path)
            p.wait_for_timeout(300)
            assert EVIL in p.inner_text("main"), path
        p = pg.goto("/session/evil-session/sample/0")
        pg.load_all_tokens()
        p.wait_for_timeout(300)
        assert EVIL in p.inner_text("#sample-tokens")
        pg.shot("escaping-sample")
        assert p.evaluate("window.__pwned") is None
        assert p.locator("img").count() == 0
        assert p.evaluate("document.scripts.length") == 1
        assert pg.dialogs == [] and pg.errors == []
    finally:
        viewer.stop()


async def _append_new(store: Any, log: Log, from_seq: int) -> None:
    """Append the events of `log` from `from_seq` on (its arrays are stored again: a no-op)."""
    mapping = {d: await store.put_array(a) for d, a in log.arrays.items()}

    events = [
        NewEvent(event=_rewrite_refs(r.event, mapping), event_id=r.event_id, ts=r.ts)  # type: ignore[arg-type]
        for r in sorted(log.events, key=lambda r: r.seq)
        if r.seq >= from_seq
    ]
    await store.append(log.session_id, events)


def test_open_pages_follow_a_live_log(browser: Any, tmp_path: Path) -> None:
    db = tmp_path / "live.db"
    live = Log("live-1").open(instance_id="i-live")
    t = live.turn([1, 2, 3], [10, 11])

    async def write(log: Log, from_seq: int = 0) -> None:
        store = await open_store(str(db), create=True)
        try:
            await (_append_new(store, log, from_seq) if from_seq else write_to(store, log))
        finally:
            await store.close()

    _run(write(live))
    viewer = Viewer(db)
    try:
        runs = viewer.page(browser)
        runs.goto("/")
        session = viewer.page(browser)
        s = session.goto("/session/live-1")
        assert s.locator("#turn-links a").count() == 1
        seen = len(live.events)
        live.turn(t.then([4]), [12, 2])
        _run(write(live, seen))
        s.locator("#turn-links a >> nth=1").wait_for(timeout=15000)
        assert "live" in s.locator("#live").inner_text()
        _run(write(Log("live-2").open(instance_id="i-live")))
        runs.page.wait_for_selector('#run-count[data-total="2"]', timeout=15000)
        assert runs.page.locator("tr.run").count() == 2
        runs.shot("live-runs")
        assert runs.errors == [] and session.errors == []
    finally:
        viewer.stop()


def test_indexing_line_gives_way_to_the_whole_index(browser: Any, tmp_path: Path) -> None:
    """The runs page opened while the startup index is still being built shows the
    sessions indexed so far and an "indexing N of M" line; when the build ends,
    the page's own poll replaces both with every session, no reload."""
    import threading

    from aiohttp import web
    from builders import small_logs

    from replay.rules import Rules
    from replay.view.app import INDEX, make_app
    from replay.view.readonly import open_readonly

    url = f"sqlite+aiosqlite:///{tmp_path / 'idx.db'}"
    logs = small_logs()

    async def write() -> tuple[int, int]:
        store = await open_store(url, create=True)
        try:
            for log in logs[:2]:
                await write_to(store, log)
            mid = await store.last_position()
            for log in logs[2:]:
                await write_to(store, log)
            return mid, await store.last_position()
        finally:
            await store.close()

    mid, head = _run(write())
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    async def start() -> tuple[Any, web.AppRunner, int]:
        reader = await open_readonly(url)
        app = make_app(reader, Rules(), token=None, tokenizer=None)
        index = app[INDEX]
        await index.refresh(until=mid)  # the build got this far ...
        await index._lock.acquire()  # ... and is still under way
        runner = web.AppRunner(app)
        await runner.setup()  # starts the startup build: it waits for the lock
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return reader, runner, port

    reader, runner, port = call(start())
    index = runner.app[INDEX]
    try:
        pg = Page(browser, f"http://127.0.0.1:{port}")
        p = pg.goto("/")
        assert f"{mid} of {head} events" in p.locator("#indexing").inner_text()
        assert p.locator("tr.run").count() == 2
        pg.shot("runs-indexing")
        loop.call_soon_threadsafe(index._lock.release)  # the build goes on
        p.wait_for_selector("#indexing", state="detached", timeout=15000)
        p.wait_for_selector(f'#run-count[data-total="{len(logs)}"]', timeout=15000)
        assert p.locator("tr.run").count() == len(logs)
        assert "live" in p.locator("#live").inner_text()
        assert pg.errors == [] and pg.dialogs == []
    finally:
        call(runner.cleanup())
        call(reader.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
