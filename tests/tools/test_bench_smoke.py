"""The per-turn middleware benchmark still runs, at toy sizes (no timing assertions).

Both sections run: end to end (real server, SQLite store, scripted engine,
chain path against the full re-render planner) and the pure parse + plan
table. The bench itself raises when a measured turn did not extend its chain
or when the full re-render does not reproduce the chain's tokens.
"""

from __future__ import annotations

import pytest

from tools.bench_middleware import main


def test_bench_middleware_runs_at_toy_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    results = main(
        ["--contexts", "600,1500", "--turns", "2", "--warmup", "1", "--repeat", "1",
         "--new-words", "40", "--engine-latency-ms", "5"]
    )  # fmt: skip
    assert [row.target for row in results.e2e] == [600, 1500]
    assert all(row.turns == 2 for row in results.e2e)
    assert results.e2e[0].context < results.e2e[1].context
    # ~150-token tool results plus the model's ~50-token call per turn.
    assert all(150 <= row.new_tokens <= 300 for row in results.e2e)
    assert [(r["context"] > 0, r["new"] > 0) for r in results.pure] == [(True, True)] * 2
    out = capsys.readouterr().out
    assert "end to end" in out and "pure" in out


def test_bench_middleware_with_the_engine_in_a_thread() -> None:
    results = main(
        ["--section", "e2e", "--contexts", "800", "--turns", "2", "--warmup", "1",
         "--engine-thread", "--engine-latency-ms", "0", "--per-turn"]
    )  # fmt: skip
    assert [(row.target, row.turns) for row in results.e2e] == [(800, 2)]
    assert results.pure == []
