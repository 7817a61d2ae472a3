"""The `replay` command: reclassify, tito, show, export, stats over an event log."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol, TypeVar

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from recorder.log.store.base import EventStore, StoreError
from replay.gcpass import pass_gc
from replay.partitions import PartStat, default_workers
from replay.rules import PRESETS, Rules, RulesError, load_rules

T = TypeVar("T")

console = Console()

db_option = click.option(
    "--db", "db", required=True, metavar="URL", help="Event log: a SQLite path or database URL."
)
rules_option = click.option(
    "--rules",
    "rules_spec",
    default=None,
    metavar="FILE|NAME",
    help=f"Rules file (.toml/.json) or preset ({', '.join(PRESETS)}). Default: default.",
)
page_option = click.option(
    "--page-size", default=1000, show_default=True, help="Events per keyset page when streaming."
)
workers_option = click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Processes (or Ray tasks), each reducing a range of sessions. Default: one per core "
    "(per cluster CPU with --ray), at most one per 64 sessions.",
)
ray_option = click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[ADDRESS]",
    help="Run the workers as Ray tasks on the cluster at ADDRESS (alone: RAY_ADDRESS or the "
    "cluster on this machine). Needs pip install 'trajectory-recorder[ray]'.",
)


def _rules(spec: str | None) -> Rules:
    try:
        return load_rules(spec)
    except RulesError as exc:
        raise click.BadParameter(str(exc), param_hint="--rules") from None


async def _with_store(url: str, fn: Callable[[EventStore], Awaitable[T]], *, streaming: bool) -> T:
    from recorder.log.store import StoreOptions, open_store

    options = StoreOptions.streaming() if streaming else None
    try:
        store = await open_store(url, options=options)
    except (StoreError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        return await fn(store)
    finally:
        await store.close()


def _run(
    url: str,
    fn: Callable[[EventStore], Awaitable[T]],
    *,
    streaming: bool = False,
    fork: int = 0,
) -> T:
    """Run `fn` on the store at `url`. `streaming=True` for one pass over the
    whole log (reclassify, export, stats): small caches, so memory stays flat
    however many sessions the log holds. `fork`: worker processes to fork
    first, for a parallel run inside `fn` (`replay.parallel.forked_workers`)."""
    from replay.parallel import forked_workers

    # Set before forking: the workers inherit it (`replay.gcpass`).
    with pass_gc() if streaming else nullcontext(), forked_workers(fork, url):
        return asyncio.run(_with_store(url, fn, streaming=streaming))


def _local_workers(workers: int | None, ray_address: str | None) -> int:
    """Local worker processes a run may start: none on Ray, else `--workers` or
    one per core (a small log may use fewer: `replay.partitions.auto_workers`)."""
    if ray_address is not None:
        return 0
    return workers if workers is not None else default_workers()


@contextmanager
def _progress(description: str, total: int | None) -> Any:
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    with progress:
        task = progress.add_task(description, total=total)

        def update(done: object = None) -> None:
            """Advance by one (a result), or set the count (an int)."""
            if isinstance(done, int):
                progress.update(task, completed=done)
            else:
                progress.advance(task)

        yield update


def _parallel_errors(fn: Callable[[], T]) -> T:
    """Ray missing or unreachable: a usage error that says what to install or check."""
    from replay.cluster import RayUnavailable  # imports Ray only when a run asks for it

    try:
        return fn()
    except RayUnavailable as exc:
        raise click.ClickException(str(exc)) from None


def _print_partitions(partitions: list[PartStat]) -> None:
    if not partitions:
        return
    nodes = {p.node for p in partitions}
    peak = max(p.peak_rss for p in partitions)
    console.print(
        f"{len(partitions)} workers on {len(nodes)} node{'s' if len(nodes) > 1 else ''}, "
        f"sessions per worker {min(p.sessions for p in partitions)}-"
        f"{max(p.sessions for p in partitions)}, largest worker peak RSS {peak / 2**20:.0f} MB"
    )


class _Partitioned(Protocol):
    partitions: list[PartStat]


P = TypeVar("P", bound=_Partitioned)
# (store, **the keywords every parallel run takes: page_size, workers, ray,
# on_progress, sizes) -> the run's result
_LogRun = Callable[..., Awaitable[P]]


def _run_on_workers(
    db: str,
    description: str,
    run: _LogRun[P],
    *,
    workers: int | None,
    ray_address: str | None,
    page_size: int,
    session_ids: Sequence[str] | None = None,
) -> P:
    """`run` over the log at `db` on the workers asked for (reclassify, export,
    stats), given the keywords they all take: the sessions listed once (the
    progress bar's total and the workers' split), Ray errors explained, the
    workers described."""
    from replay.parallel import wanted_sizes

    async def go(store: EventStore) -> P:
        sizes = await wanted_sizes(store, session_ids)
        with _progress(description, len(sizes)) as advance:
            return await run(
                store,
                page_size=page_size,
                workers=workers,
                ray=ray_address,
                on_progress=advance,
                sizes=sizes,
            )

    fork = _local_workers(workers, ray_address)
    result = _parallel_errors(lambda: _run(db, go, streaming=True, fork=fork))
    _print_partitions(result.partitions)
    return result


@click.group()
def main() -> None:
    """Rebuild training samples from a trajectory-recorder event log."""
    global console
    console = Console()  # per invocation: picks up the current stdout and COLUMNS


# -------------------------------------------------------------- reclassify


@main.command()
@db_option
@rules_option
@click.option("--session", "sessions", multiple=True, metavar="ID", help="Only these sessions.")
@click.option("--dry-run", is_flag=True, help="Report changes without writing the projection.")
@workers_option
@ray_option
@page_option
def reclassify(
    db: str,
    rules_spec: str | None,
    sessions: tuple[str, ...],
    dry_run: bool,
    workers: int | None,
    ray_address: str | None,
    page_size: int,
) -> None:
    """Re-derive every session's samples and store them as a projection."""
    from replay.reclassify import reclassify as run

    rules = _rules(rules_spec)
    report = _run_on_workers(
        db,
        "reclassifying",
        lambda store, **common: run(
            store, rules, session_ids=sessions or None, dry_run=dry_run, **common
        ),
        workers=workers,
        ray_address=ray_address,
        page_size=page_size,
        session_ids=sessions or None,
    )
    verb = "would write" if dry_run else "wrote"
    console.print(
        f"rules [bold]{escape(rules.name)}[/] {rules.version}: {verb} [bold]{report.projection}[/] "
        f"({report.sessions} sessions, log position {report.covers_position})"
    )
    if report.previous is None:
        console.print("no earlier projection to compare with")
    else:
        console.print(f"compared with [bold]{escape(report.previous)}[/]")
    table = Table(title="before → after")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for key in sorted(set(report.kinds_before) | set(report.kinds_after)):
        table.add_row(
            f"samples: {key}",
            str(report.kinds_before.get(key, 0)),
            str(report.kinds_after.get(key, 0)),
        )
    for key in sorted(set(report.status_before) | set(report.status_after)):
        table.add_row(
            f"status: {key}",
            str(report.status_before.get(key, 0)),
            str(report.status_after.get(key, 0)),
        )
    table.add_row("trainable tokens", str(report.trainable_before), str(report.trainable_after))
    console.print(table)
    console.print(
        f"{len(report.changed_segmentation)} sessions changed segmentation, "
        f"{len(report.changed_samples)} changed samples, {report.new_sessions} new"
    )
    for sid in report.changed_segmentation[:20]:
        console.print(f"  segmentation changed: {escape(sid)}")
    if len(report.changed_segmentation) > 20:
        console.print(f"  … and {len(report.changed_segmentation) - 20} more")


