"""The schema check a store runs at every open reads what Alembic reads, without Alembic.

recorder.log.store.migrations reads the head revision from migrations/versions
and the database's revision from Alembic's version table itself, so that a
server opening an up-to-date log never imports Alembic (~10 MB of its RSS).
These tests hold both reads to Alembic's own answers.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import create_async_engine

from recorder.log.store import migrations, open_store
from tests.conftest import fresh_python


def _alembic_current(conn: sa.Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def test_head_revision_is_alembics_head() -> None:
    script = ScriptDirectory.from_config(migrations.alembic_config())
    assert migrations.head_revision() == script.get_current_head()
    heads = migrations._heads_from_files(migrations.MIGRATIONS_DIR / "versions")
    assert heads == set(script.get_heads())


def test_heads_follow_the_down_revisions(tmp_path: Path) -> None:
    def write(name: str, revision: str, down: str) -> None:
        (tmp_path / name).write_text(f'revision = "{revision}"\ndown_revision = {down}\n')

    write("a.py", "a", "None")
    write("b.py", "b", '"a"')
    write("c.py", "c", '"a"')
    assert migrations._heads_from_files(tmp_path) == {"b", "c"}
    write("d.py", "d", '("b", "c")')  # a merge revision
    assert migrations._heads_from_files(tmp_path) == {"d"}
    (tmp_path / "e.py").write_text("revision = make_id()\n")
    assert migrations._heads_from_files(tmp_path) is None  # left to Alembic


async def test_current_revision_is_alembics_at_every_step(store_url: str) -> None:
    engine = create_async_engine(store_url)
    try:
        seen = []
        for target in (None, "0001", "0002", "head"):
            if target is not None:
                await migrations.upgrade(engine, target)
            async with engine.connect() as conn:
                ours = await conn.run_sync(migrations._current)
                theirs = await conn.run_sync(_alembic_current)
            assert ours == theirs
            seen.append(ours)
    finally:
        await engine.dispose()
    assert seen == [None, "0001", "0002", migrations.head_revision()]


async def test_opening_an_up_to_date_log_never_imports_alembic(sqlite_url: str) -> None:
    async with await open_store(sqlite_url, create=True):
        pass
    code = (
        "import asyncio, sys\n"
        "from recorder.log.store import open_store\n"
        "async def main():\n"
        f"    async with await open_store({sqlite_url!r}, create=True):\n"
        "        pass\n"
        f"    async with await open_store({sqlite_url!r}):\n"
        "        pass\n"
        "asyncio.run(main())\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('alembic', 'mako'))\n"
        "assert not loaded, loaded\n"
    )
    fresh_python(code, timeout=120)
