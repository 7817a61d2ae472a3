"""The `replay` CLI through click's CliRunner, on small logs written through the store."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from builders import Log, small_logs, write_to
from click.testing import CliRunner, Result

from recorder.log.store import open_store
from replay.cli import main
from replay.export import read_samples
from replay.rules import REDUCER_VERSION
from replay.samples import check_invariants

TOKENIZER = Path(__file__).parent.parent / "data" / "smollm2-tokenizer"
BODY = json.dumps(
    {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hello there"}]}
).encode()


def tito_log() -> Log:
    """A turn whose input is the real template render of BODY, with a TITO failure."""
    from recorder.dialects.translate import parse_request
    from recorder.model.tokenizer import load_tokenizer

    tok = load_tokenizer(str(TOKENIZER))
    req = parse_request(BODY)
    ids = tok.encode(tok.render(req.messages, req.tools, True, **req.template_kwargs))
    log = Log("tito-s").open()
    # Emitted " hello" as two pieces; re-encoding gives the single merged token.
    t0 = log.turn(ids, [33662, 2], body=BODY, tito_ok=True)
    emitted = [256, 28120, 2]
    log.turn(t0.then([198]), emitted, tito_ok=False, reencoded=[33662, 2])
    drifted = [*ids[:-3], 17, *ids[-2:]]  # one token differs from the template render
    log.turn(drifted, [2], body=BODY)
    log.reward(1.0).close()
    return log


async def _write(url: str, logs: list[Log]) -> None:
    store = await open_store(url, create=True)
    try:
        for log in logs:
            await write_to(store, log)
    finally:
        await store.close()


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = tmp_path / "runs.db"
    asyncio.run(_write(str(path), [*small_logs(), tito_log()]))
    return str(path)


def run(*args: str) -> Result:
    return CliRunner(env={"COLUMNS": "200"}).invoke(main, list(args), catch_exceptions=False)


def test_reclassify_then_rerun_reports_no_change(db: str) -> None:
    first = run("reclassify", "--db", db)
    assert first.exit_code == 0, first.output
    assert "no earlier projection" in first.output
    assert f"wrote samples/r{REDUCER_VERSION}-" in first.output
    again = run("reclassify", "--db", db)
    assert again.exit_code == 0
    assert "0 sessions changed segmentation, 0 changed samples, 0 new" in again.output
    changed = run("reclassify", "--db", db, "--rules", "collapse-final", "--dry-run")
    assert changed.exit_code == 0
    assert "would write" in changed.output
    assert "3 sessions changed segmentation" in changed.output
    assert "segmentation changed: b-compact" in changed.output


def test_reclassify_rules_file_and_bad_rules(db: str, tmp_path: Path) -> None:
    f = tmp_path / "strict.toml"
    f.write_text('preset = "strict-onpolicy"\nmax_segments = 2\n')
    ok = run("reclassify", "--db", db, "--rules", str(f), "--session", "c-subagent")
    assert ok.exit_code == 0 and "strict" in ok.output and "(1 sessions" in ok.output
    bad = CliRunner().invoke(main, ["reclassify", "--db", db, "--rules", "no-such"])
    assert bad.exit_code == 2 and "unknown rules" in bad.output


def test_missing_database_is_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["stats", "--db", str(tmp_path / "absent.db")])
    assert result.exit_code == 1
    assert "recorder db upgrade" in result.output


def test_show_prints_timeline_and_samples(db: str) -> None:
    result = run("show", "--db", db, "--session", "c-subagent")
    assert result.exit_code == 0, result.output
    for text in ("session_opened", "tool_use Agent", "aborted after 2 tokens", "subagent", "final"):
        assert text in result.output
    missing = CliRunner().invoke(main, ["show", "--db", db, "--session", "nope"])
    assert missing.exit_code == 1 and "no session 'nope'" in missing.output


def test_stats(db: str) -> None:
    result = run("stats", "--db", db)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "sessions" in out and "5" in out
    assert "TITO checked / failed" in out and "14 / 2" in out
    assert "14.29%" in out
    assert "final 5, subagent 1, wipe 2" in out
    assert "completed 4, failed 1" in out and "aborted 1, completed 7" in out
    assert "fully masked samples (nothing to train)" in out
    assert "engine output tokens = trained + untrained" in out and "(ok)" in out
    assert "MISMATCH" not in out
    # Per session: c-subagent trains every engine token, d-failed none (a placeholder).
    assert "c-subagent" in out and "placeholder session 2" in out
    # In two worker processes: the same tables, after the line naming the workers.
    two = run("stats", "--db", db, "--workers", "2")
    assert two.exit_code == 0, two.output
    assert "2 workers on 1 node" in two.output
    assert two.output[two.output.index("log statistics") :] == out[out.index("log statistics") :]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_export_round_trips_samples(db: str, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / f"samples.{fmt}"
    result = run("export", "--db", db, "--format", fmt, "--out", str(out))
    assert result.exit_code == 0, result.output
    samples = list(read_samples(out, fmt))  # type: ignore[arg-type]
    assert "wrote 8 samples from 5 sessions" in result.output
    assert "(1 placeholders, 22 trainable tokens)" in result.output
    assert len(samples) == 8
    for s in samples:
        check_invariants(s)
    kinds = sorted(str(s.metadata.get("segment_kind")) for s in samples)
    assert kinds == ["final"] * 5 + ["subagent", "wipe", "wipe"]
    assert {s.rollout_id for s in samples if s.session_id == "b-compact"} == {"b-compact"}


def test_export_routed_experts_parquet(db: str, tmp_path: Path) -> None:
    f = tmp_path / "moe.json"
    f.write_text('{"routed_experts": [3, 2]}')
    out = tmp_path / "moe.parquet"
    assert (
        run(
            "export", "--db", db, "--format", "parquet", "--out", str(out), "--rules", str(f)
        ).exit_code
        == 0
    )
    for s in read_samples(out, "parquet"):
        assert s.routed_experts is not None
        check_invariants(s, routed_experts=(3, 2))


def test_tito_lists_failures(db: str) -> None:
    result = run("tito", "--db", db)
    assert result.exit_code == 0, result.output
    assert "TITO-failed turns: 2 of 14 checked" in result.output
    assert "a-linear" in result.output and "tito-s" in result.output


def test_tito_turn_without_tokenizer_shows_ids(db: str) -> None:
    result = run("tito", "--db", db, "--session", "tito-s", "--turn", "1")
    assert result.exit_code == 0, result.output
    assert "TITO FAILED" in result.output
    assert "first divergence at index 0" in result.output
    assert "needs --tokenizer" in result.output


def test_tito_turn_with_tokenizer_decodes_pieces_and_rerenders(db: str) -> None:
    one = run(
        "tito", "--db", db, "--session", "tito-s", "--turn", "1", "--tokenizer", str(TOKENIZER)
    )
    assert one.exit_code == 0, one.output
    assert "' hello'" in one.output and "◀ first divergence" in one.output
    same = run(
        "tito", "--db", db, "--session", "tito-s", "--turn", "0", "--tokenizer", str(TOKENIZER)
    )
    assert "identical to the engine input" in same.output
    drift = run(
        "tito", "--db", db, "--session", "tito-s", "--turn", "2", "--tokenizer", str(TOKENIZER)
    )
    assert "engine input vs template re-render" in drift.output
    assert "first divergence at index 29" in drift.output


def test_tito_turn_needs_session_and_known_turn(db: str) -> None:
    usage = CliRunner().invoke(main, ["tito", "--db", db, "--turn", "1"])
    assert usage.exit_code == 2 and "--turn needs --session" in usage.output
    unknown = CliRunner().invoke(main, ["tito", "--db", db, "--session", "tito-s", "--turn", "9"])
    assert unknown.exit_code == 1 and "has no turn 9" in unknown.output
