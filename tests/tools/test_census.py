"""The memory census counts what a structure keeps alive, each object once."""

from __future__ import annotations

import sys
from array import array

import msgspec
import numpy as np

from tools.benchkit.census import Walk, buffer_owner, python_arenas, raw_base


def test_a_view_counts_the_whole_buffer_it_keeps_alive() -> None:
    owner = np.zeros(100_000, dtype=np.int32)
    view = owner[10:20]
    assert buffer_owner(view) is owner
    assert Walk().size(view) >= owner.nbytes
    body = bytes(200_000)
    assert Walk().size(memoryview(body)[:5]) >= len(body)


def test_a_raw_counts_the_body_it_was_decoded_from() -> None:
    body = b'[{"a": "' + b"x" * 50_000 + b'"}, 1]'
    first, second = msgspec.json.decode(body, type=list[msgspec.Raw])
    assert raw_base(first) is body and raw_base(second) is body
    walk = Walk()
    assert walk.size(first) >= len(body)
    assert walk.size(second) < 100  # the body is counted once, by the first
    assert Walk().size(msgspec.Raw(b"[1]")) < 200  # a Raw of its own bytes


def test_each_object_counts_once_and_shared_ones_never() -> None:
    tokens = array("i", range(10_000))
    shared = {"store": bytes(100_000)}
    state = {"a": tokens, "b": [tokens, tokens], "store": shared}
    walk = Walk([shared])
    first = walk.size(state)
    assert sys.getsizeof(tokens) <= first < sys.getsizeof(tokens) + 2_000
    assert walk.size(tokens) == 0  # already counted


def test_python_arenas_are_read_from_the_allocator() -> None:
    arenas = python_arenas()
    assert arenas["arenas"] >= arenas["in use"] > 0
