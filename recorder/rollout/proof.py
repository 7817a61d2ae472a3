"""pytest's own verdict, in a form the code under test cannot forge without looking for it.

The code under test runs inside the grader's pytest process. An audit showed a
module that, imported while pytest collects, wrote `PASSED <id>` for every id
and a counts line to the pipes pytest keeps for its real output, then ended
the process with `os._exit(0)`: exit code 0, a clean report, nothing fixed.
Any text on the grader's output can be printed by the code it runs.

So a grader that runs pytest gets a plugin of ours: a module with a fresh
random name, written outside the repository and loaded with `-p` (through
`PYTHONPATH` and `PYTEST_ADDOPTS`) before pytest imports any test. It takes
each test's outcome from pytest's own reports, and when pytest ends normally
(`pytest_unconfigure`, which `os._exit` skips) writes one line to the output
pytest had before it captured anything: `TR-PROOF <nonce> <base64 JSON>`.
Only such lines count (`read_proofs`): a run that left early has none, and a
line printed by the code under test lacks the nonce.

The nonce is fresh for each grading and sits in a file beside the plugin that
the plugin reads and deletes when the grader's pytest loads it, before any
test is imported: a second pytest that the code under test starts (a second
audit re-ran pytest on passing stubs, with the grader's environment) loads
the plugin too, finds no nonce and reports nothing. The plugin also notes the
parts of pytest that run a test and report it (`Function.runtest`,
`call_and_report`, ...) when it starts, and a run where any of them was
replaced by its end passes nothing (`tampered`): the same audit replaced
`Function.runtest` with a no-op. And a test skipped from inside its body (the
code under test raising unittest's `SkipTest`) does not count as clean for an
exit-code grader.

What it does not stop: code that looks for this plugin in memory, or tampers
with pytest somewhere it does not watch, when the tests import it. No grader
that runs the code under test in its own process can rule that out.
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
# A shell assignment of a variable the plugin is loaded through, with a value that is a
# plain word or one quoted string, ending where the word ends.
_ASSIGNMENT = re.compile(
    r"(?<![\w${])(?P<name>PYTHONPATH|PYTEST_ADDOPTS)="
    r"(?P<value>\"[^\"`\\]*\"|'[^']*'|[^\s;&|()<>`\"'\\]*)(?=[\s;&|)]|$)"
)

_PLUGIN = '''"""The recorder's grader plugin (recorder/rollout/proof.py)."""
import base64
import json
import os


def _take_nonce():
    # Read once, by the grader's own pytest, and gone before any test is imported: a
    # pytest the code under test starts loads this plugin too, but has no nonce.
    path = os.path.splitext(__file__)[0] + ".nonce"
    try:
        with open(path) as f:
            nonce = f.read().strip()
    except OSError:
        return None
    try:
        os.unlink(path)
    except OSError:
        pass  # not ours to remove: it stays readable, and a second pytest could report
    return nonce


NONCE = _take_nonce()
_out = os.dup(1)  # pytest's own output, before it captures anything
_seen = {}
_exit = None
_config = None
_watched = {}


def _machinery():
    # What runs a test and reports it; code under test that replaces any of it (say
    # Function.runtest with a no-op) makes the run's report worthless.
    import _pytest.python as python
    import _pytest.reports as reports
    import _pytest.runner as runner

    found = {}
    for owner, names in (
        (python.Function, ("runtest", "setup")),
        (python, ("pytest_pyfunc_call",)),
        (runner, ("call_and_report", "runtestprotocol", "call_runtest_hook",
                  "pytest_runtest_makereport", "check_interactive_exception")),
        (runner.CallInfo, ("from_call",)),
        (reports.TestReport, ("from_item_and_call", "__init__")),
    ):
        for name in names:
            found[f"{owner.__name__}.{name}"] = vars(owner).get(name)
    return found


def pytest_configure(config):
    global _config, _watched
    _config = config
    _watched = _machinery()


def pytest_runtest_logreport(report):
    # As the task names its tests and pytest's -rA lines print them: from where it runs.
    test = _config.cwd_relative_nodeid(report.nodeid) if _config else report.nodeid
    if _seen.get(test) == "failed":
        return  # a failure (a teardown's too) is never taken back
    if report.outcome == "failed":
        _seen[test] = "failed"
    elif report.when == "call" and report.outcome == "skipped" and not hasattr(report, "wasxfail"):
        _seen[test] = "skipped in the test"  # raised while it ran: by the code under test?
    elif report.when == "call" or report.outcome == "skipped":
        _seen[test] = report.outcome


