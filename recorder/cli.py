"""The `recorder` command line. `db` manages the event store's database."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import click

from recorder.log.store import StoreError, normalize_url, open_store


def _run(coro: Coroutine[Any, Any, str]) -> str:
    """Run a command's coroutine, turning store errors into clean CLI errors."""
    try:
        return asyncio.run(coro)
    except (StoreError, ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None


@click.group()
def main() -> None:
    """trajectory-recorder: record agent runs as an event log."""


@main.group()
def db() -> None:
    """Create, upgrade and copy event-store databases."""


@db.command()
@click.option("--db", "url", required=True, help="Database URL or SQLite file path.")
def upgrade(url: str) -> None:
    """Create the schema or bring it to the current revision."""
    from recorder.log.store import migrations

    async def run() -> str:
        store = await open_store(url, create=True)
        try:
            return str(await migrations.current_revision(store.write_engine))  # type: ignore[attr-defined]
        finally:
            await store.close()

    revision = _run(run())
    click.echo(f"{normalize_url(url)}: schema at revision {revision}")


@db.command()
@click.option("--from", "src_url", required=True, help="Source database URL or path.")
@click.option("--to", "dst_url", required=True, help="Target database URL or path (no events).")
def copy(src_url: str, dst_url: str) -> None:
    """Copy every event, array and projection into an empty database."""
    from recorder.log.store.copy import copy_store
    from recorder.log.store.sql import SqlEventStore

    async def run() -> str:
        src = await open_store(src_url)
        try:
            dst = await open_store(dst_url, create=True)
            try:
                assert isinstance(src, SqlEventStore) and isinstance(dst, SqlEventStore)
                stats = await copy_store(src, dst)
            finally:
                await dst.close()
        finally:
            await src.close()
        return (
            f"copied {stats.events} events, {stats.arrays} array pieces, "
            f"{stats.projections} projection rows"
        )

    click.echo(_run(run()))


from recorder.server.commands import serve  # noqa: E402  (the live middleware)

main.add_command(serve)

from recorder.rollout.cli import rollout  # noqa: E402  (the rollout driver)

main.add_command(rollout)

if __name__ == "__main__":
    main()
