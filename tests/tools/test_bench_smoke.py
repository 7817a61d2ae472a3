"""The per-turn middleware and training-run benchmarks still run, at toy sizes (no timing
assertions).

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


def test_bench_training_runs_at_toy_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.bench_training import main as training

    ours, peer = training(
        ["--sessions", "2", "--contexts", "1500,3000", "--turns", "3", "--point-turns", "2",
         "--peer-turns", "2", "--rss-every", "1", "--instructions-words", "100", "--tools", "1",
         "--idle-rounds", "1"]
    )  # fmt: skip
    assert [(p.target, len(p.samples)) for p in ours.points] == [(1500, 4), (3000, 6)]
    assert [(p.target, len(p.samples)) for p in peer.points] == [(1500, 2), (3000, 2)]
    assert [r[0] for r in ours.points[-1].rss] == [0, 1, 2, 3]
    assert ours.rss_before > 0 and ours.rss_open > 0 and ours.rss_closed > 0
    contexts = [s.context for p in ours.points for s in p.samples]
    assert contexts[0] < 2000 < 2500 < contexts[-1]
    out = capsys.readouterr().out
    assert "per-turn middleware" in out and "per open session" in out
    assert "idle RSS" in out and "bytes / context token" in out
    log = ours.log
    assert log is not None and log.context_tokens > 3000
    assert min(log.ids, log.bodies, log.events) > 0 and log.file > log.ids + log.bodies


def test_bench_middleware_cpu_section_measures_each_process(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Whole recorder processes, CPU per turn from /proc, ours against the re-render peer."""
    results = main(
        ["--section", "cpu", "--cpu-contexts", "700,1600", "--turns", "2",
         "--engine-latency-ms", "2"]
    )  # fmt: skip
    assert [r.target for r in results.cpu] == [700, 1600]
    for row in results.cpu:
        assert set(row.cpu_ms) == {"ours", "re-render"}
        assert all(len(v) == 2 and min(v) > 0 for v in row.cpu_ms.values())
    assert results.cpu[0].context["ours"] < results.cpu[1].context["ours"]
    out = capsys.readouterr().out
    assert "CPU per turn of each recorder process" in out and "load average" in out
