"""Which paths a diff changes, read as git applies it: `git apply --numstat -z` for where
each change goes, the diff's `rename from` / `copy from` lines for where a rename comes
from (quoted as git quotes names), and whether any of them is what setup made."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from recorder.rollout.diff import numstat_paths, rename_sources, setup_made, unquote_path

NAMES = ["plain.txt", "sp ace.txt", 'quo"te.txt', "tab\there.txt", "ünï.txt", "back\\slash"]


def _git(repo: Path, *args: str, stdin: bytes | None = None) -> bytes:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        input=stdin, capture_output=True, check=True,
    ).stdout  # fmt: skip


def test_the_paths_of_a_diff_are_those_git_applies(tmp_path: Path) -> None:
    repo = tmp_path / "r"
    repo.mkdir()
    _git(repo, "init", "-q")
    for name in NAMES:
        (repo / name).write_text(f"{name}\n" * 20)
    (repo / "gone.txt").write_text("x\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    for name in NAMES:
        _git(repo, "mv", name, "moved-" + name)
    (repo / "gone.txt").unlink()
    (repo / "new dir").mkdir()
    (repo / "new dir" / "bin\x01.dat").write_bytes(b"\xff\x00")
    _git(repo, "add", "-A")
    patch = _git(repo, "diff", "--cached", "--binary", "--full-index", "-M", "HEAD")
    _git(repo, "reset", "-q", "--hard")
    listed = _git(repo, "apply", "--numstat", "-z", "-", stdin=patch).decode()
    touched = set(numstat_paths(listed)) | set(rename_sources(patch))
    moved = {"moved-" + n for n in NAMES}
    assert touched == {*NAMES, *moved, "gone.txt", "new dir/bin\x01.dat"}
    assert set(rename_sources(patch)) == set(NAMES)


@pytest.mark.parametrize(
    ("listed", "paths"),
    [
        ("1\t0\ta.txt\0-\t-\tb.bin\0", ["a.txt", "b.bin"]),
        ("0\t0\t\0old name\0new\tname\0" + "2\t1\tc\0", ["old name", "new\tname", "c"]),
        ("", []),
    ],
)
def test_numstat_output_both_ways_git_writes_a_rename(listed: str, paths: list[str]) -> None:
    assert numstat_paths(listed) == paths


@pytest.mark.parametrize(
    ("raw", "name"),
    [
        (b"plain", "plain"),
        (b'"a\\"b"', 'a"b'),
        (b'"t\\tab\\\\n"', "t\tab\\n"),
        (b'"\\303\\274"', "ü"),
        (b'"x"', "x"),
    ],
)
def test_a_quoted_name_reads_back_as_it_was(raw: bytes, name: str) -> None:
    assert unquote_path(raw) == name


def test_what_setup_made_covers_its_files_and_everything_below_its_directories() -> None:
    made = ("calc.egg-info/", "VERSION", "build/lib/")
    paths = [
        "calc.egg-info/entry_points.txt",
        "calc.egg-info",  # a file where setup made a directory: not below it
        "VERSION",
        "VERSION.txt",
        "build/lib/x.so",
        "build/other",
        "calc.py",
        "VERSION",
    ]
    assert setup_made(paths, made) == [
        "calc.egg-info/entry_points.txt",
        "VERSION",
        "build/lib/x.so",
    ]
    assert setup_made(paths, ()) == []
