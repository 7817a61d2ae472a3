"""A session's live state as a `StateSnapshot` event, and back.

After each answered turn the server appends, in the same batch as the
turn's ResponseSent, what a restarted server needs to continue the session
without replaying it: the chains (digests, boundaries, dispatches, counters)
and the session's own fields. Chain tokens are not copied: each chain names
them by an `ArrayRef` stored as a delta on the longest stored prefix it
already has (its last engine input), so a turn's snapshot adds one array
piece holding that turn's output tokens (naming the output ids the turn
stored already), and the next turn's engine input is stored as a delta on
that piece in turn (`deltas.put_input`).

A chain's message digests and boundaries only grow, turn by turn, so they
are stored the same way (`_record_ref`): as arrays extending the previous
snapshot's, a turn adding only its new digests and its boundary. Written
whole every turn they would make a session's snapshots grow with the square
of its turns (200 digests of 18 bytes at turn 100, 30 MB over 1,000 turns).

The encoding is private to this module and numbered (`SNAPSHOT_FORMAT`).
A snapshot is a cache of the log, never the truth: one at another format,
or one that fails any check, is not used (`restore` replays the log
instead), so changing the encoding only means bumping the number.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from recorder.log import events as ev
from recorder.log.events import ArrayRef
from recorder.log.store.arrays import (
    EncodedArray,
    encode_array,
    encode_concat_array,
    piece_digest,
)
from recorder.model.tokens import Boundary, Chain, PendingDispatch, SessionChains, token_array
from recorder.server.deltas import keep_longest
from recorder.server.overrides import SessionOverrides

if TYPE_CHECKING:
    from recorder.server.sessions import SessionState

# Bump when `LiveState` or the meaning of any of its fields changes (including
# how message digests are computed: `translate.message_digest`).
# 3: an assistant message with text and tool calls digests as `<message>|<calls alone>`.
# 4: `prefix_refs` holds only the prefixes a restored session uses (`_kept_prefix_refs`).
SNAPSHOT_FORMAT = 4

# A message digest is 32 hex digits, or two joined by "+" (with reasoning):
# stored as a 0 byte and its 16 or 32 raw bytes (half the text); with "|"
# (`<message>|<calls alone>[+<reasoning>]`) as a 2 byte and its 32 or 48 raw
# bytes. Anything else is stored as a 1 byte and its UTF-8 text.
# See `_tokens_ref`. Needs the chain's stored prefixes of 2 * SPINE_TURNS
# turns back (deltas.MAX_CHAIN_REFS).
SPINE_TURNS = 8
# A chain's digests and boundaries are stored again whole after this many
# deltas (see `_record_ref`): a restart reads at most this many pieces each.
RECORD_SPINE = 32
# A snapshot names this many of a chain's longest stored prefixes (plus the
# next spine's start, `_kept_prefix_refs`): enough for a retried or rewound
# turn after a restart to be stored as a delta.
SNAPSHOT_PREFIX_REFS = 4

_HEX_DIGEST = re.compile(r"[0-9a-f]{32}(\+[0-9a-f]{32})?")
_CALLS_DIGEST = re.compile(r"[0-9a-f]{32}\|[0-9a-f]{32}(\+[0-9a-f]{32})?")
_RAW, _TEXT, _CALLS = b"\x00", b"\x01", b"\x02"


class SnapshotUnusable(ValueError):
    """A snapshot that this code cannot restore from; the caller replays the log instead."""


class ChainState(msgspec.Struct, array_like=True, frozen=True):
    """One `tokens.Chain` with its tokens by ref, and its stored prefixes (`chain_refs`)."""

    chain_id: int
    system_digest: str
    render_digest: str
    message_digests: ArrayRef  # uint8: each digest `_pack_digest`ed, after its length byte
    tokens: ArrayRef
    boundaries: ArrayRef  # int32: four per boundary (`_boundary_array`)
    main_line: bool
    parent_chain_id: int | None
    dispatch_tool_use_id: str | None
    last_used: int
    n_tools: int
    prefix_refs: list[ArrayRef]
    # How many pieces deep each record's ref is (`_record_ref`), so a restored
    # session goes on adding deltas; older snapshots lack them: stored whole next.
    digests_depth: int = RECORD_SPINE
    boundaries_depth: int = RECORD_SPINE


class LiveState(msgspec.Struct, kw_only=True, frozen=True):
    """What `SessionState` holds that the next turn needs, as of one answered turn.

    `seq` is the snapshot event's own seq: a restore checks it against where
    the event was read from, so a snapshot is never applied to a log it was
    not written in.
    """

    seq: int
    attempt: int
    opened_ts: float
    metadata: dict[str, Any]
    engine_url: str
    overrides: SessionOverrides
    next_turn: int
    turns_completed: int
    chains: list[ChainState]
    main_chain_id: int | None
    pending_dispatches: list[PendingDispatch]
    next_chain_id: int
    clock: int
    max_chains: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LiveState)


def add_snapshot(state: SessionState) -> None:
    """Buffer `state` as a StateSnapshot (and the token pieces it names) in its journal.

    Call with the chains committed and the turn's last events buffered: the
    snapshot must be the batch's last event, so it reflects everything before it.
    """
    journal = state.journal
    chains: SessionChains = state.chains
    live = LiveState(
        seq=journal.next_seq + len(journal.pending),
        attempt=state.attempt,
        opened_ts=state.opened_ts,
        metadata=state.metadata,
        engine_url=state.engine_url,
        overrides=state.overrides,
        next_turn=state.next_turn,
        turns_completed=state.turns_completed,
        chains=[_chain_state(state, c) for c in chains.chains.values()],
        main_chain_id=chains.main_chain_id,
        pending_dispatches=list(chains.pending_dispatches),
        next_chain_id=chains.next_chain_id,
        clock=chains.clock,
        max_chains=chains.max_chains,
    )
    journal.add(ev.StateSnapshot(format=SNAPSHOT_FORMAT, state=_encoder.encode(live)))
    for gone in [key for key in state.snapshot_records if key[0] not in chains.chains]:
        del state.snapshot_records[gone]  # an evicted chain's records


def _chain_state(state: SessionState, chain: Chain) -> ChainState:
    digests, digests_depth = _record_ref(
        state, chain.chain_id, "digests", chain.message_digests, _digest_array
    )
    boundaries, boundaries_depth = _record_ref(
        state, chain.chain_id, "boundaries", chain.boundaries, _boundary_array
    )
    return ChainState(
        chain_id=chain.chain_id,
        system_digest=chain.system_digest,
        render_digest=chain.render_digest,
        message_digests=digests,
        tokens=_tokens_ref(state, chain),
        boundaries=boundaries,
        main_line=chain.main_line,
        parent_chain_id=chain.parent_chain_id,
        dispatch_tool_use_id=chain.dispatch_tool_use_id,
        last_used=chain.last_used,
        n_tools=chain.n_tools,
        prefix_refs=_kept_prefix_refs(chain, state.chain_refs.get(chain.chain_id, {})),
        digests_depth=digests_depth,
        boundaries_depth=boundaries_depth,
    )


def _kept_prefix_refs(chain: Chain, refs: dict[int, ArrayRef]) -> list[ArrayRef]:
    """The stored prefixes a snapshot names, shortest first: the longest few, and
    the one the chain's next spine goes back to (`_tokens_ref`).

    A live chain remembers `MAX_CHAIN_REFS` (two per turn), ~30 bytes each:
    written with every turn's snapshot they were ~70% of its bytes, while a
    restored session only extends its newest tokens (a retry or a rewind its
    last inputs). A prefix left out costs a rewound input after a restart a
    bigger delta, never a wrong one.
    """
    keep: set[int] = set()
    turns = len(chain.boundaries)
    if turns:
        spine_turn = turns + SPINE_TURNS - turns % SPINE_TURNS  # the next multiple
        back = spine_turn - SPINE_TURNS - 1  # as `_tokens_ref` will pick it then
        b = chain.boundaries[back] if back >= 0 else None
        spine = b.end_len if b is not None else chain.boundaries[0].input_len
        if spine in refs:
            keep.add(spine)
    # Always as many refs (once there are enough): a snapshot's size stays flat.
    for n in sorted(refs, reverse=True):
        if len(keep) > SNAPSHOT_PREFIX_REFS:
            break
        keep.add(n)
    return [refs[n] for n in sorted(keep)]


def _tokens_ref(state: SessionState, chain: Chain) -> ArrayRef:
    """A stored ref of the chain's whole tokens: a delta on its longest stored prefix.

    Usually that prefix is the turn's engine input and the delta its output.
    The ref joins the chain's stored prefixes, so the next input extends it.
    Every `SPINE_TURNS` turns of the chain, the delta goes back to the tokens
    stored `SPINE_TURNS` turns earlier instead (the first time, to the
    chain's first input), as one piece that names those turns' pieces
    (`_spine_ref`): a chain's tokens are a chain of about turns / SPINE_TURNS
    + 2 * SPINE_TURNS pieces, not two per turn, so a restart reads them in a
    few rounds (the spines, then the pieces they name), not one per turn.
    Each token is stored once: a spine costs 16 bytes per piece it names, a
    turn's output 16 bytes (`_encoded_delta`).

    No piece of it is cached in the store's piece cache: the chain holds its
    tokens, and only a restore or the session's close reads them back, from
    the log (as its engine inputs, deltas.put_input). Cached, a live chain's
    tokens would be held a second time (~0.4 MB per open 100k session;
    tools/bench_session_memory.py).
    """
    refs = state.chain_refs.setdefault(chain.chain_id, {})
    n = len(chain.tokens)
    known = refs.get(n)
    if known is not None:
        return known
    start = max((k for k in refs if k <= n), default=0)
    turns = len(chain.boundaries)
    ref: ArrayRef | None = None
    if turns % SPINE_TURNS == 0:
        # The tokens SPINE_TURNS turns back; the first time, the chain's first input.
        back = chain.boundaries[turns - SPINE_TURNS - 1] if turns > SPINE_TURNS else None
        spine = back.end_len if back is not None else chain.boundaries[0].input_len
        if spine in refs and spine < start:
            ref = _spine_ref(state, chain, refs, spine, start)
    if ref is None:
        ref = _delta_ref(state, chain, refs, start)
    refs[n] = ref
    keep_longest(refs)
    return ref


def _delta_ref(
    state: SessionState, chain: Chain, refs: dict[int, ArrayRef], start: int
) -> ArrayRef:
    """The chain's tokens after its stored prefix `start` (usually the turn's output)."""
    delta = _encoded_delta(state, chain, refs, start)
    state.journal.add_encoded(delta)
    return delta.ref


def _encoded_delta(
    state: SessionState, chain: Chain, refs: dict[int, ArrayRef], start: int
) -> EncodedArray:
    """The chain's tokens after `refs[start]`, encoded, not buffered yet.

    When those tokens are exactly an array this batch stores whole (the
    output ids of the turn's GenerateResult: one attempt, nothing trimmed),
    the piece names it (`arrays.CODEC_CONCAT`) instead of storing them twice.
    """
    raw = memoryview(chain.tokens).cast("B")[start * 4 :]
    if start:
        whole = piece_digest(None, "int32", raw)
        if state.journal.buffers_piece(whole):
            piece = encode_concat_array(bytes(raw), "int32", refs[start], [whole])
            return msgspec.structs.replace(piece, cache=False)
    delta = encode_array(np.frombuffer(raw, np.int32), extends=refs.get(start))
    return msgspec.structs.replace(delta, cache=False)


def _spine_ref(
    state: SessionState, chain: Chain, refs: dict[int, ArrayRef], spine: int, start: int
) -> ArrayRef:
    """The chain's whole tokens as one piece after its stored prefix `spine`.

    The tokens since `spine` are stored already, as the per-turn pieces
    between `refs[spine]` and `refs[start]` plus this turn's delta: the spine
    piece names those pieces (`arrays.CODEC_CONCAT`, 16 bytes each) rather
    than repeating their tokens (which doubled a session's stored tokens).
    When the pieces cannot be told from `refs` (a restored session), the
    tokens are stored again, as before.
    """
    n = len(chain.tokens)
    raw = memoryview(chain.tokens).cast("B")
    delta = _encoded_delta(state, chain, refs, start)
    parts = _parts_since(raw, {**refs, n: delta.ref}, spine, n)
    if parts is None or len(parts) < 2:
        suffix = np.frombuffer(raw[spine * 4 :], np.int32)
        return state.journal.add_array(suffix, extends=refs[spine], cache=False)
    state.journal.add_encoded(delta)
    whole = encode_concat_array(bytes(raw[spine * 4 :]), "int32", refs[spine], parts)
    state.journal.add_encoded(msgspec.structs.replace(whole, cache=False))
    return whole.ref


def _parts_since(
    raw: memoryview, refs: dict[int, ArrayRef], spine: int, n: int
) -> list[bytes] | None:
    """Digests of the pieces that hold tokens [spine, n) after `refs[spine]`, in order,
    each proven by recomputing its digest from its parent and these tokens; None
    when some piece on the way is not one of `refs` (not one of this chain's)."""
    parts: list[bytes] = []
    end = n
    while end > spine:
        digest = refs[end].digest
        for a in sorted((k for k in refs if spine <= k < end), reverse=True):
            if piece_digest(refs[a].digest, "int32", raw[a * 4 : end * 4]) == digest:
                parts.append(digest)
                end = a
                break
        else:
            return None
    parts.reverse()
    return parts


def _record_ref(
    state: SessionState,
    chain_id: int,
    kind: str,
    items: list[Any],
    encode: Callable[[list[Any]], np.ndarray],
) -> tuple[ArrayRef, int]:
    """`encode(items)` stored as a delta on the same record of the chain's previous
    snapshot; (its ref, how many pieces deep that ref is).

    The delta (only the new items encoded) applies when that record's items
    are a prefix of `items` (the chain grew); otherwise, or after
    `RECORD_SPINE` deltas in a row, the record is stored whole, which bounds
    the pieces a restart reads. A restored session's records go on from its
    snapshot's (`restored_records`).
    """
    previous = state.snapshot_records.get((chain_id, kind))
    base: ArrayRef | None = None
    depth, start = 1, 0
    if previous is not None:
        old, ref, old_depth = previous
        if len(old) <= len(items) and items[: len(old)] == old:
            if len(old) == len(items):
                return ref, old_depth
            if old_depth < RECORD_SPINE:
                base, depth, start = ref, old_depth + 1, len(old)
    ref = state.journal.add_array(encode(items[start:]), extends=base)
    state.snapshot_records[(chain_id, kind)] = (list(items), ref, depth)
    return ref, depth


def restored_records(
    live: LiveState, chains: SessionChains
) -> dict[tuple[int, str], tuple[Any, ArrayRef, int]]:
    """`SessionState.snapshot_records` as of the snapshot `chains` were restored from,
    so the next snapshot stores only what its turn adds, as before the restart."""
    records: dict[tuple[int, str], tuple[Any, ArrayRef, int]] = {}
    for c in live.chains:
        chain = chains.chains[c.chain_id]
        records[(c.chain_id, "digests")] = (
            list(chain.message_digests),
            c.message_digests,
            c.digests_depth,
        )
        records[(c.chain_id, "boundaries")] = (
            list(chain.boundaries),
            c.boundaries,
            c.boundaries_depth,
        )
    return records


def _digest_array(digests: list[str]) -> np.ndarray:
    packed = b"".join(_length_prefixed(_pack_digest(d)) for d in digests)
    return np.frombuffer(packed, dtype=np.uint8)


def _length_prefixed(packed: bytes) -> bytes:
    if len(packed) > 255:
        raise ValueError(f"a message digest of {len(packed)} bytes cannot be snapshotted")
    return bytes((len(packed),)) + packed


def _digests_of(data: np.ndarray) -> list[str]:
    raw, digests, at = data.tobytes(), [], 0
    while at < len(raw):
        n = raw[at]
        if at + 1 + n > len(raw):
            raise SnapshotUnusable("its message digests end in the middle of one")
        digests.append(_unpack_digest(raw[at + 1 : at + 1 + n]))
        at += 1 + n
    return digests


def _boundary_array(boundaries: list[Boundary]) -> np.ndarray:
    rows = [(b.n_input_messages, b.input_len, b.end_len, int(b.ended_with_eos)) for b in boundaries]
    return np.asarray(rows, dtype=np.int32).reshape(-1)


def _boundaries_of(data: np.ndarray) -> list[Boundary]:
    if data.size % 4:
        raise SnapshotUnusable(f"{data.size} boundary numbers, not four per boundary")
    return [
        Boundary(int(a), int(b), int(c), bool(d)) for a, b, c, d in data.reshape(-1, 4).tolist()
    ]


def _pack_digest(digest: str) -> bytes:
    if _HEX_DIGEST.fullmatch(digest):
        return _RAW + bytes.fromhex(digest.replace("+", ""))
    if _CALLS_DIGEST.fullmatch(digest):  # `<message>|<calls alone>[+<reasoning>]`
        return _CALLS + bytes.fromhex(digest.replace("+", "").replace("|", ""))
    return _TEXT + digest.encode()


def _unpack_digest(packed: bytes) -> str:
    tag, body = packed[:1], packed[1:]
    if tag == _TEXT:
        return body.decode()
    if tag == _RAW and len(body) == 16:
        return body.hex()
    if tag == _RAW and len(body) == 32:
        return f"{body[:16].hex()}+{body[16:].hex()}"
    if tag == _CALLS and len(body) in (32, 48):
        reasoning = f"+{body[32:].hex()}" if len(body) == 48 else ""
        return f"{body[:16].hex()}|{body[16:32].hex()}{reasoning}"
    raise SnapshotUnusable(f"a message digest of {len(packed)} bytes")


def decode_snapshot(record: ev.RecordedEvent) -> LiveState:
    """The state a recorded snapshot holds; raises `SnapshotUnusable` if it cannot be used."""
    event = record.event
    assert isinstance(event, ev.StateSnapshot)
    if event.format != SNAPSHOT_FORMAT:
        raise SnapshotUnusable(f"format {event.format}, this code reads {SNAPSHOT_FORMAT}")
    try:
        live = _decoder.decode(event.state)
    except msgspec.DecodeError as exc:
        raise SnapshotUnusable(f"undecodable: {exc}") from exc
    if live.seq != record.seq:
        raise SnapshotUnusable(f"written for seq {live.seq}, found at seq {record.seq}")
    return live


def token_refs(live: LiveState) -> list[ArrayRef]:
    """The arrays `restore_chains` needs, in its order (per chain: tokens, digests, boundaries)."""
    return [ref for c in live.chains for ref in (c.tokens, c.message_digests, c.boundaries)]


def restore_chains(live: LiveState, arrays: list[np.ndarray]) -> SessionChains:
    """The session's chains from a snapshot and the arrays it names (`token_refs` order)."""
    chains = SessionChains(
        main_chain_id=live.main_chain_id,
        pending_dispatches=list(live.pending_dispatches),
        next_chain_id=live.next_chain_id,
        clock=live.clock,
        max_chains=live.max_chains,
    )
    if len(arrays) != 3 * len(live.chains):
        raise SnapshotUnusable(f"{len(arrays)} arrays for {len(live.chains)} chains")
    for i, c in enumerate(live.chains):
        ids, digests, boundaries = arrays[3 * i : 3 * i + 3]
        ends = _boundaries_of(boundaries)
        if not ends or ends[-1].end_len != len(ids):
            raise SnapshotUnusable(f"chain {c.chain_id}: its tokens do not end at its last turn")
        chains.chains[c.chain_id] = Chain(
            chain_id=c.chain_id,
            system_digest=c.system_digest,
            render_digest=c.render_digest,
            message_digests=_digests_of(digests),
            tokens=token_array(ids),
            boundaries=ends,
            main_line=c.main_line,
            parent_chain_id=c.parent_chain_id,
            dispatch_tool_use_id=c.dispatch_tool_use_id,
            last_used=c.last_used,
            n_tools=c.n_tools,
        )
    if live.main_chain_id is not None and live.main_chain_id not in chains.chains:
        raise SnapshotUnusable(f"its main chain {live.main_chain_id} is not among its chains")
    return chains


def chain_refs(live: LiveState) -> dict[int, dict[int, ArrayRef]]:
    """`SessionState.chain_refs` as the snapshot recorded them (the tokens' own ref included)."""
    out: dict[int, dict[int, ArrayRef]] = {}
    for c in live.chains:
        refs = {r.length: r for r in c.prefix_refs}
        refs[c.tokens.length] = c.tokens
        out[c.chain_id] = refs
    return out
