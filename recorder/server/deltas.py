"""What a turn stores, stored as deltas against what its session already stored.

An agent resends the whole conversation every turn, so storing each request
body and engine input whole would make every turn's write (hashing,
compression, rows) grow with the context, and a session's storage with its
square. Both are stored as piece chains instead (see `EventStore.put_array`'s
`extends`): an engine input after the longest stored prefix of the chain it
extends, a body after the bytes it shares with the previous body. What follows
the shared prefix is the newest messages, then the system prompt and tools
that end every body of the session: the bytes it shares at its end with the
previous body are stored as a copy of where they were first stored
(`put_array(basis=, basis_offset=)`: 16 bytes, no compression, no dictionary),
the newest messages between them plainly compressed. Readers see no
difference: `get_array(ref)` returns the whole array. Bodies stored before
this (compressed against the previous body, `basis=` alone) read the same.

A client may put a field that changes every turn before the conversation: the
Anthropic SDK sends its keys sorted, `max_tokens` first, and a harness that
sizes `max_tokens` to the room left changes the body's first bytes every turn.
A prefix delta would then share nothing and store every body whole (at 100k
tokens ~0.5 MB compressed and ~3 ms of CPU a turn, growing with the context).
So when bodies differ from the previous one at the same early place two turns
in a row and agree again a few bytes on (`stream_origin`), the body is split
there: its head (those first bytes) is stored as a piece of its own, and the
rest, its *stream*, as deltas of the previous body's stream exactly as a body
is (longest stored prefix, new messages, copied tail). The body is then the
head, a copy of the stream (`arrays.encode_copy_array`: 16 bytes, vouched for
since the stream was just encoded from these bytes) and the copied tail. The
stream's own chain never holds a copy, so a cold read of the body decodes one
basis more. The copy's digest is over the stream's bytes: every split turn
hashes them once more (~0.7 ms per 0.5 MB), so a split ends once its head
stops changing; nothing is stored twice.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import xxhash

from recorder.log.events import ArrayRef
from recorder.log.store.arrays import (
    PRIOR_BYTES,
    EncodedArray,
    encode_array,
    encode_copy_array,
)

log = logging.getLogger("recorder.server")

if TYPE_CHECKING:
    from recorder.log.store.base import EventStore
    from recorder.model.tokens import TurnPlan
    from recorder.server.journal import BufferedArrays

# Below this many shared bytes a body is stored whole: a delta would save
# less than the extra piece costs.
MIN_SHARED_BYTES = 1024
# Stored prefixes remembered per session (longest kept): enough to fall back
# to an older prefix when a request rewrites its tail (e.g. a retried turn).
MAX_PREFIX_REFS = 8
# Stored prefixes remembered per chain (longest kept): its inputs and, from
# the state snapshots, its whole tokens after each turn (two per turn), for
# the same reason; a request that goes back further stores its input whole.
# Bounds a session's state by this, not by its turns (~60 bytes each).
MAX_CHAIN_REFS = 32


# The engine input's tokens its new tokens are compressed against (`put_input`).
PRIOR_TOKENS = PRIOR_BYTES // 4

# Below this many shared bytes at its end (a copy piece's row costs ~100), a body's tail is stored with its
# newest messages rather than as a copy.
MIN_COPY_BYTES = 256

# (array, byte offset, length): the array's bytes [offset, offset + length) are
# the last `length` bytes of a session's previous body.
TailSource = tuple[ArrayRef, int, int]


# The previous body is not kept whole (~0.5 MB at 100k tokens, per open session):
# digests of its first k * PREFIX_STEP bytes (k = 1, 2, ...) up to `BodyPrefixes.start`,
# and its bytes from there on. `start` is about WINDOW bytes before the end of its
# newest messages, where the next body differs from it (its newest messages, or a
# cache marker that moved to them), and never after its tail (what the next body's
# tail may copy). A body that differs earlier shares a prefix found to PREFIX_STEP
# bytes (a few kB more stored that turn); one that differs in the window, to the byte.
PREFIX_STEP = 16 * 1024
WINDOW = 32 * 1024
# Keys the prefix digests (xxh3-128): random per process and never leaving it, so no
# client can aim at a collision between two bodies' prefixes.
_SEED = int.from_bytes(os.urandom(8), "little")

# A body's stream (see the module doc). The previous body's first LEAD_BYTES are
# kept to find where a body that differs from it early realigns with it: bytes of
# the previous body PROBE_OFFSETS after the first difference (past a changed
# number, an id), looked for in the new body up to MAX_SHIFT bytes from where they
# were (a number's digits gained or lost; a field or a cache marker added or
# removed moves the rest further: not a value that changes) and checked over
# ALIGNED_BYTES (a first message may be short). The difference must be where it
# was the turn before, give or take EARLY_SLACK bytes. The next body's stream is
# found by the stream's first ANCHOR_BYTES, within MAX_SHIFT of where it was.
LEAD_BYTES = 4096
PROBE_OFFSETS = (16, 64, 256, 1024)
PROBE_BYTES = 32
ANCHOR_BYTES = 64
MAX_SHIFT = 16
EARLY_SLACK = 32
ALIGNED_BYTES = 256
# A split ends after this many turns with the same head (see `stream_origin`).
STEADY_TURNS = 8


@dataclass
class BodyPrefixes:
    """What the next body's delta needs of a session's previous body (of its stream,
    see the module doc): its length, digests of its prefixes and its last bytes
    (`window`, see PREFIX_STEP), its ref, refs of stored prefixes of it (shortest
    first) and where its last bytes can be copied from.

    Empty after a restart: the next body is then stored whole.
    """

    length: int = 0
    digests: list[bytes] = field(default_factory=list)
    window: bytes = b""
    refs: list[ArrayRef] = field(default_factory=list)
    ref: ArrayRef | None = None
    tail: TailSource | None = None
    # Where the previous body's stream starts (0: the body is its own stream; the
    # length, digests, window and refs above are then the stream's), and its
    # first LEAD_BYTES bytes.
    origin: int = 0
    lead: bytes = b""
    early: int = 0  # see `Origin`
    steady: int = 0

    @property
    def start(self) -> int:
        """Where `window` starts in the previous body (`digests` cover what is before)."""
        return len(self.digests) * PREFIX_STEP


def prefix_digests(body: bytes | memoryview) -> list[bytes]:
    """Keyed digests of `body[: k * PREFIX_STEP]` for each whole step k = 1, 2, ...

    One pass (a running hash), ~30 us per 0.5 MB.
    """
    hasher = xxhash.xxh3_128(seed=_SEED)
    view = memoryview(body)
    out = []
    for end in range(PREFIX_STEP, len(view) + 1, PREFIX_STEP):
        hasher.update(view[end - PREFIX_STEP : end])
        out.append(hasher.digest())
    return out


def shared_with_previous(previous: BodyPrefixes, body: bytes) -> tuple[int, list[bytes]]:
    """(a prefix length `body` shares with the previous body, `body`'s prefix digests).

    To the byte when the two differ in the previous body's window (the usual
    case), else to PREFIX_STEP bytes.
    """
    digests = prefix_digests(body)
    matched = 0
    for mine, theirs in zip(digests, previous.digests, strict=False):
        if mine != theirs:
            break
        matched += 1
    if matched < len(previous.digests):
        return matched * PREFIX_STEP, digests
    start = previous.start
    return start + shared_prefix_len(previous.window, memoryview(body)[start:]), digests


def _next_prefixes(
    view: bytes | memoryview,
    digests: list[bytes],
    refs: list[ArrayRef],
    ref: ArrayRef,
    tail: TailSource,
    end: int,
) -> BodyPrefixes:
    """What the body after this one needs of its stream `view` (the whole body
    unless split); `end` is where its newest messages end (its copied tail
    starts), `tail` what its tail may copy."""
    start = max(0, min(end - WINDOW, len(view) - tail[2])) // PREFIX_STEP * PREFIX_STEP
    kept = digests[: start // PREFIX_STEP]
    window = bytes(view[len(kept) * PREFIX_STEP :])  # a copy: never a view into the body
    return BodyPrefixes(len(view), kept, window, refs, ref, tail)


class Origin(NamedTuple):
    """Where a body's stream starts (0: the body is its own stream); 1 + where its
    first bytes differed from the previous body's, if early (`early`, else 0); how
    many turns in a row a split body's head stayed the same (`steady`)."""

    at: int
    early: int = 0
    steady: int = 0


