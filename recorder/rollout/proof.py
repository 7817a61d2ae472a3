"""pytest's own verdict, in a form the code under test cannot forge without looking for it.

The code under test runs inside the grader's pytest process. An audit showed a
module that, imported while pytest collects, wrote `PASSED <id>` for every id
and a counts line to the pipes pytest keeps for its real output, then ended
the process with `os._exit(0)`: exit code 0, a clean report, nothing fixed.
Any text on the grader's output can be printed by the code it runs.

So a grader that runs pytest gets a plugin of ours: a module with a fresh
random name, written outside the repository and loaded with `-p` (through
`PYTHONPATH` and `PYTEST_ADDOPTS`, before pytest imports any test). It takes
each test's outcome from pytest's own reports, and when pytest ends normally
(`pytest_unconfigure`, which `os._exit` skips) writes one line to the output
pytest had before it captured anything: `TR-PROOF <nonce> <base64 JSON>`, the
nonce fresh for each grading and written nowhere else. Only such lines count
(`read_proofs`): a run that left early has none, and a line printed by the
code under test lacks the nonce.

What it does not stop: code that looks for this plugin in memory, or rewrites
pytest's report objects, when the tests import it. It stops code that does
not know of it, which is all a policy can learn from its own sandbox (it never
sees a grader).
"""

from __future__ import annotations

import base64
import binascii
import posixpath
import re
import secrets
import shlex

import msgspec

PROOF_DIR = ".tr-grader"  # in the eval sandbox's directory, outside the repository
_LINE = re.compile(r"^TR-PROOF ([0-9a-f]{32}) ([A-Za-z0-9+/=]+)$")

_PLUGIN = '''"""The recorder's grader plugin (recorder/rollout/proof.py)."""
import base64
import json
import os

NONCE = {nonce!r}
_out = os.dup(1)  # pytest's own output, before it captures anything
_seen = {{}}
_exit = None
_config = None


def pytest_configure(config):
    global _config
    _config = config


def pytest_runtest_logreport(report):
    # As the task names its tests and pytest's -rA lines print them: from where it runs.
    test = _config.cwd_relative_nodeid(report.nodeid) if _config else report.nodeid
    if _seen.get(test) == "failed":
        return  # a failure (a teardown's too) is never taken back
    if report.outcome == "failed":
        _seen[test] = "failed"
    elif report.when == "call" or report.outcome == "skipped":
        _seen[test] = report.outcome


def pytest_sessionfinish(session, exitstatus):
    global _exit
    _exit = int(exitstatus)


def pytest_unconfigure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # an xdist worker: its output is the channel; the controller reports
    body = base64.b64encode(json.dumps({{"tests": _seen, "exit": _exit}}).encode())
    data = b"\\nTR-PROOF " + NONCE.encode() + b" " + body + b"\\n"
    while data:
        data = data[os.write(_out, data):]
'''


class Proof(msgspec.Struct, frozen=True):
    """One grading's plugin: its module name and nonce."""

    module: str
    nonce: str

    @classmethod
    def new(cls) -> Proof:
        return cls(module=f"tr_proof_{secrets.token_hex(8)}", nonce=secrets.token_hex(16))

    def source(self) -> str:
        return _PLUGIN.format(nonce=self.nonce)

    def path(self, workdir: str) -> str:
        return posixpath.join(workdir, PROOF_DIR, f"{self.module}.py")

    def wrap(self, cmd: str, workdir: str) -> str:
        """`cmd` with pytest told to load the plugin (kept: the sandbox's own settings)."""
        where = shlex.quote(posixpath.join(workdir, PROOF_DIR))
        return (
            f'export PYTHONPATH={where}"${{PYTHONPATH:+:$PYTHONPATH}}" '
            f'PYTEST_ADDOPTS="${{PYTEST_ADDOPTS:+$PYTEST_ADDOPTS }}-p {self.module}"\n{cmd}'
        )


class Run(msgspec.Struct, frozen=True):
    """One pytest run's report: test id -> "passed" / "failed" / "skipped", exit status."""

    tests: dict[str, str]
    exit: int | None


def read_proofs(text: str, nonce: str) -> list[Run]:
    """The runs our plugin reported in `text` under `nonce` (one per pytest run that ended)."""
    runs = []
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m is None or m.group(1) != nonce:
            continue
        try:
            runs.append(msgspec.json.decode(base64.b64decode(m.group(2)), type=Run))
        except (binascii.Error, msgspec.ValidationError, msgspec.DecodeError):
            continue
    return runs


def outcomes(runs: list[Run]) -> dict[str, str]:
    """Each test's outcome over all runs; a failure in any run stands."""
    merged: dict[str, str] = {}
    for run in runs:
        for test, outcome in run.tests.items():
            if merged.get(test) != "failed":
                merged[test] = outcome
    return merged


def clean(runs: list[Run]) -> bool:
    """At least one run, each ended with exit status 0, a test passed and none failed."""
    return bool(runs) and all(
        r.exit == 0 and "passed" in r.tests.values() and "failed" not in r.tests.values()
        for r in runs
    )
