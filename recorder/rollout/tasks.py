"""Rollout tasks: one JSON object a line, validated with msgspec.

A task names a repository at a commit, the problem to solve there, and how to
grade a patch. Exactly one of three graders:

- `eval_cmd`: a shell command; exit code 0 = pass.
- `tests`: SWE-bench style `{"FAIL_TO_PASS": [...], "PASS_TO_PASS": [...]}`,
  run by `tests.cmd` (`{tests}` is replaced by the quoted ids) whose output
  carries a pytest `-rA` style report (`PASSED <id>` / `FAILED <id>` lines).
  A test the report does not name counts as failed.
- `eval_script`: a bash script written into the eval sandbox and run there;
  exit code 0 = pass.

`reward` is `"binary"` (1 if everything passed, else 0; the default) or
`"fraction"` (the passed share of the listed tests; binary for the other two
graders). A `repo` that is a relative path is relative to the task file.

A malformed line never stops the others: `load_tasks` returns the good tasks
and, for each bad line, its number, the offending field and what to fix.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import msgspec

RewardMode = Literal["binary", "fraction"]

DEFAULT_TEST_CMD = "python -m pytest -rA -q -p no:cacheprovider {tests}"


class TaskError(ValueError):
    """A task that does not validate; `field` names the offending field ("" for the line)."""

    def __init__(self, message: str, *, field: str = "", line: int | None = None) -> None:
        where = f"line {line}: " if line is not None else ""
        at = f"{field}: " if field else ""
        super().__init__(f"{where}{at}{message}")
        self.field = field
        self.line = line
        self.reason = message


class TestSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The tests a patch must pass, as SWE-bench rows list them."""

    __test__ = False  # not a pytest class

    fail_to_pass: list[str] = msgspec.field(default_factory=list, name="FAIL_TO_PASS")
    pass_to_pass: list[str] = msgspec.field(default_factory=list, name="PASS_TO_PASS")
    cmd: str = DEFAULT_TEST_CMD

    def __post_init__(self) -> None:
        if not self.fail_to_pass and not self.pass_to_pass:
            raise ValueError("name at least one test in FAIL_TO_PASS or PASS_TO_PASS")
        if "{tests}" not in self.cmd:
            raise ValueError("cmd must contain {tests} (where the test ids go)")

    @property
    def all(self) -> list[str]:
        return [*self.fail_to_pass, *self.pass_to_pass]


class Task(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    instance_id: str
    repo: str  # a local path (of a git repository) or a git URL
    base_commit: str
    problem_statement: str
    setup: list[str] = []  # run after checkout, in the agent's and in the eval sandbox
    eval_cmd: str | None = None
    tests: TestSpec | None = None
    eval_script: str | None = None
    reward: RewardMode = "binary"
    eval_timeout_s: float = 600.0
    setup_timeout_s: float = 600.0
    metadata: dict[str, Any] = {}

    def __post_init__(self) -> None:
        for name in ("instance_id", "repo", "base_commit", "problem_statement"):
            if not getattr(self, name).strip():
                raise ValueError(f"{name} must not be empty")
        graders = [g for g in ("eval_cmd", "tests", "eval_script") if getattr(self, g) is not None]
        if len(graders) != 1:
            raise ValueError(
                "give exactly one of eval_cmd, tests, eval_script"
                + (f" (got {', '.join(graders)})" if graders else "")
            )

    @property
    def is_local_repo(self) -> bool:
        return "://" not in self.repo and not re.match(r"^[\w.-]+@[\w.-]+:", self.repo)


_AT_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")


def _field_of(message: str) -> tuple[str, str]:
    """(field path, message without the path) from a msgspec ValidationError message."""
    field = ""
    m = _AT_PATH.search(message)
    if m:
        field = m.group(1)
        message = message[: m.start()]
    for pattern in (_MISSING, _UNKNOWN):
        found = pattern.search(message)
        if found:
            field = f"{field}.{found.group(1)}" if field else found.group(1)
    return field, message


def task_from_dict(data: Any, *, base_dir: Path | None = None) -> Task:
    """Validate one task; raises `TaskError` naming the field. Relative local repos
    resolve against `base_dir` (the task file's directory)."""
    if not isinstance(data, dict):
        raise TaskError(f"expected a JSON object, got {type(data).__name__}")
    try:
        task = msgspec.convert(data, Task)
    except msgspec.ValidationError as exc:
        field, message = _field_of(str(exc))
        raise TaskError(message, field=field) from None
    if base_dir is not None and task.is_local_repo and not Path(task.repo).is_absolute():
        task = msgspec.structs.replace(task, repo=str((base_dir / task.repo).resolve()))
    return task


class TaskLineError(msgspec.Struct, frozen=True, kw_only=True):
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        at = f" {self.field}:" if self.field else ""
        return f"line {self.line}:{at} {self.message}"


def load_tasks(path: str | Path) -> tuple[list[Task], list[TaskLineError]]:
    """The valid tasks of a JSONL file, and an error for each bad line (blank lines skipped).

    A duplicate `instance_id` is an error on the later line (sessions and
    groups are named after it).
    """
    path = Path(path)
    tasks: list[Task] = []
    errors: list[TaskLineError] = []
    seen: set[str] = set()
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            data = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            errors.append(TaskLineError(line=number, field="", message=f"not valid JSON: {exc}"))
            continue
        try:
            task = task_from_dict(data, base_dir=path.parent)
        except TaskError as exc:
            errors.append(TaskLineError(line=number, field=exc.field, message=exc.reason))
            continue
        if task.instance_id in seen:
            errors.append(
                TaskLineError(
                    line=number,
                    field="instance_id",
                    message=f"duplicate {task.instance_id!r}; instance ids must be unique",
                )
            )
            continue
        seen.add(task.instance_id)
        tasks.append(task)
    return tasks, errors
