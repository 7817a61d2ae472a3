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

Protected tests (graded in the eval sandbox only, `recorder.rollout.protect`):
`test_patch` is applied after the agent's patch (a conflict is reward 0);
`protected_paths` (git globs) are restored from `base_commit` before that; by
default the files `tests` names, their `conftest.py` files and the files
`test_patch` touches are protected.

Rows as SWE-bench, SWE-Gym and SWE-smith publish them load too
(`from_published`): top-level `FAIL_TO_PASS` / `PASS_TO_PASS` (lists or JSON
strings of lists) become `tests`, `patch` (the gold patch) becomes
`gold_patch`, which no sandbox ever receives, and every field this module does
not know is kept in `metadata`, never an error.

A malformed line never stops the others: `load_tasks` returns the good tasks
and, for each bad line, its number, the offending field and what to fix.
"""

from __future__ import annotations

import json
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
    # Applied in the eval sandbox after the agent's patch (SWE-bench's tests).
    test_patch: str | None = None
    # Git globs restored from base_commit before grading; None: the default set.
    protected_paths: list[str] | None = None
    # The reference fix. Never written into any sandbox nor sent to the recorder.
    gold_patch: str | None = None
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


_FIELDS = frozenset(f.encode_name for f in msgspec.structs.fields(Task))
_PUBLISHED_TESTS = ("FAIL_TO_PASS", "PASS_TO_PASS")
_SLUG = re.compile(r"^[\w.-]+/[\w.-]+$")  # SWE-bench's `repo`: "owner/name"


def is_published(data: dict[str, Any]) -> bool:
    """A row in SWE-bench's published layout: its tests at the top level."""
    return "tests" not in data and any(k in data for k in _PUBLISHED_TESTS)


def _test_ids(value: Any, name: str) -> list[Any]:
    """SWE-bench ships the test lists as JSON strings of lists; SWE-Gym as lists."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            raise TaskError("not a list, nor a JSON string of a list", field=name) from None
    return value if value is not None else []


def from_published(data: dict[str, Any]) -> dict[str, Any]:
    """A SWE-bench / SWE-Gym / SWE-smith row in this module's layout.

    `FAIL_TO_PASS` / `PASS_TO_PASS` (+ `test_cmd`, default pytest `-rA`) become
    `tests`; `patch` becomes `gold_patch`; a row without `base_commit` (SWE-smith)
    names its instance's branch, `instance_id`. Rows in the native layout pass
    through. In both, a field `Task` does not know goes to `metadata`.
    """
    row = dict(data)
    if is_published(row):
        tests: dict[str, Any] = {k: _test_ids(row.pop(k, None), k) for k in _PUBLISHED_TESTS}
        if row.get("test_cmd"):
            tests["cmd"] = row.pop("test_cmd")
        row["tests"] = tests
        if "patch" in row:
            row["gold_patch"] = row.pop("patch")
        if not row.get("base_commit") and isinstance(row.get("instance_id"), str):
            row["base_commit"] = row["instance_id"]
    extra = {k: row.pop(k) for k in list(row) if k not in _FIELDS}
    if extra:
        metadata = row.get("metadata")
        row["metadata"] = {**extra, **(metadata if isinstance(metadata, dict) else {})}
    return row


def resolve_repo(
    repo: str, *, base_dir: Path | None, mirrors: Path | None, slug_is_github: bool
) -> str:
    """Where a task's `repo` lives: a URL as is; a path relative to the task file if it
    exists there; an `owner/name` in `mirrors` (`owner__name` or `owner/name`); else,
    for a published row, `https://github.com/owner/name.git`."""
    if "://" in repo or re.match(r"^[\w.-]+@[\w.-]+:", repo) or Path(repo).is_absolute():
        return repo
    local = (base_dir / repo).resolve() if base_dir is not None else Path(repo)
    if local.exists() or not _SLUG.match(repo):
        return str(local)
    if mirrors is not None:
        owner, name = repo.split("/")
        for candidate in (mirrors / f"{owner}__{name}", mirrors / owner / name):
            if candidate.exists():
                return str(candidate.resolve())
        if not slug_is_github:
            raise TaskError(
                f"{repo!r} is neither in {mirrors} (as {owner}__{name} or {owner}/{name}) "
                "nor a path next to the task file",
                field="repo",
            )
    return f"https://github.com/{repo}.git" if slug_is_github else str(local)


def task_from_dict(data: Any, *, base_dir: Path | None = None, mirrors: Path | None = None) -> Task:
    """Validate one task; raises `TaskError` naming the field. Relative local repos
    resolve against `base_dir` (the task file's directory); `owner/name` repos against
    `mirrors`, then GitHub (`resolve_repo`)."""
    if not isinstance(data, dict):
        raise TaskError(f"expected a JSON object, got {type(data).__name__}")
    published = is_published(data)
    try:
        task = msgspec.convert(from_published(data), Task)
    except msgspec.ValidationError as exc:
        field, message = _field_of(str(exc))
        raise TaskError(message, field=field) from None
    if task.is_local_repo and (base_dir is not None or mirrors is not None):
        where = resolve_repo(
            task.repo, base_dir=base_dir, mirrors=mirrors, slug_is_github=published
        )
        task = msgspec.structs.replace(task, repo=where)
    return task


class TaskLineError(msgspec.Struct, frozen=True, kw_only=True):
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        at = f" {self.field}:" if self.field else ""
        return f"line {self.line}:{at} {self.message}"


def load_tasks(
    path: str | Path, *, mirrors: str | Path | None = None
) -> tuple[list[Task], list[TaskLineError]]:
    """The valid tasks of a JSONL file, and an error for each bad line (blank lines skipped).

    A duplicate `instance_id` is an error on the later line (sessions and
    groups are named after it). `mirrors`: a directory of local clones that
    `owner/name` repos resolve to before GitHub.
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
            task = task_from_dict(
                data, base_dir=path.parent, mirrors=Path(mirrors) if mirrors else None
            )
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
