"""The `replay view` web app: aiohttp handlers over a read-only store.

Pages are rendered on the server with Jinja2 (autoescape on: prompts, tool
outputs and metadata come from the log and are untrusted text); the only
scripts are the package's own static files, and a Content-Security-Policy
forbids every other script source, inline ones included. Every request
re-reads the log (`RunIndex.refresh`), so a live log's new sessions and turns
show on the next request and to the open page's poll of `/api/position`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from aiohttp import web

from recorder.log.store.base import EventStore
from replay.reclassify import SUMMARY_PREFIX
from replay.rules import Rules
from replay.view import charts
from replay.view import model as m
from replay.view.index import Query, RunIndex, group_rows, select
from replay.view.projections import known_rules, projection_counts

HERE = Path(__file__).parent
CHUNK = 4000  # sample tokens per JSON chunk
COOKIE = "replay_view_token"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)

STORE: web.AppKey[EventStore] = web.AppKey("store", EventStore)
INDEX: web.AppKey[RunIndex] = web.AppKey("index", RunIndex)
REDUCTIONS: web.AppKey[m.Reductions] = web.AppKey("reductions", m.Reductions)
TOKENIZERS: web.AppKey[m.Tokenizers] = web.AppKey("tokenizers", m.Tokenizers)
RULES: web.AppKey[Rules] = web.AppKey("rules", Rules)
ENV: web.AppKey[jinja2.Environment] = web.AppKey("env", jinja2.Environment)


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["ts"] = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) if t else ""
    env.filters["dur"] = lambda s: f"{s:.1f}s" if s < 120 else f"{s / 60:.1f}m"
    env.filters["pct"] = lambda x: "" if x is None else f"{100 * x:.0f}%"
    env.filters["num"] = lambda x: "" if x is None else f"{x:g}"
    env.filters["pretty"] = lambda x: json.dumps(x, indent=2, ensure_ascii=False, default=str)
    return env


def render(request: web.Request, name: str, **ctx: Any) -> web.Response:
    html = request.app[ENV].get_template(name).render(**ctx)
    return web.Response(text=html, content_type="text/html")


# -------------------------------------------------------------- auth / headers


def token_middleware(token: str | None) -> Any:
    """With a token (a non-loopback bind), every request must carry it: once as
    `?token=`, which sets an HttpOnly cookie, or as `Authorization: Bearer`."""

    @web.middleware
    async def mw(request: web.Request, handler: Any) -> web.StreamResponse:
        set_cookie = False
        if token is not None:
            given = request.cookies.get(COOKIE, "")
            auth = request.headers.get("Authorization", "")
            if auth.startswith("Bearer "):
                given = auth[7:]
            if "token" in request.query:
                given, set_cookie = request.query["token"], True
            if not hmac.compare_digest(given.encode(), token.encode()):
                raise web.HTTPUnauthorized(
                    text="replay view: open the URL with ?token=TOKEN (printed at start)"
                )
        resp = await handler(request)
        if set_cookie and token is not None:
            resp.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
        resp.headers["Content-Security-Policy"] = CSP
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Referrer-Policy"] = "no-referrer"
        return resp

    return mw


# -------------------------------------------------------------- runs


def _link(query: Query, **change: Any) -> str:
    params = {
        "status": query.status,
        "outcome": query.outcome,
        "instance": query.instance,
        "group": query.group,
        "q": query.text,
        "sort": query.sort,
        "dir": "desc" if query.desc else "asc",
        "page": query.page,
        "per": query.per_page,
    }
    params.update(change)
    return "?" + urlencode({k: v for k, v in params.items() if v not in ("", None)})


@dataclass(slots=True)
class RunsView:
    """What the runs page derives from the whole index for one filter and sort."""

    total: int
    matched: list[Any]
    spread: dict[str, tuple[float, float, float, int]]
    statuses: list[str]
    outcomes: list[str]
    charts: list[Any]


def runs_view(index: RunIndex, q: Query) -> RunsView:
    rows = list(index.rows.values())
    matched = select(rows, q)
    rewards_by_group: dict[str, list[float]] = {}
    for r in rows:
        if r.group and r.reward is not None:
            rewards_by_group.setdefault(r.group, []).append(r.reward)
    return RunsView(
        total=len(rows),
        matched=matched,
        spread={g: (min(v), sum(v) / len(v), max(v), len(v)) for g, v in rewards_by_group.items()},
        statuses=sorted({r.status for r in rows}),
        outcomes=sorted({r.outcome for r in rows if r.outcome}),
        charts=_summary_charts(matched),
    )


class RunsCache:
    """The last few `RunsView`s, keyed by the log position and the query minus
    its page: paging through 10,000 runs sorts and charts them once."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._views: OrderedDict[tuple[Any, ...], RunsView] = OrderedDict()

    def get(self, index: RunIndex, q: Query) -> RunsView:
        key = (index.position, index.projection, q.status, q.outcome, q.instance, q.group)
        key += (q.text, q.sort, q.desc)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = runs_view(index, q)
            while len(self._views) > self.keep:
                self._views.popitem(last=False)
        self._views.move_to_end(key)
        return view


