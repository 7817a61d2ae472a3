"""Reading stored arrays: their pieces, from the cache or the database, verified.

An array is a chain of pieces (each extending its parent), and a piece may be
compressed against another array (its basis), so reading one array can need
pieces of several chains. `PieceReader` fetches what the cache lacks in rounds
(one IN query per chain depth, on one connection), decodes basis-coded pieces
once their basis is decoded, and hands back the pieces; `assemble_shared`
(arrays.py) turns them into arrays. The store's only part in it is the query
that returns piece rows (a backend hook: SQLite and Postgres store the
compressed bytes differently).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import numpy as np
from sqlalchemy.ext.asyncio import AsyncConnection

from recorder.log.events import ArrayRef
from recorder.log.store import arrays as arr
from recorder.log.store.errors import CorruptArray

# Digests per IN (...) query.
IN_CHUNK = 500

# (conn, digests) -> rows of (digest, parent, dtype, total_length, codec, data,
# data_tail, basis, basis_depth), one per stored digest.
PieceRows = Callable[[AsyncConnection, Sequence[bytes]], Awaitable[Iterable[Any]]]


class PieceReader:
    """Verified pieces by digest: cached ones free, the rest read in rounds."""

    def __init__(
        self,
        connect: Callable[[], contextlib.AbstractAsyncContextManager[Any]],
        cache: arr.PieceCache,
        rows: PieceRows,
        chain_rows: PieceRows,
    ) -> None:
        self._connect = connect  # a read connection, handed to `rows`
        self._cache = cache
        self._rows = rows
        self._chain_rows = chain_rows  # rows of the digests and of all their ancestors

    async def arrays(
        self, refs: Sequence[ArrayRef], *, cache: bool, cold: bool = False
    ) -> list[np.ndarray]:
        """The arrays `refs` name (prefixes of one another share one buffer)."""
        local = await self.load([r.digest for r in refs], cache=cache, cold=cold)
        return arr.assemble_shared(refs, lambda digest: chain(local, digest))

    async def load(
        self, digests: Sequence[bytes], *, cache: bool, cold: bool = False
    ) -> dict[bytes, arr.DecodedPiece]:
        """Verified pieces of the arrays `digests` name: their chains and their bases' chains.

        `cold`: nothing of them is expected in the cache (a restart), so the
        uncached arrays' whole piece chains come in the first round (one
        recursive query) instead of one round per piece of the longest chain.
        """
        local: dict[bytes, arr.DecodedPiece] = {}
        on_basis: dict[bytes, arr.Piece] = {}  # fetched, decodable once their basis is
        frontier = set(digests)
        async with contextlib.AsyncExitStack() as stack:
            conn: AsyncConnection | None = None
            uncached = [d for d in frontier if self._cache.get(d) is None] if cold else []
            if uncached:
                conn = await stack.enter_async_context(self._connect())
                for piece in arr.decode_rows(await self._chain_rows(conn, uncached)):
                    if isinstance(piece, arr.Piece):
                        on_basis[piece.digest] = piece
                    elif piece.digest not in local:
                        local[piece.digest] = piece
                        if cache:
                            self._cache.put(piece)
                # What the chains' basis-coded and concatenated pieces need besides
                # their chains: fetched in the rounds below.
                frontier.update(x for p in on_basis.values() for _, x in arr.piece_bases(p))
            while frontier:
                wanted = []
                for d in frontier:
                    if d in local or d in on_basis:  # fetched by the cold read
                        continue
                    cached = self._cache.get(d)
                    if cached is not None:
                        local[d] = cached
                    else:
                        wanted.append(d)
                if wanted:
                    if conn is None:
                        conn = await stack.enter_async_context(self._connect())
                    for piece in await self._fetch(conn, wanted):
                        if isinstance(piece, arr.Piece):
                            on_basis[piece.digest] = piece
                            continue
                        local[piece.digest] = piece
                        if cache:
                            self._cache.put(piece)
                next_frontier: set[bytes] = set()
                for d in frontier:
                    stored = on_basis.get(d)
                    deps = (
                        [local[d].parent]
                        if stored is None
                        else [x for _, x in arr.piece_bases(stored)]
                    )
                    next_frontier.update(
                        x for x in deps if x is not None and x not in local and x not in on_basis
                    )
                frontier = next_frontier
        if on_basis:
            for piece in decode_on_basis(local, on_basis):
                if cache:
                    self._cache.put(piece)
        return local

    async def _fetch(
        self, conn: AsyncConnection, digests: list[bytes]
    ) -> list[arr.DecodedPiece | arr.Piece]:
        """Read pieces by digest; raise `ArrayNotFound` for any missing.

        Pieces without a basis come back verified; basis-coded ones come back
        as stored (`arr.Piece`), to be decoded once their basis is.
        """
        out: list[arr.DecodedPiece | arr.Piece] = []
        for chunk in chunks(digests):
            out += arr.decode_rows(await self._rows(conn, chunk))
        if len(out) != len(digests):
            missing = set(digests) - {p.digest for p in out}
            if missing:
                raise arr.missing_piece(min(missing))
        return out


def decode_on_basis(
    local: dict[bytes, arr.DecodedPiece], pending: dict[bytes, arr.Piece]
) -> list[arr.DecodedPiece]:
    """Decode basis-coded pieces into `local`, each after every piece of its basis
    (a concatenated piece: after its parts).

    Iterative (an explicit stack, not recursion): a basis may itself rest on
    a basis, and a damaged database could even hold a cycle, reported as
    corruption. Every piece's chain and its basis's chain (or its parts) are
    in `local` or `pending` (`PieceReader.load` fetched them).
    """
    decoded: list[arr.DecodedPiece] = []
    basis_bytes: dict[bytes, bytes] = {}
    entered: set[bytes] = set()
    for root in pending:
        stack = [root]
        while stack:
            d = stack[-1]
            if d in local:
                stack.pop()
                continue
            piece = pending[d]
            parts = arr.concat_parts(piece)
            if parts:
                waiting = [p for p in parts if p not in local]
            elif piece.codec == arr.CODEC_ZSTD_PRIOR:
                assert piece.basis is not None
                waiting = _pending_in_tail(local, pending, piece.basis, arr.PRIOR_BYTES)
            else:
                assert piece.basis is not None
                waiting = _pending_in_chain(local, pending, piece.basis)
            if d in entered:
                if waiting:
                    raise CorruptArray(
                        f"stored array piece {d.hex()} depends on itself through its basis "
                        "or parts: the database is damaged. Restore it from a good copy "
                        "(`recorder db copy --from GOOD --to NEW`)"
                    )
                if parts:
                    content = b"".join(local[p].suffix.tobytes() for p in parts)
                elif piece.codec == arr.CODEC_ZSTD_PRIOR:
                    assert piece.basis is not None
                    content = tail_bytes(local, piece.basis, arr.PRIOR_BYTES)
                else:
                    assert piece.basis is not None
                    content = basis_bytes.get(piece.basis)
                    if content is None:
                        content = arr.chain_bytes(chain(local, piece.basis))
                        basis_bytes[piece.basis] = content
                local[d] = arr.decode_piece(piece, content)
                decoded.append(local[d])
                stack.pop()
            else:
                entered.add(d)
                stack.extend(waiting)
    return decoded


def _pending_in_chain(
    local: dict[bytes, arr.DecodedPiece], pending: dict[bytes, arr.Piece], digest: bytes
) -> list[bytes]:
    """Pieces of the chain ending at `digest` that are not decoded yet."""
    out = []
    d: bytes | None = digest
    while d is not None:
        piece = local.get(d)
        if piece is None:
            out.append(d)
            d = pending[d].parent
        else:
            d = piece.parent
    return out


def _pending_in_tail(
    local: dict[bytes, arr.DecodedPiece], pending: dict[bytes, arr.Piece], digest: bytes, n: int
) -> list[bytes]:
    """Pieces not decoded yet among those holding the last `n` bytes of the array
    `digest` names (a pending piece's size is unknown: the walk goes on past it).
    Walks back only that far: a session's close decodes every turn's input, and
    a walk to the root for each would cost the square of its turns."""
    out = []
    have = 0
    d: bytes | None = digest
    while d is not None and have < n:
        piece = local.get(d)
        if piece is None:
            out.append(d)
            d = pending[d].parent
        else:
            have += piece.suffix.nbytes
            d = piece.parent
    return out


def tail_bytes(local: dict[bytes, arr.DecodedPiece], digest: bytes, n: int) -> bytes:
    """The last `n` bytes (all, if fewer) of the array `digest` names, from decoded pieces."""
    parts: list[bytes] = []
    have = 0
    d: bytes | None = digest
    while d is not None and have < n:
        piece = local[d]
        parts.append(piece.suffix.tobytes())
        have += piece.suffix.nbytes
        d = piece.parent
    joined = b"".join(reversed(parts))
    return joined[max(0, len(joined) - n) :]


def chain(local: dict[bytes, arr.DecodedPiece], digest: bytes) -> list[arr.DecodedPiece]:
    chain = []
    d: bytes | None = digest
    while d is not None:
        piece = local[d]
        chain.append(piece)
        d = piece.parent
    chain.reverse()
    return chain


def chunks(items: Sequence[Any], n: int = IN_CHUNK) -> Iterable[Sequence[Any]]:
    """`items` in slices of at most `n` (one IN (...) query each)."""
    for i in range(0, len(items), n):
        yield items[i : i + n]