def stream_origin(previous: BodyPrefixes, body: bytes) -> Origin:
    """Where `body`'s stream starts: 0 (the whole body) unless its first bytes
    differ from the previous body's where they did the turn before, and the two
    realign soon after (module doc).

    Twice in a row at one place: a short first message whose cache marker moves
    on (Claude Code marks the newest message) differs early once, then past it;
    a title or subagent request between two of the agent's differs early, but
    elsewhere each time. A split ends once its head has stayed the same `STEADY_TURNS` turns
    (its stream's copy costs a hash of the stream every turn; going back costs
    one body stored whole).
    """
    lead = previous.lead
    if previous.origin:
        o = previous.origin
        at = body.find(
            lead[o : o + ANCHOR_BYTES], max(0, o - MAX_SHIFT), o + MAX_SHIFT + ANCHOR_BYTES
        )
        if at >= 0:
            steady = previous.steady + 1 if body[:at] == lead[:o] else 0
            return Origin(at, steady=steady) if steady < STEADY_TURNS else Origin(0)
    differs = shared_prefix_len(lead, body[: len(lead)])
    if differs >= MIN_SHARED_BYTES or differs == len(lead):
        return Origin(0)
    again = previous.early and abs(differs - (previous.early - 1)) <= EARLY_SLACK
    at = _realigned(lead, body, differs) if again else 0
    return Origin(at, early=differs + 1)


