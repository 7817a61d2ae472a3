"""What a turn stores, stored as deltas against what its session already stored.

An agent resends the whole conversation every turn, so storing each request
body and engine input whole would make every turn's write (hashing,
compression, rows) grow with the context, and a session's storage with its
square. Both are stored as piece chains instead (see `EventStore.put_array`'s
`extends`): an engine input after the longest stored prefix of the chain it
extends, a body after the bytes it shares with the previous body. What follows
the shared prefix (the newest messages, then system prompt and tools that
repeat every turn) is compressed against the previous body (`basis=`), so it
too costs only what changed. Readers see no difference: `get_array(ref)`
returns the whole array.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from recorder.log.events import ArrayRef

if TYPE_CHECKING:
    from recorder.log.store.base import EventStore
    from recorder.model.tokens import TurnPlan

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


@dataclass
class BodyPrefixes:
    """The previous body of a session, its ref, and refs of stored prefixes of it, shortest first.

    Empty after a restart: the next body then starts a new basis chain.
    """

    body: bytes = b""
    refs: list[ArrayRef] = field(default_factory=list)
    ref: ArrayRef | None = None


def shared_prefix_len(a: bytes, b: bytes) -> int:
    """How many leading bytes `a` and `b` have in common."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.frombuffer(a, dtype=np.uint8, count=n)
    y = np.frombuffer(b, dtype=np.uint8, count=n)
    differ = np.flatnonzero(x != y)
    return int(differ[0]) if differ.size else n


async def put_body(
    store: EventStore, previous: BodyPrefixes, body: bytes
) -> tuple[ArrayRef, BodyPrefixes]:
    """Store `body` after what it shares with `previous`; (its ref, what the next body uses)."""
    data = np.frombuffer(body, dtype=np.uint8)
    basis = previous.ref
    shared = shared_prefix_len(previous.body, body)
    if shared < MIN_SHARED_BYTES:
        ref = await store.put_array(data, basis=basis)
        return ref, BodyPrefixes(body, [ref], ref)
    usable = [r for r in previous.refs if r.length <= shared]
    base = usable[-1] if usable else None
    start = base.length if base is not None else 0
    prefix = await store.put_array(data[start:shared], extends=base, basis=basis)
    ref = await store.put_array(data[shared:], extends=prefix, basis=basis)
    refs = [r for r in usable if r.length < shared] + [prefix]
    if ref.length > prefix.length:
        refs.append(ref)
    return ref, BodyPrefixes(body, refs[-MAX_PREFIX_REFS:], ref)


# Per chain id: stored prefixes of the chain's tokens, by length (SessionState.chain_refs).
ChainRefs = dict[int, dict[int, ArrayRef]]


async def put_input(store: EventStore, chain_refs: ChainRefs, plan: TurnPlan) -> ArrayRef:
    """Store the engine input as a delta after the longest stored prefix of its chain."""
    base: ArrayRef | None = None
    if plan.prefix_len:
        source = plan.chain_id if plan.action == "extend" else plan.parent_chain_id
        known = chain_refs.get(source, {}) if source is not None else {}
        usable = [n for n in known if n <= plan.prefix_len]
        base = known[max(usable)] if usable else None
    start = base.length if base is not None else 0
    return await store.put_array(np.asarray(plan.input_ids[start:], dtype=np.int32), extends=base)


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
