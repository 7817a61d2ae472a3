"""The per-session cache of translated messages (one per session, LRU, bounded).

A client resends the whole conversation every turn. With a `ParseCache`
only the messages whose JSON bytes were not seen before are decoded,
validated and translated (by the `translate_message` the caller passes), so
a turn costs what its new messages cost plus one scan of the body.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import msgspec
import xxhash
import zstandard

# A translated message as the cache keeps it: a plain tuple (role, chat messages,
# digests, tool_use ids, tool_result ids, characters of its rendered text, the
# positions among its chat messages of those holding a `tool_references`), so an
# entry costs the cyclic GC two tracked objects (this tuple and its tuple of
# messages), not three. Its chat messages are packed (`pack_message`): msgpack,
# compressed when big, ~1/3 of the text that is most of their dicts' memory (a
# 100k-token session kept ~530 kB of them); a request unpacks only what it reads.
CachedPiece = tuple[
    str,
    tuple["dict[str, Any] | bytes", ...],
    tuple[str, ...],
    tuple[str, ...],
    tuple[str, ...],
    int,
    tuple[int, ...],
]

_packer = msgspec.msgpack.Encoder()
_decode = msgspec.msgpack.Decoder(dict[str, Any]).decode
# Packed messages from this size on are compressed (zstd level 1: ~3x on text and
# code, ~100 MB/s; below it the frame's overhead eats the gain). A compressed one
# starts with zstd's magic number, a msgpack map never with its first byte (0x28).
_COMPRESS_FROM = 512
_ZSTD_FIRST_BYTE = 0x28
# zstandard's (de)compressor objects are not thread-safe: one of each per thread.
_zstd = threading.local()


def pack_message(message: dict[str, Any]) -> bytes:
    """A chat message as the cache keeps it (`unpack_message` gives an equal dict back:
    its values are JSON's, and a tuple comes back as a list)."""
    packed = _packer.encode(message)
    if len(packed) < _COMPRESS_FROM:
        return packed
    compressor = getattr(_zstd, "compressor", None)
    if compressor is None:
        compressor = _zstd.compressor = zstandard.ZstdCompressor(level=1)
    # Copied: zstandard's `compress` returns a bytes whose allocation stays the size of
    # its worst-case bound (more than the input), only its length set to what was
    # written, so a kept frame would hold as much memory as the message uncompressed.
    return bytes(memoryview(compressor.compress(packed)))


def unpack_message(item: dict[str, Any] | bytes) -> dict[str, Any]:
    """The chat message of a packed or plain item."""
    if not isinstance(item, bytes):
        return item
    if item[0] != _ZSTD_FIRST_BYTE:
        return _decode(item)
    decompressor = getattr(_zstd, "decompressor", None)
    if decompressor is None:
        decompressor = _zstd.decompressor = zstandard.ZstdDecompressor()
    return _decode(decompressor.decompress(item))


class ChatMessages(Sequence[dict[str, Any]]):
    """A request's chat messages, some still packed: each is unpacked when first read.

    A turn that extends a chain reads only its new messages (the chain holds the
    tokens of the others), so the earlier ones stay packed, and the session keeps
    no dict of them between requests. Read anything (a full render, equality) and
    it is unpacked: the same dicts as an uncached parse's. Read-only, as the
    plain list a `ChatRequest` otherwise holds is by convention.
    """

    __slots__ = ("_items",)

    def __init__(self, items: list[dict[str, Any] | bytes]) -> None:
        self._items = items  # owned: unpacked items replace their bytes in place

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._get(i) for i in range(*index.indices(len(self._items)))]
        return self._get(index)

    def _get(self, i: int) -> dict[str, Any]:
        item = self._items[i]
        if isinstance(item, bytes):
            item = self._items[i] = unpack_message(item)
        return item

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self._get(i) for i in range(len(self._items)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChatMessages | list | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))


class Conversation(Protocol):
    """What the cache needs of the conversation it adds messages to."""

    def check_tool_results(self, piece: CachedPiece, index: int) -> None: ...

    def add(self, piece: CachedPiece) -> None: ...

    def snapshot(self) -> Any:
        """Its state after the messages added so far, unaffected by later changes to it."""
        ...


# JSON whitespace, then a comma, then whitespace: what separates two array elements.
_SEPARATOR = re.compile(rb"[ \t\r\n]*,[ \t\r\n]*")
_BLANKS = re.compile(rb"[ \t\r\n]*")
# Keys the digests (xxh3-128) of messages and of the previous request's prefix: random
# per process and never leaving it, so no client can aim at a collision.
_SEED = int.from_bytes(os.urandom(8), "little")