# -------------------------------------------------------------- tito


@main.command()
@db_option
@click.option("--session", "session_id", default=None, metavar="ID")
@click.option("--turn", type=int, default=None, help="Show one turn token by token.")
@click.option(
    "--tokenizer",
    "tokenizer_path",
    default=None,
    metavar="PATH",
    help="HF tokenizer directory or GGUF file, to decode pieces and re-render templates.",
)
@click.option("--context", default=8, show_default=True, help="Rows shown before a divergence.")
def tito(
    db: str, session_id: str | None, turn: int | None, tokenizer_path: str | None, context: int
) -> None:
    """List TITO-failed turns, or show one turn's emitted vs re-encoded ids."""
    from replay import tito as t

    if turn is None:
        failures, verdicts = _run(db, lambda store: t.list_failures(store, session_id))
        console.print(t.failures_table(failures, verdicts))
        return
    if session_id is None:
        raise click.UsageError("--turn needs --session")
    try:
        tok = t.load_tokenizer(tokenizer_path) if tokenizer_path else None
    except Exception as exc:
        raise click.ClickException(f"cannot load tokenizer {tokenizer_path}: {exc}") from None

    async def fetch(store: EventStore) -> t.TurnTokens:
        try:
            return await t.turn_tokens(store, session_id, turn)
        except LookupError as exc:
            raise click.ClickException(str(exc)) from None

    tt = _run(db, fetch)
    verdict = tt.verdict
    state = "no verdict" if verdict is None else ("ok" if verdict.ok else "FAILED")
    console.print(f"session {escape(tt.session_id)} turn {tt.turn}: TITO {state}")
    reencoded = tt.reencoded
    source = "recorded"
    if reencoded is None and tok is not None:
        reencoded, source = t.reencode(tok, tt.emitted), "re-encoded now"
    if reencoded is None:
        console.print("no re-encoded ids recorded: pass --tokenizer PATH to re-encode")
    else:
        console.print(
            t.side_by_side(
                f"decode→re-encode ({source})",
                "emitted",
                tt.emitted,
                "re-encoded",
                reencoded,
                tok,
                context=context,
            )
        )
    if tok is None or tt.body is None or tt.input_ids is None:
        if tok is None:
            console.print("template re-render: needs --tokenizer PATH")
        return
    try:
        fresh = t.rerender(tok, tt.body, tt.dialect)
    except Exception as exc:
        console.print(escape(f"template re-render failed: {type(exc).__name__}: {exc}"))
        return
    if t.first_divergence(tt.input_ids, fresh) is None:
        console.print("template re-render: identical to the engine input")
        return
    console.print(
        t.side_by_side(
            "engine input vs template re-render",
            "sent",
            tt.input_ids,
            "re-rendered",
            fresh,
            tok,
            context=context,
        )
    )


