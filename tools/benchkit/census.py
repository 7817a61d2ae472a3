"""What a running server's memory is made of: per open session, by structure, and process-wide.

Runs inside the server process (`tools.bench_session_memory --serve` installs
it behind SIGUSR1), while it is idle. Each session's state is walked structure
by structure, in a fixed order, counting each object once (`Walk`): what an
earlier structure already reached counts there, so the categories add up to
what the sessions hold without double counting. What a view keeps alive is
counted, not the view's length: a numpy slice or a memoryview counts its
owner's whole buffer, and a `msgspec.Raw` (a decoded request's messages are
views into its body) counts the buffer it points into,
found through its C struct (`Raw` exposes no attribute for it). Beside them,
the store's piece cache (by dtype), SQLite's own allocator and glibc's heap
(in use, and free but still held): memory no session owns but the sessions
made grow. `CENSUS_PIECES=1` in the server's environment also lists every
cached piece (dtype, total length, suffix length, digest, parent): how the
spine pieces that repeated a chain's tokens were found (snapshot._tokens_ref).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import re
import sys
import tempfile
import types
from array import array
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np

# Objects never walked into: code, classes, modules, and whatever the caller names
# (the store, the registry, the loop: shared by every session).
_SHARED_TYPES = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
    types.FrameType,
)


def raw_base(raw: msgspec.Raw) -> object | None:
    """The object a `msgspec.Raw` view keeps alive (None for a Raw that owns its bytes).

    msgspec's `Raw` is `{PyObject_HEAD; PyObject *base; char *buf; Py_ssize_t len;
    bool is_view}` (msgspec/_core.c); `base` is the decoded buffer, or NULL.
    """
    address = ctypes.c_void_p.from_address(id(raw) + object.__basicsize__).value
    if not address:
        return None
    return ctypes.cast(address, ctypes.py_object).value  # type: ignore[no-any-return]


def buffer_owner(obj: object) -> object:
    """The object owning the memory a numpy view or memoryview shows."""
    while True:
        if isinstance(obj, np.ndarray) and obj.base is not None:
            obj = obj.base
        elif isinstance(obj, memoryview):
            obj = obj.obj
        else:
            return obj


class Walk:
    """Bytes reachable from roots, each object counted once across every `size` call."""

    def __init__(self, shared: Iterable[object] = ()) -> None:
        self.seen: set[int] = {id(o) for o in shared}

    def size(self, *roots: object) -> int:
        total = 0
        stack = list(roots)
        while stack:
            obj = stack.pop()
            if id(obj) in self.seen or isinstance(obj, _SHARED_TYPES):
                continue
            self.seen.add(id(obj))
            total += self._own(obj, stack)
        return total

    def _own(self, obj: object, stack: list[object]) -> int:
        """`obj`'s own bytes; what it keeps alive goes on `stack`."""
        if isinstance(obj, np.ndarray):
            owner = buffer_owner(obj)
            if owner is obj:
                return sys.getsizeof(obj)  # an owner's size includes its data
            stack.append(owner)
            return sys.getsizeof(obj)
        if isinstance(obj, memoryview):
            stack.append(buffer_owner(obj))
            return sys.getsizeof(obj)
        if isinstance(obj, msgspec.Raw):
            # Its own struct (msgspec 0.22's `Raw.__sizeof__` answers a pointer, not a size).
            own = type(obj).__basicsize__
            base = raw_base(obj)
            if base is None:
                return own + len(obj)
            stack.append(base)
            return own
        if isinstance(obj, array):
            return sys.getsizeof(obj)  # with its allocated buffer
        stack.extend(gc.get_referents(obj))
        return sys.getsizeof(obj)


# The structures of a `SessionState`, in the order they are walked: what a view in
# a later one keeps alive is counted by the earlier one that owns it.
STRUCTURES = (
    "chains: token ids (int32)",
    "chains: digests, boundaries",
    "previous body: window, digests (body delta)",
    "body delta: refs",
    "parse cache: translations",
    "parse cache: keys, LRU, previous request",
    "chain refs + snapshot records",
    "journal, metadata, the rest",
)


def session_census(state: Any, walk: Walk) -> dict[str, int]:
    """Bytes each structure of one session's state keeps alive (see `STRUCTURES`)."""
    chains = state.chains
    chain_list = list(getattr(chains, "chains", {}).values()) if chains is not None else []
    cache = state.parse_cache
    sizes = [
        walk.size(*(c.tokens for c in chain_list)),
        walk.size(chains) if chains is not None else 0,
        walk.size(state.body_prefixes.window, state.body_prefixes.digests),
        walk.size(state.body_prefixes),
        walk.size(*cache._entries.values()),
        walk.size(cache),
        walk.size(state.chain_refs, state.snapshot_records),
        walk.size(state),
    ]
    return dict(zip(STRUCTURES, sizes, strict=True))


def shared_caches(ctx: Any) -> dict[str, int]:
    """Process-wide caches the sessions fill, bounded by their own caps: the engine's
    last /generate body per session (`engine_wire.GenerateBodies`) and the tokenizer's
    pre-token ids (`word_cache.WordCache`), in bytes kept alive."""
    bodies = ctx.engine.bodies
    out = {
        "engine body cache": bodies.held_bytes,
        "engine body cache: cap": bodies.budget_bytes,
        "engine body cache: sessions": len(bodies),
    }
    words = getattr(getattr(ctx.tokenizer, "_words", None), "_words", None)
    if words is not None:
        out["tokenizer word cache"] = Walk().size(words)
        out["tokenizer word cache: words"] = len(words)
    return out


def piece_cache_census(cache: Any) -> dict[str, Any]:
    """The store's piece cache: entries and the bytes it charges, per dtype."""
    out: dict[str, Any] = {"entries": len(cache), "charged": cache.nbytes}
    for piece in list(cache._items.values()):
        key = f"{piece.dtype} bytes"
        out[key] = out.get(key, 0) + cache.charge(piece)
        out[f"{piece.dtype} items"] = out.get(f"{piece.dtype} items", 0) + len(piece.suffix)
        out[f"{piece.dtype} pieces"] = out.get(f"{piece.dtype} pieces", 0) + 1
        if os.environ.get("CENSUS_PIECES"):
            out.setdefault("list", []).append(
                (
                    piece.dtype,
                    piece.total_length,
                    len(piece.suffix),
                    piece.digest.hex()[:8],
                    piece.parent.hex()[:8] if piece.parent else None,
                )
            )
    return out


def sqlite_memory() -> int:
    """Bytes SQLite's allocator holds now (page caches, schemas, statements), process-wide."""
    name = ctypes.util.find_library("sqlite3")
    if name is None:
        return -1
    lib = ctypes.CDLL(name)
    current, highwater = ctypes.c_int64(), ctypes.c_int64()
    if lib.sqlite3_status64(0, ctypes.byref(current), ctypes.byref(highwater), 0) != 0:
        return -1
    return current.value


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_info() -> dict[str, int]:
    """glibc's heap: bytes in use, free but held (fragmentation), and mmapped blocks."""
    name = ctypes.util.find_library("c")
    if name is None:
        return {}
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {"in use": info.uordblks, "free, held": info.fordblks, "mmapped": info.hblkhd}


def python_arenas() -> dict[str, int]:
    """Python's small-object allocator (objects of 512 bytes or less): its arenas' bytes,
    the bytes in live blocks, and the free rest (free blocks and unused pools).

    From `sys._debugmallocstats()`, which prints to the C stderr: read through a
    temporary file put in place of file descriptor 2.
    """
    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode("utf-8", "replace")

    def field(label: str) -> int:
        found = re.search(re.escape(label) + r"\s*=\s*([\d,]+)", text)
        return int(found.group(1).replace(",", "")) if found else 0

    arenas = field("Total")  # the first total: the arenas' bytes
    in_use = field("# bytes in allocated blocks")
    return {"arenas": arenas, "in use": in_use, "free": arenas - in_use}


def census(ctx: Any, shared: Iterable[object] = ()) -> dict[str, Any]:
    """Everything above for a server's context: per open session, and process-wide."""
    gc.collect()
    registry = ctx.registry
    states = [s for s in list(registry._sessions.values()) if s.status == "open"]
    walk = Walk([ctx, ctx.store, ctx.engine, ctx.tokenizer, ctx.parser, registry, *shared])
    sessions = [session_census(s, walk) for s in states]
    contexts = [
        len(s.chains.main.tokens) if s.chains is not None and s.chains.main is not None else 0
        for s in states
    ]
    return {
        "sessions": sessions,
        "contexts": contexts,
        "held_bytes": [registry._held.get(s.session_id, 0) for s in states],
        "shared": shared_caches(ctx),
        "piece_cache": piece_cache_census(ctx.store.piece_cache),
        "sqlite": sqlite_memory(),
        "malloc": malloc_info(),
        "pymalloc": python_arenas(),
    }