def _realigned(lead: bytes, body: bytes, differs: int) -> int:
    """Where `body` agrees again with the previous body's first bytes `lead` after
    their first difference at `differs` (0: nowhere near it)."""
    for k in PROBE_OFFSETS:
        was = differs + k  # in the previous body
        if was + ALIGNED_BYTES > len(lead):
            break
        at = body.find(
            lead[was : was + PROBE_BYTES], was - MAX_SHIFT, was + MAX_SHIFT + PROBE_BYTES
        )
        if (
            at >= 0
            and at + ANCHOR_BYTES <= LEAD_BYTES
            and body[at : at + ALIGNED_BYTES] == lead[was : was + ALIGNED_BYTES]
        ):
            return at
    return 0


def _first_difference(x: np.ndarray, y: np.ndarray) -> int:
    """Index of the first element where `x` and `y` differ, or -1."""
    neq = x != y
    if not neq.size:
        return -1
    k = int(neq.argmax())  # stops at the first True
    return k if neq[k] else -1


def _view(buf: bytes, dtype: type, count: int, start: int) -> np.ndarray:
    if count <= 0:
        return np.empty(0, dtype)
    return np.frombuffer(buf, dtype, count, start)


def shared_prefix_len(a: bytes, b: bytes) -> int:
    """How many leading bytes `a` and `b` have in common.

    Compared 8 bytes at a time, then byte by byte inside the first differing
    word: a request body is ~0.5 MB at 100k tokens, and a byte-wise compare
    (a 0.5 MB mask, then its nonzero indices) took ~0.5 ms of every turn.
    """
    n = min(len(a), len(b))
    words = n // 8
    at = _first_difference(_view(a, np.uint64, words, 0), _view(b, np.uint64, words, 0))
    start, stop = (8 * at, 8 * at + 8) if at >= 0 else (8 * words, n)
    k = _first_difference(
        _view(a, np.uint8, stop - start, start), _view(b, np.uint8, stop - start, start)
    )
    return start + k if k >= 0 else stop


def _tail(buf: bytes, dtype: type, count: int, back: int) -> np.ndarray:
    """The `count` items that end `back` bytes before the end of `buf`, last first."""
    size = np.dtype(dtype).itemsize
    return _view(buf, dtype, count, len(buf) - back - count * size)[::-1]


def shared_suffix_len(a: bytes, b: bytes, limit: int) -> int:
    """How many trailing bytes `a` and `b` have in common, at most `limit`."""
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    words = n // 8
    at = _first_difference(_tail(a, np.uint64, words, 0), _tail(b, np.uint64, words, 0))
    back, count = (8 * at, 8) if at >= 0 else (8 * words, n - 8 * words)
    k = _first_difference(_tail(a, np.uint8, count, back), _tail(b, np.uint8, count, back))
    return back + k if k >= 0 else back + count


