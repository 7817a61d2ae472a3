"""Run and check Alembic migrations programmatically (async engines)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import AsyncEngine

from recorder.log.store.base import SchemaOutOfDate

MIGRATIONS_DIR = Path(__file__).resolve().parents[3] / "migrations"
# Serialises concurrent upgrades of one Postgres database.
MIGRATION_LOCK_KEY = 0x7472_6D69_6772_6174  # "trmigrat"


def alembic_config(url: str | None = None) -> Config:
    if not (MIGRATIONS_DIR / "env.py").exists():
        raise FileNotFoundError(
            f"Alembic migrations not found at {MIGRATIONS_DIR}; run from a source checkout "
            "or reinstall trajectory-recorder"
        )
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url:
        cfg.set_main_option("sqlalchemy.url", url)
    return cfg


@cache
def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "migrations/versions holds no revision"
    return head


def _current(conn: sa.Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(_current)


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    """Bring the database to `revision` (no-op when it is there).

    Only tests name an older revision, to build databases written by older code.
    """
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))

    def run(conn: sa.Connection) -> None:
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
        if _current(conn) == (head_revision() if revision == "head" else revision):
            return
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)

    async with engine.begin() as conn:
        await conn.run_sync(run)


async def ensure_current(engine: AsyncEngine, url: str) -> None:
    """Raise `SchemaOutOfDate` unless the database is at the head revision."""
    current = await current_revision(engine)
    head = head_revision()
    if current == head:
        return
    known = {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if current is not None and current not in known:
        raise SchemaOutOfDate(
            f"{url} is at schema revision {current!r}, which this version of "
            "trajectory-recorder does not know (a newer one wrote it); upgrade the package"
        )
    state = "has no recorder schema" if current is None else f"is at revision {current!r}"
    raise SchemaOutOfDate(
        f"{url} {state}, but this code needs {head!r}: run `recorder db upgrade --db {url}`"
    )
