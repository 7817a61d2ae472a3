"""Token ids as the JSON `/generate` wants, encoding only what is new since a session's last call.

SGLang 0.5.23's `/generate` takes a JSON body only (its HTTP server refuses
any other content type) and `input_ids` as a list of ints, so a 100k-token
prompt is ~600 kB of JSON digits every turn: ~1-1.4 ms of orjson on this
machine, more than half the per-turn CPU budget at 100k. A session's prompt
is its previous prompt (or its previous prompt + partial output, when
resumed) plus a few hundred new tokens, so the JSON of the previous prompt
is kept per session, and only the new tokens are encoded and appended.

A cached text is used only for ids that provably start with the ids it was
made from: a 128-bit XXH3 digest of their int32 bytes is compared (~30 µs
per 100k tokens, against ~1 ms to re-encode), so a rewound chain, a
compaction or another chain of the same session re-encodes from scratch and
can never send another prompt's ids. Up to `PER_KEY` prompts are kept per
session (a main line and a subagent interleave); the whole cache holds at
most `max_bytes` of JSON, least recently used evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import orjson
import xxhash

from recorder.model.engine_wire import json_ids

PER_KEY = 2  # prompts kept per session: its main line and one subagent


@dataclass(frozen=True, slots=True)
class _Encoded:
    n: int  # how many ids
    digest: bytes  # xxh3_128 of their int32 bytes
    text: bytes  # their JSON array without the closing "]"


class IdsJson:
    """JSON arrays of token ids, each session's last prompts kept for the next call."""

    def __init__(self, max_bytes: int = 128 << 20) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self.reused = 0  # calls that encoded only new ids (what /health-style probes read)
        self._by_key: OrderedDict[str, list[_Encoded]] = OrderedDict()

    def encode(self, ids: Sequence[int] | np.ndarray, key: str | None = None) -> bytes:
        """`ids` as a JSON array (exactly `orjson.dumps(list(ids))`); `key` names the session."""
        arr = json_ids(ids)
        if key is None or self.max_bytes <= 0 or isinstance(arr, list) or len(arr) == 0:
            return orjson.dumps(arr, option=orjson.OPT_SERIALIZE_NUMPY)
        raw = memoryview(np.ascontiguousarray(arr, dtype=np.int32)).cast("B")
        held = self._by_key.get(key, [])
        base = next((e for e in held if _starts(raw, e)), None)
        if base is None:
            text = orjson.dumps(arr, option=orjson.OPT_SERIALIZE_NUMPY)
        else:
            self.reused += 1
            new = arr[base.n :]
            tail = orjson.dumps(new, option=orjson.OPT_SERIALIZE_NUMPY)[1:] if len(new) else b"]"
            text = base.text + (b"," + tail if len(new) else tail)
        entry = _Encoded(len(arr), xxhash.xxh3_128_digest(raw), text[:-1])
        self._keep(key, entry, [e for e in held if e is not base])
        return text

    def forget(self, key: str) -> None:
        """Drop a session's prompts (it closed)."""
        for e in self._by_key.pop(key, []):
            self.held_bytes -= len(e.text)

    def _keep(self, key: str, entry: _Encoded, others: list[_Encoded]) -> None:
        if len(entry.text) > self.max_bytes:
            return
        self.forget(key)
        kept = [entry, *others[: PER_KEY - 1]]
        self._by_key[key] = kept
        self.held_bytes += sum(len(e.text) for e in kept)
        while self.held_bytes > self.max_bytes:
            self.forget(next(iter(self._by_key)))


def _starts(raw: memoryview, entry: _Encoded) -> bool:
    """Do the int32 bytes `raw` start with the ids `entry` was made from?"""
    n = entry.n * 4
    return len(raw) >= n and xxhash.xxh3_128_digest(raw[:n]) == entry.digest
