"""Limits every JSON body meets before it is decoded: nesting depth and integer size.

Checked once on the raw bytes, by every route that decodes JSON (both
dialects' `parse_request`, the admin API), so no later step meets what it
cannot handle: 3,000 levels of nesting raised RecursionError in the decoder or
in whatever walked the value next (digests, the log's encoder), and an integer
beyond 64 bits raised OverflowError when the log encoded it or the engine got
it. Both were 500s for a client's mistake; here they are one clear message.

The scan is a few C-speed passes (`bytes.translate` finds digit runs and
keeps the brackets, a regex strips strings, numpy sums brackets in chunks):
~1 ms for a Claude Code body, ~10 ms per MB of text with many escapes, and a
body with few brackets and no long digit run (63 MB of one user text) skips
the string pass altogether.
"""

from __future__ import annotations

import re

import numpy as np

# Far above any real tool schema or metadata (Claude Code's deepest is ~8), far
# below Python's recursion limit, which the decoder and the log's encoder share.
MAX_DEPTH = 128
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_LONG_INT = re.compile(rb"(?<![\d.eE+-])-?\d{19,}(?![\d.eE])")
_KEEP_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# Every digit as "0", every other byte as a space: a run of 19 digits (the only
# way to spell an integer beyond 64 bits) is then a substring search, ~5x faster
# than a regex (0.33 ms for a 450 kB body instead of 1.9 ms).
_DIGITS_AS_ZERO = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_DIGIT_RUN = b"0" * 19
_CHUNK = 1 << 20


def json_problem(body: bytes, max_depth: int = MAX_DEPTH) -> str | None:
    """Why `body` breaks a limit (a message for the client), or None if it does not."""
    shallow = body.count(b"[") + body.count(b"{") <= max_depth
    if shallow and not _has_digit_run(body):
        return None  # the common case for a body that is mostly one long text
    structure = _STRING.sub(b'""', body) if b'"' in body else body
    depth = 0 if shallow else _max_depth(structure.translate(None, _KEEP_BRACKETS))
    if depth > max_depth:
        return (
            f"JSON nested {depth} levels deep; at most {max_depth} levels are accepted "
            "(flatten the value)"
        )
    for match in _LONG_INT.finditer(structure):
        if not INT64_MIN <= int(match.group()) <= INT64_MAX:
            shown = match.group()[:30].decode()
            return (
                f"integer {shown}{'...' if len(match.group()) > 30 else ''} is out of range: "
                "numbers must fit in 64 bits"
            )
    return None


def _has_digit_run(body: bytes) -> bool:
    """Does `body` hold 19 digits in a row? (In chunks: memory stays ~1 MB.)"""
    if len(body) <= _CHUNK:
        return _DIGIT_RUN in body.translate(_DIGITS_AS_ZERO)
    overlap = len(_DIGIT_RUN) - 1
    return any(
        _DIGIT_RUN in body[start : start + _CHUNK + overlap].translate(_DIGITS_AS_ZERO)
        for start in range(0, len(body), _CHUNK)
    )


def _max_depth(brackets: bytes) -> int:
    """The deepest nesting of a string of `[]{}` (chunked: memory stays ~5 MB)."""
    if not brackets:
        return 0
    deepest = level = 0
    for start in range(0, len(brackets), _CHUNK):
        chunk = np.frombuffer(
            brackets, np.uint8, count=min(_CHUNK, len(brackets) - start), offset=start
        )
        steps = np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1).astype(np.int64)
        running = np.cumsum(steps) + level
        deepest = max(deepest, int(running.max()))
        level = int(running[-1])
    return deepest
