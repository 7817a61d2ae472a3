"""The speed probe the benchmarks print beside their figures (`tools.benchkit.cpu`)."""

from __future__ import annotations

import re
import time

from tools.benchkit import cpu


def test_probe_times_its_fixed_work_in_cpu_ms() -> None:
    t0 = time.process_time()
    ms = cpu.speed_probe_ms(rounds=3)
    spent_ms = (time.process_time() - t0) * 1e3
    # The median of three rounds cannot exceed the CPU the three rounds took.
    assert 0 < ms <= spent_ms
    assert cpu._probe_work(5) == 0 + 1 + 2 + 3 + 4  # the work is what it says


def test_probe_counts_cpu_not_wall_time(monkeypatch) -> None:
    """A probe that sleeps (a busy neighbour taking the core) reads the same:
    it times this process's CPU, so the figure is the host's speed, not the load."""
    work = cpu._probe_work

    def slow_work(n: int) -> int:
        time.sleep(0.05)
        return work(n)

    monkeypatch.setattr(cpu, "PROBE_LOOPS", 200_000)
    plain = cpu.speed_probe_ms(rounds=3)
    monkeypatch.setattr(cpu, "_probe_work", slow_work)
    slept = cpu.speed_probe_ms(rounds=3)
    assert slept < plain + 25  # 50 ms of sleep per round did not count


def test_machine_state_line() -> None:
    line = cpu.machine_state()
    assert re.fullmatch(
        r"load average [\d.]+ [\d.]+ [\d.]+ \(\d+ cores\); speed probe \d+ ms", line
    ), line


def test_probe_span_reads_the_probe_again() -> None:
    line = cpu.probe_span(123.4)
    assert re.fullmatch(
        r"speed probe 123 ms before, \d+ ms after \(tools/benchkit/cpu\.py, lower is faster\)",
        line,
    ), line