RUNS: web.AppKey[RunsCache] = web.AppKey("runs", RunsCache)


async def runs_page(request: web.Request) -> web.Response:
    index = request.app[INDEX]
    position = await index.current()
    q = Query.from_params(request.query)
    view = request.app[RUNS].get(index, q)
    start = q.page * q.per_page
    return render(
        request,
        "runs.html",
        q=q,
        link=lambda **kw: _link(q, **kw),
        groups=group_rows(view.matched[start : start + q.per_page]),
        spread=view.spread,
        total=view.total,
        matched=len(view.matched),
        start=start,
        pages=max(1, -(-len(view.matched) // q.per_page)),
        position=position,
        statuses=view.statuses,
        outcomes=view.outcomes,
        charts=view.charts,
        projection=index.projection,
        indexing=index.indexing,
        head=index.head,
    )


def _summary_charts(rows: list[Any]) -> list[Any]:
    rewards = [r.reward for r in rows if r.reward is not None]
    outcomes = Counter(r.outcome or r.status for r in rows)
    by_time = sorted((r for r in rows if r.tito_checked), key=lambda r: r.first_ts)
    step = max(1, len(by_time) // 40)
    tito = []
    for i in range(0, len(by_time), step):
        chunk = by_time[i : i + step]
        failed = sum(r.tito_failed for r in chunk)
        checked = sum(r.tito_checked for r in chunk)
        tito.append((chunk[0].first_ts, 100 * failed / checked))
    return [
        charts.histogram("reward distribution", rewards),
        charts.bars("outcomes and infra causes", sorted(outcomes.items()), color="#5a9a5a"),
        charts.histogram("turns per rollout", [float(r.n_turns) for r in rows]),
        charts.histogram("tokens per rollout", [float(r.tokens) for r in rows]),
        charts.line("TITO failure rate over time", tito, unit="%"),
    ]


async def position_api(request: web.Request) -> web.Response:
    """The log position and session count: an open page polls this to see news."""
    index = request.app[INDEX]
    position = await index.current()
    sid = request.query.get("session")
    row = index.rows.get(sid) if sid else None
    return web.json_response(
        {
            "position": position,
            "sessions": len(index.rows),
            "session_position": row.last_position if row else None,
            "indexing": index.indexing,
            "head": index.head,
        }
    )


# -------------------------------------------------------------- session / turn / sample


async def _reduced(request: web.Request) -> m.Reduced:
    sid = request.match_info["sid"]
    got = await request.app[REDUCTIONS].get(sid)
    if got is None:
        raise web.HTTPNotFound(text=f"no session {sid!r} in this log")
    return got


async def session_page(request: web.Request) -> web.Response:
    red = await _reduced(request)
    sid = request.match_info["sid"]
    await request.app[INDEX].current()
    row = request.app[INDEX].rows.get(sid)
    lanes = m.lanes(red.events, red.result)
    return render(
        request,
        "session.html",
        sid=sid,
        row=row,
        result=red.result,
        timeline=m.timeline(red.events),
        lanes=lanes,
        lanes_svg=charts.lanes(lanes, f"/session/{quote(sid, safe='')}/turn/"),
        story=m.rollout_story(red.events),
        turns=m.turn_numbers(red.events),
        last_position=max(e.position for e in red.events),
    )


async def turn_page(request: web.Request) -> web.Response:
    red = await _reduced(request)
    sid = request.match_info["sid"]
    try:
        turn = int(request.match_info["turn"])
        text = request.app[TOKENIZERS].for_events(red.events)
        view = await m.turn_view(
            request.app[STORE], red.events, turn, text, rerender="rerender" in request.query
        )
    except (ValueError, LookupError) as exc:
        raise web.HTTPNotFound(text=str(exc)) from None
    turns = m.turn_numbers(red.events)
    return render(
        request,
        "turn.html",
        sid=sid,
        turn=turn,
        v=view,
        turns=turns,
        request_rerender="rerender" in request.query,
    )


def _sample(request: web.Request, red: m.Reduced) -> tuple[int, Any]:
    try:
        i = int(request.match_info["i"])
        return i, red.result.samples[i]
    except (ValueError, IndexError):
        raise web.HTTPNotFound(text="no such sample in this session") from None


async def sample_page(request: web.Request) -> web.Response:
    red = await _reduced(request)
    i, s = _sample(request, red)
    spans = m.origins(s, red.events)
    return render(
        request,
        "sample.html",
        sid=request.match_info["sid"],
        i=i,
        s=s,
        n=len(red.result.samples),
        trainable=sum(s.loss_mask),
        versions=sorted(Counter(v for v in s.weight_versions if v).items()),
        regions=m.masked_regions(s, spans),
        chunk=CHUNK,
        meta={k: v for k, v in s.metadata.items() if k != "source_seqs"},
    )


async def sample_tokens(request: web.Request) -> web.Response:
    """Tokens [start, start+CHUNK) of a sample as JSON rows (see `model.token_rows`)."""
    red = await _reduced(request)
    _, s = _sample(request, red)
    try:
        start = max(0, int(request.query.get("start", "0")))
    except ValueError:
        raise web.HTTPBadRequest(text="start must be an integer") from None
    text = request.app[TOKENIZERS].for_events(red.events)
    rows = m.token_rows(s, m.origins(s, red.events), text, start, start + CHUNK)
    return web.json_response(
        {"start": start, "total": len(s.tokens), "prompt_len": s.prompt_len, "rows": rows}
    )


# -------------------------------------------------------------- rules


async def rules_page(request: web.Request) -> web.Response:
    store, rules = request.app[STORE], request.app[RULES]
    index = request.app[INDEX]
    await index.current()
    names = await store.projection_names()
    counts = await projection_counts(store)
    report = None
    if "dry_run" in request.query:
        from replay.reclassify import reclassify

        report = await reclassify(store, rules, dry_run=True)
    return render(
        request,
        "rules.html",
        rules=rules,
        rules_json=json.dumps(
            {f: getattr(rules, f) for f in rules.__struct_fields__}, indent=2, default=str
        ),
        projections=[(c, known_rules(c.rules_version, rules)) for c in counts],
        others=[n for n in names if not n.startswith(SUMMARY_PREFIX)],
        report=report,
        sessions=len(index.rows),
    )


# -------------------------------------------------------------- app


async def _index_at_start(app: web.Application) -> AsyncIterator[None]:
    """Fold the log into the runs index as soon as the server is up, not on the
    first page view (a large log takes a while; see tools/bench_view.py)."""
    task = asyncio.create_task(app[INDEX].refresh())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def make_app(
    store: EventStore, rules: Rules, *, token: str | None, tokenizer: str | None
) -> web.Application:
    app = web.Application(middlewares=[token_middleware(token)])
    app[STORE] = store
    app[RULES] = rules
    app[INDEX] = RunIndex(store)
    app[REDUCTIONS] = m.Reductions(store, rules)
    app[TOKENIZERS] = m.Tokenizers(tokenizer)
    app[ENV] = _env()
    app[RUNS] = RunsCache()
    app.cleanup_ctx.append(_index_at_start)
    app.router.add_get("/", runs_page)
    app.router.add_get("/api/position", position_api)
    app.router.add_get("/session/{sid}", session_page)
    app.router.add_get("/session/{sid}/turn/{turn}", turn_page)
    app.router.add_get("/session/{sid}/sample/{i}", sample_page)
    app.router.add_get("/session/{sid}/sample/{i}/tokens", sample_tokens)
    app.router.add_get("/rules", rules_page)
    app.router.add_static("/static", HERE / "static")
    return app
