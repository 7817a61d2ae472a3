"""Run and check Alembic migrations programmatically (async engines).

A server opens its log at every start, nearly always at the head revision
already. That check reads the version table and the revision files itself,
so Alembic (with Mako and Pygments: ~10 MB of a server's idle RSS) is imported
only to upgrade a database or to explain why one cannot be used. Both reads are
checked against Alembic's own in tests/store/test_migration_check.py.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from recorder.log.store.base import SchemaOutOfDate

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parents[3] / "migrations"
# Serialises concurrent upgrades of one Postgres database.
MIGRATION_LOCK_KEY = 0x7472_6D69_6772_6174  # "trmigrat"
# Alembic's default version table, which migrations/env.py keeps.
VERSION_TABLE = "alembic_version"


def alembic_config(url: str | None = None) -> Config:
    from alembic.config import Config

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


def _revision_links(path: Path) -> tuple[str, tuple[str, ...]] | None:
    """A revision file's (`revision`, its `down_revision`s), read from its literals."""
    values: dict[str, object] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id in ("revision", "down_revision"):
                    try:
                        values[target.id] = ast.literal_eval(node.value)
                    except ValueError:
                        return None  # computed: Alembic must run the file
    revision, down = values.get("revision"), values.get("down_revision")
    if not isinstance(revision, str):
        return None
    downs = (down,) if isinstance(down, str) else tuple(down or ())  # type: ignore[arg-type]
    return revision, tuple(str(d) for d in downs)


def _heads_from_files(versions: Path) -> set[str] | None:
    """The revisions no other revision revises; None when a file is not plain literals."""
    links = [_revision_links(p) for p in sorted(versions.glob("*.py"))]
    if not links or any(link is None for link in links):
        return None
    revisions = {link[0] for link in links if link}
    revised = {down for link in links if link for down in link[1]}
    return revisions - revised


@cache
def head_revision() -> str:
    heads = _heads_from_files(MIGRATIONS_DIR / "versions")
    if heads is not None and len(heads) == 1:
        return heads.pop()
    from alembic.script import ScriptDirectory  # branches or computed values: Alembic decides

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "migrations/versions holds no revision"
    return head


def _current(conn: sa.Connection) -> str | None:
    """The revision the database is stamped with (None: no schema), as Alembic reads it."""
    if not sa.inspect(conn).has_table(VERSION_TABLE):
        return None
    rows = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    if len(rows) <= 1:
        return rows[0] if rows else None
    from alembic.runtime.migration import MigrationContext  # several heads: Alembic's error

    return MigrationContext.configure(conn).get_current_revision()


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(_current)


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    """Bring the database to `revision` (no-op when it is there).

    Only tests name an older revision, to build databases written by older code.
    """
    url = engine.url.render_as_string(hide_password=False)

    def run(conn: sa.Connection) -> None:
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
        if _current(conn) == (head_revision() if revision == "head" else revision):
            return
        from alembic import command

        cfg = alembic_config(url)
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
    from alembic.script import ScriptDirectory

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


def refuse_downgrade_past_codec(codec: int, pieces_are: str, older: str, newer: str) -> None:
    """A revision's `downgrade()` for a new array codec: refuse while any piece uses it.

    A codec-only revision changes no table; it exists so that code at `older`,
    which cannot decode `codec`, refuses the database ("a newer one wrote
    it") instead of failing on its first read of such a piece. Going back to
    `older` is therefore only safe while no piece uses the codec.
    `pieces_are`: what such pieces are, for the message.
    """
    from alembic import op

    n = op.get_bind().scalar(sa.text("SELECT COUNT(*) FROM arrays WHERE codec = :c"), {"c": codec})
    if n:
        raise RuntimeError(
            f"{n} array pieces {pieces_are}, which code at revision {older} cannot read; "
            f"stay at revision {newer} or newer"
        )