# -------------------------------------------------------------- show


@main.command()
@db_option
@click.option("--session", "session_id", required=True, metavar="ID")
@rules_option
def show(db: str, session_id: str, rules_spec: str | None) -> None:
    """A session's timeline, then the samples it reduces to."""
    from replay import close_session_samples
    from replay.show import segments_table, timeline_table

    rules = _rules(rules_spec)

    async def go(store: EventStore) -> Any:
        events = await store.read_session(session_id)
        if not events:
            raise click.ClickException(f"no session {session_id!r} in {db}")
        return events, await close_session_samples(store, session_id, rules)

    events, result = _run(db, go)
    console.print(timeline_table(events, session_id))
    console.print(segments_table(result))
    for d in result.diagnostics:
        console.print(Text(f"· {d}", style="dim"))


# -------------------------------------------------------------- export


@main.command()
@db_option
@click.option("--format", "fmt", type=click.Choice(["jsonl", "parquet"]), default="jsonl")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path))
@rules_option
@workers_option
@ray_option
@page_option
def export(
    db: str,
    fmt: str,
    out: Path,
    rules_spec: str | None,
    workers: int | None,
    ray_address: str | None,
    page_size: int,
) -> None:
    """Write samples for a trainer (see replay.export for the slime / verl mapping)."""
    from replay.export import export_samples

    rules = _rules(rules_spec)
    counts = _run_on_workers(
        db,
        "exporting",
        lambda store, **common: export_samples(store, out, fmt, rules, **common),
        workers=workers,
        ray_address=ray_address,
        page_size=page_size,
    )
    console.print(
        f"wrote {counts.samples} samples from {counts.sessions} sessions to {escape(str(out))} "
        f"({counts.placeholders} placeholders, {counts.trainable_tokens} trainable tokens)"
    )


# -------------------------------------------------------------- stats


@main.command()
@db_option
@rules_option
@workers_option
@ray_option
@page_option
def stats(
    db: str, rules_spec: str | None, workers: int | None, ray_address: str | None, page_size: int
) -> None:
    """Sessions, turns, tokens, TITO failure rate, aborts, segment kinds, and per session
    where the engine's output tokens went (trained, or untrained and why)."""
    from replay.stats import accounting_table, log_stats, stats_table

    rules = _rules(rules_spec)
    st = _run_on_workers(
        db,
        "reading",
        lambda store, **common: log_stats(store, rules, **common),
        workers=workers,
        ray_address=ray_address,
        page_size=page_size,
    )
    console.print(stats_table(st))
    console.print(accounting_table(st))


# -------------------------------------------------------------- view


@main.command()
@db_option
@rules_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8000, show_default=True, help="Port (0 picks a free one).")
@click.option(
    "--token",
    envvar="TR_ADMIN_TOKEN",
    default=None,
    help="Required by every request; needed for a non-loopback --host (env TR_ADMIN_TOKEN).",
)
@click.option(
    "--token-file",
    envvar="TR_ADMIN_TOKEN_FILE",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Read the token from this file (0600), as the admin API does.",
)
@click.option(
    "--tokenizer",
    "tokenizer_path",
    default=None,
    metavar="PATH",
    help="Tokenizer to show token texts (default: the one each session recorded, if present).",
)
def view(
    db: str,
    rules_spec: str | None,
    host: str,
    port: int,
    token: str | None,
    token_file: Path | None,
    tokenizer_path: str | None,
) -> None:
    """A read-only web page over the log: runs, sessions, turns, samples, rules."""
    from recorder.admin_token import AdminTokenError
    from replay.view.serve import FRESH, serve, view_token

    rules = _rules(rules_spec)
    try:
        secret, where = view_token(host, token, token_file)
    except AdminTokenError as exc:
        raise click.ClickException(str(exc)) from None

    def ready(url: str) -> None:
        link = f"{url}?token={secret}" if where == FRESH else f"{url}?token=<the token {where}>"
        console.print(f"replay view on [bold]{escape(link)}[/] (read-only; Ctrl-C stops it)")

    try:
        asyncio.run(
            serve(
                db,
                rules,
                host=host,
                port=port,
                token=secret,
                tokenizer=tokenizer_path,
                on_ready=ready,
            )
        )
    except (StoreError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