async def put_body(
    store: EventStore | BufferedArrays, previous: BodyPrefixes, body: bytes
) -> tuple[ArrayRef, BodyPrefixes]:
    """Store `body` as deltas of `previous`; (its ref, what the next body uses).

    Three pieces at most, written in one commit (`put_array(along=)`; each
    commit costs the writer a WAL write): after the longest stored prefix of
    what it shares with the previous body, its new middle, then its tail (what
    it shares at its end with the previous body) as a copy of the bytes the
    previous tail was copied from, so a tail's source stays the same body turn
    after turn (one basis hop for a cold read). A body split into a head and a
    stream (module doc) stores its stream so, then the head and the stream's copy.
    """
    found = stream_origin(previous, body)
    origin = found.at
    view = memoryview(body)[origin:]
    shared, digests = shared_with_previous(previous, view)
    if (
        previous.ref is not None
        and shared == len(view) == previous.length
        and origin == previous.origin
        and body[:origin] == previous.lead[:origin]
    ):
        return previous.ref, previous  # a retry: stored already
    data = np.frombuffer(view, dtype=np.uint8)
    if shared < MIN_SHARED_BYTES or (origin and not previous.origin):
        shared = 0  # (a first split: the stream extends nothing; its chain holds no copy)
    copied = 0
    if previous.tail is not None:
        # Never past the previous tail, which the window holds (`_next_prefixes`).
        limit = min(len(view) - shared, previous.length - shared, previous.tail[2])
        copied = shared_suffix_len(previous.window, body, limit)
        if copied < MIN_COPY_BYTES:
            copied = 0
    end = len(view) - copied
    usable = [r for r in previous.refs if r.length <= shared] if shared else []
    prefix = usable[-1] if usable else None
    along: list[EncodedArray] = []  # encoded here, stored with the body's last piece
    if shared > (prefix.length if prefix is not None else 0):
        start = prefix.length if prefix is not None else 0
        along.append(encode_array(data[start:shared], extends=prefix, prior=data[:start]))
        prefix = along[-1].ref
    if origin:
        ref, tail, refs = await _put_split(
            store, previous, body, origin, (shared, end), prefix, along
        )
    else:
        ref, tail, middle = await _put_whole(store, previous, data, (shared, end), prefix, along)
        refs = [prefix, middle, ref]
    if previous.tail is not None and previous.tail[0] != tail[0]:
        # The old source of the tails is read no more (a body's own pieces are
        # never cached: nothing reads them hot; the source is, by each copy).
        store.release(previous.tail[0], [tail[0]])
    kept = [r for r in usable if r.length < shared]
    for r in refs:
        if r is not None and (not kept or r.length > kept[-1].length):
            kept.append(r)
    following = _next_prefixes(view, digests, kept[-MAX_PREFIX_REFS:], ref, tail, end)
    following.origin, following.lead = origin, body[:LEAD_BYTES]
    following.early, following.steady = found.early, found.steady
    return ref, following


async def _put_whole(
    store: EventStore | BufferedArrays,
    previous: BodyPrefixes,
    data: np.ndarray,
    span: tuple[int, int],
    prefix: ArrayRef | None,
    along: list[EncodedArray],
) -> tuple[ArrayRef, TailSource, ArrayRef | None]:
    """A body that is its own stream: its middle `data[shared:end]` after `prefix`,
    then its tail; (its ref, what its tail may be copied from, its middle's ref)."""
    shared, end = span
    middle = prefix
    if end < len(data):
        if end > shared:
            along.append(encode_array(data[shared:end], extends=prefix, prior=data[:shared]))
            middle = along[-1].ref
        copied = await _put_copied_tail(store, previous, data, end, middle, along)
        if copied is not None:
            return *copied, middle
    # The rest after the shared prefix (the middle, and the tail if not copied) is
    # one piece: the middle already encoded joins `along`, its tail extends it.
    if middle is not prefix:
        ref = await store.put_array(
            data[end:], extends=middle, cache=False, along=along, prior=data[:end]
        )
    else:
        ref = await store.put_array(
            data[shared:], extends=prefix, cache=False, along=along, prior=data[:shared]
        )
        middle = ref
    return ref, (ref, shared, len(data) - shared), middle