def pytest_sessionfinish(session, exitstatus):
    global _exit
    _exit = int(exitstatus)


def pytest_unconfigure(config):
    if NONCE is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # not the grader's own pytest, or an xdist worker (the controller reports)
    now = _machinery()
    tampered = sorted(k for k, v in _watched.items() if now.get(k) is not v)
    report = {"tests": _seen, "exit": _exit, "tampered": tampered}
    body = base64.b64encode(json.dumps(report).encode())
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

    def files(self, workdir: str) -> dict[str, str]:
        """What to write in the eval sandbox before the grader runs: path -> text."""
        base = posixpath.join(workdir, PROOF_DIR, self.module)
        return {f"{base}.py": _PLUGIN, self.nonce_file(workdir): self.nonce}

    def nonce_file(self, workdir: str) -> str:
        """The nonce's file: the grader's pytest deletes it when it loads the plugin."""
        return posixpath.join(workdir, PROOF_DIR, f"{self.module}.nonce")

    def wrap(self, cmd: str, workdir: str) -> str:
        """`cmd` with pytest told to load the plugin (kept: the sandbox's own settings)."""
        where = shlex.quote(posixpath.join(workdir, PROOF_DIR))
        return (
            f'export PYTHONPATH={where}"${{PYTHONPATH:+:$PYTHONPATH}}" '
            f'PYTEST_ADDOPTS="${{PYTEST_ADDOPTS:+$PYTEST_ADDOPTS }}-p {self.module}"\n'
            f"{self.kept_through(cmd, workdir)}"
        )

    def kept_through(self, script: str, workdir: str) -> str:
        """`script` with each assignment that would drop the plugin keeping it.

        A grader's `PYTHONPATH=lib pytest` (or `PYTEST_ADDOPTS=-x`) replaces what
        `wrap` exported: pytest cannot import the plugin, reports nothing, and every
        patch, a correct fix too, earns 0. An assignment that keeps the variable's
        value (`PYTHONPATH=lib:$PYTHONPATH`) is left as it is, and so is one whose value
        is not a plain word or quoted string (`$(pwd)/lib`): rewriting that could
        change what the task's command means."""
        where = posixpath.join(workdir, PROOF_DIR)
        quoted = _quoted(script)

        def keep(m: re.Match[str]) -> str:
            name, value = m.group("name"), m.group("value")
            if name in value or quoted[m.start()]:  # inside quotes: `bash -c '...'`, an id
                return m.group(0)
            if name == "PYTHONPATH":
                added = shlex.quote(f":{where}" if value.strip("\"'") else where)
                return f"{name}={value}{added}"
            return f"{name}={value}{shlex.quote(f' -p {self.module}')}"

        return _ASSIGNMENT.sub(keep, script)


def _quoted(script: str) -> list[bool]:
    """For each character of a shell script: is it inside quotes (or escaped)?

    An assignment inside quotes is another program's text (`bash -c 'A=1 pytest'`, a
    test id): appending to it there had ended the quoted string early and cut the
    grader's command short. Heredoc bodies count as unquoted."""
    flags = [False] * len(script)
    quote, escaped = "", False
    for i, c in enumerate(script):
        flags[i] = bool(quote) or escaped
        if escaped:
            escaped = False
        elif c == "\\" and quote != "'":
            escaped = True
        elif quote:
            if c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
    return flags


class Run(msgspec.Struct, frozen=True):
    """One pytest run's report: test id -> "passed" / "failed" / "skipped" / "skipped in
    the test", its exit status, and the parts of pytest found replaced at its end."""

    tests: dict[str, str]
    exit: int | None
    tampered: list[str] = []


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
    """Each test's outcome over all runs; a failure in any run stands, and a run whose
    pytest was tampered with passes nothing."""
    merged: dict[str, str] = {}
    for run in runs:
        for test, outcome in run.tests.items():
            if run.tampered:
                outcome = "failed"
            if merged.get(test) != "failed":
                merged[test] = outcome
    return merged


def clean(runs: list[Run]) -> bool:
    """At least one run; each untampered, ended with exit status 0, a test passed, none
    failed, and none skipped from inside the test (unittest's SkipTest raised by the code
    under test turned a failing test into a skip)."""
    return bool(runs) and all(
        r.exit == 0
        and not r.tampered
        and "passed" in r.tests.values()
        and not {"failed", "skipped in the test"} & set(r.tests.values())
        for r in runs
    )
