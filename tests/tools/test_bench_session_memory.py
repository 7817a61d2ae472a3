"""The memory benchmark still runs, at toy sizes (no memory thresholds asserted): idle RSS
per parser backend, RSS over stages of open sessions, and the census of a real
`recorder serve` with its probe."""

from __future__ import annotations

import pytest


def test_bench_session_memory_runs_at_toy_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.bench_session_memory import main as session_memory

    results = session_memory(
        ["--sessions", "2", "--context", "3000", "--idle-rounds", "1", "--growth-tokens", "800",
         "--instructions-words", "100", "--tools", "1", "--stages", "1,2", "--repeats", "1",
         "--variant", "no body cache=--engine-body-cache-mb,0"]
    )  # fmt: skip
    idle = results["idle"]
    assert set(idle) == {
        ("this", backend, log) for backend in ("default", "builtin") for log in ("existing", "new")
    }
    slopes = results["slope"]
    assert set(slopes) == {"this", "this, no body cache"}
    for (run,) in slopes.values():
        assert len(run["rss"]) == 2 and run["rss_before"] > 0
        assert all(c > 2500 for c in run["contexts"])
    census = results["census"]
    assert len(census["sessions"]) == 2 and all(c > 2500 for c in census["contexts"])
    for session in census["sessions"]:
        assert session["chains: token ids (int32)"] >= 4 * 2500
        assert session["previous body: window, digests (body delta)"] > 0
    assert census["piece_cache"]["int32 items"] > 0 and census["base"]["malloc"]
    shared = census["shared"]
    assert shared["engine body cache: sessions"] == 2 and shared["engine body cache"] > 2 * 2500
    out = capsys.readouterr().out
    assert "idle RSS" in out and "per open session" in out and "RSS per open session" in out