async def _put_split(
    store: EventStore | BufferedArrays,
    previous: BodyPrefixes,
    body: bytes,
    origin: int,
    span: tuple[int, int],
    prefix: ArrayRef | None,
    along: list[EncodedArray],
) -> tuple[ArrayRef, TailSource, list[ArrayRef | None]]:
    """A body split at `origin`: its stream up to its tail (`data[:end]`, after
    `prefix`), its head, the stream's copy, then its tail; (its ref, what its tail
    may be copied from, the stream's stored prefixes)."""
    shared, end = span
    view = memoryview(body)[origin:]
    data = np.frombuffer(view, dtype=np.uint8)
    stream = prefix
    if end > shared:
        along.append(encode_array(data[shared:end], extends=prefix, prior=data[:shared]))
        stream = along[-1].ref
    head = encode_array(np.frombuffer(body, np.uint8, origin))
    along.append(head)
    if stream is None:  # an empty stream: nothing to copy (its tail is the rest)
        copy_ref = head.ref
    else:
        # The stream's chain holds no copy (only its prefixes and middles): depth 0.
        along.append(encode_copy_array(view[:end], "uint8", head.ref, stream, 0, 0))
        copy_ref = along[-1].ref
    if end < len(data):
        copied = await _put_copied_tail(store, previous, data, end, copy_ref, along)
        if copied is not None:
            return *copied, [prefix, stream]
        ref = await store.put_array(
            data[end:], extends=copy_ref, cache=False, along=along, prior=data[:end]
        )
        return ref, (ref, origin + end, len(data) - end), [prefix, stream]
    ref = await store.put_array(np.empty(0, np.uint8), extends=copy_ref, cache=False, along=along)
    assert stream is not None  # a body never ends at its head
    return ref, (stream, shared, len(data) - shared), [prefix, stream]


async def _put_copied_tail(
    store: EventStore | BufferedArrays,
    previous: BodyPrefixes,
    data: np.ndarray,
    end: int,
    extends: ArrayRef | None,
    along: list[EncodedArray],
) -> tuple[ArrayRef, TailSource] | None:
    """`data[end:]` after `extends`, as a copy of where the previous tail was
    copied from: (its ref, that source's range of it); None (nothing stored) if
    that source does not hold these bytes."""
    assert previous.tail is not None
    source, offset, length = previous.tail
    at = offset + length - (len(data) - end)
    try:
        ref = await store.put_array(
            data[end:], extends=extends, basis=source, basis_offset=at, cache=False, along=along
        )
        return ref, (source, at, len(data) - end)
    except ValueError:  # the source does not hold these bytes: never expected
        log.warning("a body's tail differs from its recorded source; stored plainly")
        return None


# Per chain id: stored prefixes of the chain's tokens, by length (SessionState.chain_refs).
ChainRefs = dict[int, dict[int, ArrayRef]]


async def put_input(
    store: EventStore | BufferedArrays, chain_refs: ChainRefs, plan: TurnPlan
) -> ArrayRef:
    """Store the engine input as a delta after the longest stored prefix of its chain."""
    base: ArrayRef | None = None
    if plan.prefix_len:
        source = plan.chain_id if plan.action == "extend" else plan.parent_chain_id
        known = chain_refs.get(source, {}) if source is not None else {}
        usable = [n for n in known if n <= plan.prefix_len]
        base = known[max(usable)] if usable else None
    start = base.length if base is not None else 0
    ids = np.asarray(plan.input_ids[start:], dtype=np.int32)
    # The tokens just before the new ones, as their compression dictionary: the
    # stored prefix holds exactly these (it is a prefix of the chain's tokens).
    prior = np.asarray(plan.input_ids[max(0, start - PRIOR_TOKENS) : start], dtype=np.int32)
    # Not cached: the session's chain holds these tokens already; read back only by
    # its close, from the log (`EventStore.get_arrays`).
    return await store.put_array(ids, extends=base, cache=False, prior=prior)


def remember_refs(
    chain_refs: ChainRefs,
    live_chains: Collection[int],
    plan: TurnPlan,
    chain_id: int,
    input_ref: ArrayRef,
) -> None:
    """Per chain: stored prefixes of its tokens (length -> ref), to store later inputs as deltas.

    Every input a chain was fed is a prefix of the chain's tokens, so the next
    input is stored as its suffix after the longest such ref (the previous
    output travels in that suffix: no extra array write per turn).
    """
    refs = chain_refs.get(chain_id)
    if refs is None:
        refs = {}
        source = plan.parent_chain_id if plan.prefix_len else None
        if source is not None:
            refs.update(
                (n, r) for n, r in chain_refs.get(source, {}).items() if n <= plan.prefix_len
            )
        chain_refs[chain_id] = refs
    refs[input_ref.length] = input_ref
    keep_longest(refs)
    live = set(live_chains)
    for stale in [c for c in chain_refs if c not in live]:
        del chain_refs[stale]


def keep_longest(refs: dict[int, ArrayRef]) -> None:
    """Drop all but the `MAX_CHAIN_REFS` longest of a chain's stored prefixes."""
    for n in sorted(refs)[:-MAX_CHAIN_REFS]:
        del refs[n]