def _digest(data: bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data, seed=_SEED)


class KnownPrefix(NamedTuple):
    """The previous request's messages, found byte for byte at the start of this body.

    `body[:end]` is the previous body up to the end of its last message: the
    same bytes at the same offsets, so the same messages (a JSON value's
    extent depends only on its own bytes, and the bytes before it put the
    decoder in the same place; the same digest, keyed: the same bytes). `first`
    is where the first message starts, `n_messages` how many there are, `state`
    the conversation after them, `hasher` the running digest of `body[:end]`
    (the next request's prefix digest goes on from it).
    """

    first: int
    end: int
    n_messages: int
    state: Any
    hasher: Any


class ParseCache:
    """One session's translated messages, keyed by a digest of their JSON bytes (LRU, bounded).

    Identical bytes decode to the identical message, so a hit needs no
    decoding, validation or translation; only the cross-message rules run
    again (`_Conversation`). The key is a keyed 16-byte xxh3 digest, not a
    copy of the message's JSON: a 100k-token session kept ~540 kB of keys
    that repeated its previous request body byte for byte. Of the previous
    request only where its messages are, their keys and a digest of its
    bytes up to its last message are kept, not the body (~0.5 MB at 100k
    tokens, which the server does not keep either: deltas.BodyPrefixes).

    Bounds: the least recently used messages go beyond `max_entries` or
    `max_bytes`, where a message is charged what its entry keeps alive: its
    packed translation (`pack_message`, about its text) plus overheads
    (`_charge`); and a message no request used in the last
    `max_idle_requests` (history replaced by a compaction, a finished
    subagent) goes too. The previous request is remembered only while its
    messages total at most `max_bytes` and none is too big to cache. Not
    thread-safe: one session's requests are parsed on the server's event loop.

    No object per entry: a translation is kept as a plain tuple and its last
    use and size as ints in flat dicts (untracked by the cyclic GC), two tracked
    objects per message instead of three. Every full collection walks them
    all: after a restart, 256 restored caches of 200 messages made full
    collections take ~150-200 ms each, most of what the restart cost beyond
    its reads and parses (tests/tokens/test_parse_cache.py counts them).
    """

    # Per entry beyond its packed messages: the tuples, the key and the dict slots;
    # per chat message its digest and bytes object; per tool id its string. Measured
    # (benchkit.census.Walk over the entries of a tool-using session): within ~10%
    # above, never below (tests/server/test_memory.py).
    ENTRY_OVERHEAD = 512
    MESSAGE_OVERHEAD = 96
    ID_OVERHEAD = 64

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
        self._sizes: dict[bytes, int] = {}  # key -> the bytes it is charged
        # The previous request: the digest of its body up to the end of its last
        # message, where its messages are in it (the first's offset, how many,
        # the end of the last), their keys, and the caller's conversation after them.
        self._prefix_digest: bytes | None = None
        self._first = 0
        self._end = 0
        self._n_messages = 0
        self._previous_keys: list[bytes] = []
        self._state: Any = None
        self._total = 0
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
        self._forget_previous()
        self._nbytes = 0

    def known_prefix(self, body: bytes) -> KnownPrefix | None:
        """The previous request's messages, if `body` repeats its bytes through the last one.

        One digest of the bytes (no decoding, ~30 us per 0.5 MB): a client resends
        the whole conversation every turn, so most requests only append messages.
        """
        if self._prefix_digest is None or self._state is None or len(body) < self._end:
            return None
        hasher = xxhash.xxh3_128(memoryview(body)[: self._end], seed=_SEED)
        if hasher.digest() != self._prefix_digest:
            return None
        return KnownPrefix(self._first, self._end, self._n_messages, self._state, hasher)

    def add_messages(
        self,
        raws: Sequence[msgspec.Raw],
        conversation: Conversation,
        translate_message: Callable[[bytes, int, Conversation], CachedPiece],
        *,
        body: bytes | None = None,
        span: tuple[int, int] | None = None,
    ) -> None:
        """Add each message to `conversation`, translating only those not cached.

        `translate_message(json bytes, index, conversation)` checks, decodes and
        translates one message (raising `InvalidRequest`). `body` is the request
        body the `raws` are views of and `span` where in it they start and end:
        with both, the next request may find them by `known_prefix`.
        """
        self._requests += 1
        keys: list[bytes] = []
        total = self._add(raws, 0, conversation, translate_message, keys)
        if body is None or span is None or total > self.max_bytes:
            # Not beyond `max_bytes`, nor with a message too big to cache.
            self._forget_previous()
        else:
            self._first, self._end = span
            self._prefix_digest = _digest(memoryview(body)[: self._end])
            self._n_messages = len(raws)
            self._previous_keys = keys
            self._state, self._total = conversation.snapshot(), total
        self._evict_idle()

    def add_new_messages(
        self,
        known: KnownPrefix,
        body: bytes,
        start: int,
        raws: Sequence[msgspec.Raw],
        conversation: Conversation,
        translate_message: Callable[[bytes, int, Conversation], CachedPiece],
    ) -> None:
        """`add_messages` for a body that repeats the previous request's messages
        (`known_prefix`): `conversation` is already in `known.state`, and `raws`
        are the messages after them, the first starting at `body[start:]` (past
        blanks). Only these are looked at; the known ones count as used.
        """
        self._requests += 1
        now = self._requests
        last_used = self._last_used
        known_keys = self._previous_keys
        # Used again, in the same order as last time: their places at the recent
        # end of the LRU order stay as they are; only their last use is new.
        last_used.update(dict.fromkeys(filter(last_used.__contains__, known_keys), now))
        keys = list(known_keys)
        total = self._total + self._add(
            raws, known.n_messages, conversation, translate_message, keys
        )
        if total > self.max_bytes:
            self._forget_previous()
        else:
            lengths = [len(raw) for raw in raws]
            if lengths:
                self._end = _end_of(body, _BLANKS.match(body, start).end(), lengths)  # type: ignore[union-attr]
            hasher = known.hasher
            hasher.update(memoryview(body)[known.end : self._end])
            self._prefix_digest = hasher.digest()
            self._n_messages = known.n_messages + len(raws)
            self._previous_keys = keys
            self._state, self._total = conversation.snapshot(), total
        self._evict_idle()

    def _add(
        self,
        raws: Sequence[msgspec.Raw],
        offset: int,
        conversation: Conversation,
        translate_message: Callable[[bytes, int, Conversation], CachedPiece],
        keys: list[bytes],
    ) -> int:
        """Add `raws` (messages `offset`... of the request) to `conversation`; append their
        keys to `keys`. Returns their total JSON size, more than `max_bytes` if one is
        too big to cache (the request is then not remembered: the conversation's state
        after it would keep that message's translation alive, uncharged)."""
        now = self._requests
        entries, last_used = self._entries, self._last_used
        total = 0
        for j, raw in enumerate(raws):
            i = offset + j
            size = len(raw)
            total += size
            if size > self.max_entry_bytes:
                total += self.max_bytes + 1  # the request is not remembered
                conversation.add(translate_message(bytes(raw), i, conversation))
                keys.append(b"")  # never kept (see `max_entry_bytes`)
                continue
            key = _digest(raw)
            piece = entries.get(key)
            if piece is None:
                piece = _packed(translate_message(bytes(raw), i, conversation))
                self._put(key, piece, now)
            else:
                last_used[key] = now
                entries.move_to_end(key)
                if piece[4]:
                    conversation.check_tool_results(piece, i)
            conversation.add(piece)
            keys.append(key)
        return total

    def _forget_previous(self) -> None:
        self._prefix_digest, self._state, self._previous_keys = None, None, []
        self._first = self._end = self._total = self._n_messages = 0

    def _evict_idle(self) -> None:
        idle_before = self._requests - self.max_idle_requests
        last_used = self._last_used
        self._evict(lambda oldest: last_used[oldest] < idle_before)

    def _put(self, key: bytes, piece: CachedPiece, now: int) -> None:
        self._entries[key] = piece
        self._last_used[key] = now
        charge = self._charge(piece)
        self._sizes[key] = charge
        self._nbytes += charge
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
            self._nbytes -= self._sizes.pop(key)

    def _charge(self, piece: CachedPiece) -> int:
        """What an entry keeps alive, near enough (see `ENTRY_OVERHEAD`)."""
        ids = (*piece[3], *piece[4])
        return (
            self.ENTRY_OVERHEAD
            + sum(map(len, piece[1]))  # type: ignore[arg-type]
            + self.MESSAGE_OVERHEAD * len(piece[1])
            + sum(map(len, ids))
            + self.ID_OVERHEAD * len(ids)
        )


def _packed(piece: CachedPiece) -> CachedPiece:
    """`piece` with its chat messages packed, as an entry keeps them."""
    role, messages, *rest = piece
    return (role, tuple(map(pack_message, messages)), *rest)  # type: ignore[return-value]


def _end_of(body: bytes, start: int, lengths: Sequence[int]) -> int:
    """Where the last of consecutive array elements of `lengths` ends, the first at `start`."""
    pos = start + lengths[0]
    for length in lengths[1:]:
        pos = _SEPARATOR.match(body, pos).end() + length  # type: ignore[union-attr]
    return pos
