"""A Ray node's directory (`cluster.safe_node_dir`): what it runs and clones, no other user's.

A node npm-installs the agent CLI into its node directory and later rollouts run
that binary; it unpacks each task's repository there and sandboxes clone it. The
old default was in /tmp, where any user (a sandbox's among them) could make the
directory first and plant a binary, a repository with the fix in its history, or
a link for root to write through. No Ray needed: the checks are on the file system.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from recorder.rollout import cluster
from recorder.rollout.errors import InfraError

OTHER = 65534  # nobody


def refused(path: Path) -> str:
    with pytest.raises(InfraError) as info:
        cluster.safe_node_dir(str(path))
    assert info.value.cause == "sandbox_boot"
    assert "--ray-node-dir" in info.value.message
    return info.value.message


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A directory every user may write, sticky, as /tmp is."""
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o1777)
    return d


def test_a_new_directory_is_made_and_taken(tmp_path: Path, shared: Path) -> None:
    made = cluster.safe_node_dir(str(tmp_path / "a" / "b"))
    assert made == (tmp_path / "a" / "b").resolve() and made.is_dir()
    assert made.stat().st_mode & 0o777 == 0o755
    # Below a sticky directory others may write, ours stays ours: taken.
    assert cluster.safe_node_dir(str(shared / "node")).is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's directory needs root")
def test_a_directory_another_user_made_first_is_refused(shared: Path) -> None:
    planted = shared / "node"
    (planted / "agents").mkdir(parents=True)
    for p in (planted, planted / "agents"):
        os.chown(p, OTHER, OTHER)
    assert f"owned by uid {OTHER}" in refused(planted)
    # Asking for a directory inside it is refused for the same reason.
    assert f"{planted} is owned by uid {OTHER}" in refused(planted / "inner")


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's directory needs root")
def test_a_link_another_user_planted_is_followed_and_refused(tmp_path: Path, shared: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER, OTHER)
    (shared / "node").symlink_to(theirs)
    os.lchown(shared / "node", OTHER, OTHER)
    assert f"{theirs} is owned by uid {OTHER}" in refused(shared / "node")


def test_a_directory_others_may_write_is_refused(tmp_path: Path, shared: Path) -> None:
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o775)
    assert "writable by its group" in refused(group)
    assert "writable by its group" in refused(group / "node")  # above it counts too
    # Sticky or not, the node directory itself must be its owner's alone.
    assert "writable by every user" in refused(shared)


def test_the_default_is_outside_the_temp_dir() -> None:
    path = cluster.default_node_dir()
    if os.geteuid() == 0:
        assert path == cluster.ROOT_NODE_DIR
    assert not path.startswith("/tmp")
    assert cluster.RayOptions().node_dir is None  # resolved on each node
