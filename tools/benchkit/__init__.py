"""The benchmarks' shared harness: one implementation of each thing a `tools/bench_*.py` repeats.

- `procs`: child processes run from the repository (`PYTHONPATH`), and a
  measurement run in a fresh interpreter that reports one JSON line.
- `engine`: the scripted engine timing its `/generate` calls (thread or child
  process), and the test engine as a subprocess.
- `recorder`: the recorder under test, `recorder serve` in a child process
  (or its full re-render peer) or a `RecorderServer` in this process.
- `peer`: the full re-render + re-tokenize planner, the baseline several
  benchmarks measure against.
- `slime_peer`: slime's agent middleware (its real AnthropicAdapter, run from
  a checkout) in a child process, the cpu section's `--slime-src` contender.
- `probes`: patches timing an in-process recorder's own planner, parse and
  store calls.
- `conversation`: Claude-Code-shaped sessions (synthetic text, tools, the
  model's tool call) that grow turn by turn.
- `wire`: the HTTP side: admin API (open/close sessions), request headers,
  streamed answers parsed back, the Chat Completions twin of a body.
- `stats`: medians, percentiles, interleaved repeats, intervals, slopes.
- `memory`: RSS of this or another process (current, peak, anonymous).
- `table`: rich tables and fixed-width text tables.
"""
