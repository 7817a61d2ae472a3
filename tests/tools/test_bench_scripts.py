"""The benchmarks run as the README shows them (`python tools/bench_X.py`), at toy sizes.

Each run goes end to end through the shared harness (tools/benchkit) from
another working directory, and its table must keep the columns users'
scripts and the README's figures refer to, with a number in each measured
cell. No timing assertions: the numbers only have to be there and be sane.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def run(script: str, *args: str, cwd: Path, timeout: float = 240) -> list[str]:
    proc = subprocess.run(
        [sys.executable, str(TOOLS / script), *args],
        cwd=cwd,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.splitlines()


def numbers(line: str) -> list[float]:
    cells = line.replace("|", " ").replace(",", "").replace("x", " ").replace("%", " ").split()
    out = []
    for cell in cells:
        try:
            out.append(float(cell))
        except ValueError:
            continue
    return out


def test_bench_dialects(tmp_path: Path) -> None:
    lines = run("bench_dialects.py", "--turns", "6", "--measured", "2", cwd=tmp_path)
    header = next(i for i, line in enumerate(lines) if "dialect" in line)
    assert lines[header].split(" | ") == [
        "          dialect", "body kB", "session ms", "fresh ms", "    x"
    ]  # fmt: skip
    rows = lines[header + 1 : header + 4]
    assert [r.split("|")[0].strip() for r in rows] == [
        "anthropic",
        "openai-chat",
        "openai-responses",
    ]
    assert all(len(numbers(r)) == 4 and min(numbers(r)) > 0 for r in rows)


def test_bench_http_server(tmp_path: Path) -> None:
    lines = run(
        "bench_http_server.py", "--requests", "20", "--rounds", "2", "--body-kb", "4,64",
        "--concurrency", "2", cwd=tmp_path,
    )  # fmt: skip
    header = next(i for i, line in enumerate(lines) if "aiohttp (ours)" in line)
    assert lines[header].split() == [
        "body",
        "aiohttp",
        "(ours)",
        "bare",
        "protocol",
        "aiohttp",
        "-",
        "bare",
    ]
    rows = lines[header + 1 : header + 3]
    assert [r.split()[0] for r in rows] == ["4kB", "64kB"]
    for row in rows:
        ours, bare, _ = numbers(row.split(maxsplit=1)[1])
        assert ours > 0 and bare > 0


def test_bench_close(tmp_path: Path) -> None:
    lines = run(
        "bench_close.py", "--turns", "4,8", "--context", "2000", "--reps", "2", cwd=tmp_path
    )
    header = lines.index(" turns |  peak MB  baseline |  close ms  baseline")
    rows = lines[header + 1 :]
    assert [int(r.split("|")[0]) for r in rows] == [4, 8]
    assert all(len(numbers(r)) == 5 and min(numbers(r)[3:]) > 0 for r in rows)


def test_bench_replay(tmp_path: Path) -> None:
    lines = run(
        "bench_replay.py", "--sessions", "12", "--small", "6", "--turns", "3",
        "--concurrency", "4", "--cache-dir", str(tmp_path / "cache"), cwd=tmp_path,
    )  # fmt: skip
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("sessions"))
    assert lines[header].split() == [
        "sessions", "events", "db", "MB", "scan", "s", "CLI", "s", "events/s", "vs", "scan",
        "API", "s", "CLI", "2w", "s", "events/s", "scan", "RSS", "CLI", "RSS", "API", "RSS",
        "2w", "RSS",
    ]  # fmt: skip
    assert set(lines[header + 1]) == {"-"}
    rows = lines[header + 2 : header + 4]
    assert [int(r.split()[0]) for r in rows] == [6, 12]
    # 3 turns x 5 events + open, reward, close per session.
    assert [int(r.split()[1]) for r in rows] == [6 * 18, 12 * 18]
    assert any(line.startswith("peak RSS 12 vs 6 sessions") for line in lines)


def test_bench_server(tmp_path: Path) -> None:
    lines = run("bench_server.py", "--sessions", "2", "--turns", "1", cwd=tmp_path)
    header = next(i for i, line in enumerate(lines) if line.startswith("sessions x turns"))
    # The title says how fast the host ran Python during the run (`speed_probe_ms`).
    assert re.search(
        r"; load average [\d.]+ [\d.]+ [\d.]+ \(\d+ cores\); speed probe \d+ ms$", lines[header - 1]
    )
    assert lines[header] == (
        f"{'sessions x turns':<17}{'path':<28}{'turns':>6}{'err':>5}{'turns/s':>9}"
        f"{'p50 ms':>8}{'p99 ms':>8}{'ovh p50':>9}{'ovh p99':>9}{'cpu ms/turn':>12}"
    )
    block = lines[header + 1 : header + 15]
    cores = [r for r in block if "recorder phase: per-core utilisation" in r]
    # The box's share for our processes and the CPU-bound rates, in each recorder phase.
    box = [r for r in block if r[17:].startswith("box: our 3 processes")]
    shape = (
        r"box: our 3 processes \d+% of \d+ cores, other processes \d+%; CPU-bound rate "
        r"\d+ turns/s \(recorder alone on 1 core: \d+\)"
    )
    assert len(box) == 2 and all(re.fullmatch(shape, r[17:]) for r in box)
    assert len(cores) == 2 and all(r.count("%") == os.cpu_count() for r in cores)
    # Every process's CPU per turn, in the recorder's phase and in the engine-direct one.
    split = [r for r in block if "CPU ms per turn:" in r]
    names = [re.findall(r"(recorder|engine|load generator) [\d.]+", r) for r in split]
    assert names == [["recorder", "engine", "load generator"], ["engine", "load generator"]] * 2
    assert all(r[17:].startswith("engine /generate phase:") for r in split[1::2])
    rows = [r for r in block if r not in cores and r not in split and r not in box]
    labels = ["engine /generate", "recorder: this", "ratio recorder/engine:"] * 2
    assert len(rows) == len(labels)
    assert all(r[17:].startswith(label) for r, label in zip(rows, labels, strict=True))
    recorder_rows = [numbers(r[45:]) for r in rows if "recorder: this" in r]
    # turns, errors, turns/s, p50, p99, overhead p50 / p99, CPU per turn
    assert [(r[0], r[1], len(r)) for r in recorder_rows] == [(30, 0, 8), (2, 0, 8)]
    assert lines[header + 15] == "turn log lines 34 for 34 turns"


@pytest.mark.postgres
def test_bench_replica_cache(tmp_path: Path, postgres_url: str) -> None:
    """Six replicas (three variants x two) on one Postgres at toy size: with the close watch
    on, neither replica holds a session open once all are closed."""
    lines = run(
        "bench_replica_cache.py", "--pg", postgres_url, "--sessions", "4", "--turns", "1",
        "--concurrency", "2", "--words", "40", "--routings", "sticky", cwd=tmp_path,
        timeout=900,
    )  # fmt: skip
    header = next(i for i, line in enumerate(lines) if line.startswith("routing"))
    for column in (
        "served on/off", "turns on/off", "cached on/off", "open on/off", "held MB on/off",
        "RSS MB on/off", "+RSS MB on/off", "| bound: cached", "shed",
    ):  # fmt: skip
        assert column in lines[header], lines[header]
    rows = lines[header + 1 : header + 3]
    assert [r.split()[:2] for r in rows] == [["sticky", "A"], ["sticky", "B"]]
    cells = [numbers(r) for r in rows]
    assert all(len(c) == 19 for c in cells), cells  # 7 on/off pairs and the 5 bound cells
    served_on = [c[0] for c in cells]
    assert sum(served_on) >= 4  # every session had its turn on some replica
    assert [c[6] for c in cells] == [0, 0]  # open, watch on
    assert any(line.strip().startswith("turns/s") for line in lines)


def test_bench_server_repeat(tmp_path: Path) -> None:
    """`--repeat 2`: every phase twice (the single session once), then the medians."""
    lines = run("bench_server.py", "--sessions", "2", "--turns", "1", "--repeat", "2", cwd=tmp_path)
    at = lines.index("medians over 2 runs (turns/s; CPU ms per turn: recorder, engine, load gen.)")
    table = lines[:at]
    phases = [line[:17].strip() for line in table if line[17:].startswith("recorder: this")]
    assert phases == ["1 x 30", "2 x 1", "2 x 1"]
    medians = lines[at + 1 :]
    assert [(m[:17].strip(), m[17:45].strip()) for m in medians] == [
        ("1 x 30", "recorder: this"),
        ("1 x 30", "engine /generate"),
        ("2 x 1", "recorder: this"),
        ("2 x 1", "engine /generate"),
    ]
    # turns/s, then 3 CPU figures for the recorder's rows, 2 for the engine's.
    assert [len(numbers(m[45:])) for m in medians] == [4, 3, 4, 3]
