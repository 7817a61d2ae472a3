"""The per-session cache of translated messages (one per session, LRU, bounded).

A client resends the whole conversation every turn. With a `ParseCache`
only the messages whose JSON bytes were not seen before are decoded,
validated and translated (by the `translate_message` the caller passes), so
a turn costs what its new messages cost plus one scan of the body.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

# A translated message as the cache keeps it: a plain tuple (role, chat messages,
# digests, tool_use ids, tool_result ids), so an entry costs the cyclic GC two
# tracked objects (this tuple and its tuple of message dicts; the dicts of plain
# text and the tuples of strings are untracked), not three.
CachedPiece = tuple[
    str, tuple[dict[str, Any], ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]
]


class Conversation(Protocol):
    """What the cache needs of the conversation it adds messages to."""

    def check_tool_results(self, piece: CachedPiece, index: int) -> None: ...

    def add(self, piece: CachedPiece) -> None: ...


class ParseCache:
    """One session's translated messages, keyed by a digest of their JSON bytes (LRU, bounded).

    Identical bytes decode to the identical message, so a hit needs no
    decoding, validation or translation; only the cross-message rules run
    again (`_Conversation`). The key is a 16-byte BLAKE2b digest, not a copy
    of the message's JSON: a 100k-token session kept ~540 kB of keys that
    repeated its previous request body byte for byte. The previous request's
    messages are kept as the `msgspec.Raw` views the decoder made (views into
    that request's body, which the server keeps anyway as the basis of the
    next body's delta) with their digests, in order: a message at the same
    position as before is matched by a byte compare against its view, so
    only messages that moved or are new get hashed, and a hit copies nothing.

    Bounds: the least recently used messages go beyond `max_entries` or
    `max_bytes`, where a message is charged twice its JSON size (the JSON a
    view of the previous request keeps alive, plus its translation, which
    decodes to about as much) plus a fixed overhead; and a message no
    request used in the last `max_idle_requests` (history replaced by a
    compaction, a finished subagent) goes too. The previous request's views
    are kept only while its messages total at most `max_bytes` and none is
    too big to cache. Not thread-safe: one
    session's requests are parsed on the server's event loop.

    No object per entry: a translation is kept as a plain tuple and its last
    use and size as ints in flat dicts (untracked by the cyclic GC), two tracked
    objects per message instead of three. Every full collection walks them
    all: after a restart, 256 restored caches of 200 messages made full
    collections take ~150-200 ms each, most of what the restart cost beyond
    its reads and parses (tests/tokens/test_parse_cache.py counts them).
    """

    # Per message beyond 2x its JSON: the translation's dicts and strings (~600 bytes
    # measured by tests/server/test_memory.py), the digest and the dict slots.
    ENTRY_OVERHEAD = 640

    def __init__(
        self, max_entries: int = 4096, max_bytes: int = 16 << 20, max_idle_requests: int = 64
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_idle_requests = max_idle_requests
        # A message bigger than this is translated anew each time and never kept:
        # a near-limit message would push out every other entry, and is sent
        # once or twice (it cannot fit a context many turns in a row).
        self.max_entry_bytes = max_bytes // 16
        self._entries: OrderedDict[bytes, CachedPiece] = OrderedDict()  # LRU first
        self._last_used: dict[bytes, int] = {}  # key -> number of the request
        self._sizes: dict[bytes, int] = {}  # key -> its message's JSON size
        # The previous request's messages (views into its body) and their keys.
        self._previous: list[msgspec.Raw] = []
        self._previous_keys: list[bytes] = []
        self._nbytes = 0
        self._requests = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Memory charged for the cached messages (see the class docstring)."""
        return self._nbytes

    def clear(self) -> None:
        self._entries.clear()
        self._last_used.clear()
        self._sizes.clear()
        self._previous, self._previous_keys = [], []
        self._nbytes = 0

    def add_messages(
        self,
        raws: Sequence[msgspec.Raw],
        conversation: Conversation,
        translate_message: Callable[[bytes, int, Conversation], CachedPiece],
    ) -> None:
        """Add each message to `conversation`, translating only those not cached.

        `translate_message(json bytes, index, conversation)` checks, decodes and
        translates one message (raising `InvalidRequest`).
        """
        self._requests += 1
        now = self._requests
        previous, previous_keys = self._previous, self._previous_keys
        keys: list[bytes] = []
        entries, last_used = self._entries, self._last_used
        total = 0
        for i, raw in enumerate(raws):
            size = len(raw)
            total += size
            if size > self.max_entry_bytes:
                total = self.max_bytes + 1  # its view would keep it alive: keep none
                conversation.add(translate_message(bytes(raw), i, conversation))
                keys.append(b"")  # never kept (see `max_entry_bytes`)
                continue
            if i < len(previous) and previous_keys[i] and previous[i] == raw:
                key = previous_keys[i]
            else:
                key = hashlib.blake2b(raw, digest_size=16).digest()
            piece = entries.get(key)
            if piece is None:
                piece = translate_message(bytes(raw), i, conversation)
                self._put(key, piece, size, now)
            else:
                last_used[key] = now
                entries.move_to_end(key)
                if piece[4]:
                    conversation.check_tool_results(piece, i)
            conversation.add(piece)
            keys.append(key)
        # The views keep the body they point into alive: not beyond `max_bytes`, nor
        # with a message too big to cache (on the OpenAI paths that body is the
        # cache's own, joined per request, not the one the server keeps).
        keep = total <= self.max_bytes
        self._previous, self._previous_keys = (list(raws), keys) if keep else ([], [])
        idle_before = now - self.max_idle_requests
        self._evict(lambda oldest: last_used[oldest] < idle_before)

    def _put(self, key: bytes, piece: CachedPiece, size: int, now: int) -> None:
        self._entries[key] = piece
        self._last_used[key] = now
        self._sizes[key] = size
        self._nbytes += 2 * size + self.ENTRY_OVERHEAD
        # Checked inline first: a session's first request after a restart puts
        # every message of its history (hundreds), and is rarely over a bound.
        if len(self._entries) > self.max_entries:
            self._evict(lambda _: len(self._entries) > self.max_entries)
        if self._nbytes > self.max_bytes:
            self._evict(lambda _: self._nbytes > self.max_bytes)

    def _evict(self, while_oldest: Callable[[bytes], bool]) -> None:
        """Drop least recently used entries while `while_oldest(the oldest entry's key)` holds."""
        entries = self._entries
        while entries and while_oldest(next(iter(entries))):
            key, _ = entries.popitem(last=False)
            del self._last_used[key]
            self._nbytes -= 2 * self._sizes.pop(key) + self.ENTRY_OVERHEAD
