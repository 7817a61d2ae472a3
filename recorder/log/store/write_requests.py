"""What a write asks the group committer for, and how a plain group is laid out.

Pure: no I/O, no clock. `SqlEventStore.append` and `put_array` build the
requests; the group committer carries them; both backends' fast paths
(`sqlite.OneHopWriter`, `postgres.PlainGroupWriter`) lay a group out with
`PlainGroup` before they read the database, and the generic path in
`sql.py` writes the same rows when a group is not plain.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import msgspec

from recorder.log.store import arrays as arr
from recorder.log.store.group_commit import WriteRequest


class EventRow(msgspec.Struct, gc=False):
    """One event as stored; built once per event in `append` (a C-level Struct: cheap).

    Untracked by the cyclic GC (it holds no containers, so it cannot be part of a
    cycle): a batch of 1,000 tracked rows set off collections that scanned every
    live object, ~3x the cost of building the rows.
    """

    event_id: uuid.UUID
    type: str
    version: int
    ts: float
    payload: bytes
    position: int = 0


class AppendRequest(WriteRequest):
    __slots__ = ("durable", "expected_seq", "pieces", "rows", "session_id")

    def __init__(
        self,
        session_id: str,
        rows: list[EventRow],
        expected_seq: int | None,
        pieces: Sequence[arr.Piece] = (),
        durable: bool = True,
    ) -> None:
        super().__init__((len(rows) + len(pieces)) or 1)
        self.session_id = session_id
        self.rows = rows
        self.expected_seq = expected_seq
        # Array pieces written in the same transaction (see `EventStore.append`).
        self.pieces = pieces
        # Must the group's commit reach the disk before this returns (see `append`)?
        self.durable = durable


class PiecesRequest(WriteRequest):
    __slots__ = ("pieces",)
    # Pieces alone need no flush at commit: no event names them before a later
    # durable commit, whose flush covers them too.
    durable = False

    def __init__(self, pieces: Sequence[arr.Piece]) -> None:
        super().__init__(len(pieces))
        self.pieces = pieces


def needs_flush(group: Sequence[GroupRequest]) -> bool:
    """Whether a group's commit must reach the disk before it returns: when any
    request in it asks for that (the fast paths; the generic path always flushes)."""
    return any(r.durable for r in group)


# (session_id, seq, row) of an event the group will insert.
NewRow = tuple[str, int, EventRow]
# What the group committer carries.
GroupRequest = AppendRequest | PiecesRequest


class PlainGroup:
    """A group's appends laid out before the database is read, as if plain.

    The generic path's rules, in queue order: each append takes its
    session's next seqs and the next run of positions. Only the sessions'
    heads and the first free position are unknown until the writer lock is
    held: `place` checks and fixes the layout once they are read.
    """

    __slots__ = ("_appends", "n_rows", "sessions")

    def __init__(self, group: Sequence[GroupRequest]) -> None:
        # Per request: (append, index of its first row in the group, seq offset
        # from its session's head); None for a pieces request.
        self._appends: list[tuple[AppendRequest, int, int] | None] = []
        offsets: dict[str, int] = {}
        self.n_rows = 0
        for request in group:
            if not isinstance(request, AppendRequest):
                self._appends.append(None)
                continue
            offset = offsets.get(request.session_id, 0)
            self._appends.append((request, self.n_rows, offset))
            offsets[request.session_id] = offset + len(request.rows)
            self.n_rows += len(request.rows)
        self.sessions = sorted(offsets)

    def place(self, next_seq: dict[str, int], first_position: int) -> list[list[int] | None] | None:
        """Each request's positions (None for a pieces request), with every row's
        position set; None if an append's `expected_seq` does not match (not plain).

        `next_seq`: each session's next seq before the group (absent: 0).
        """
        results: list[list[int] | None] = []
        for append in self._appends:
            if append is None:
                results.append(None)
                continue
            request, start, offset = append
            expected = request.expected_seq
            if expected is not None and expected != next_seq.get(request.session_id, 0) + offset:
                return None
            first = first_position + start
            results.append(list(range(first, first + len(request.rows))))
        for append, positions in zip(self._appends, results, strict=True):
            if append is not None and positions is not None:
                for row, position in zip(append[0].rows, positions, strict=True):
                    row.position = position
        return results

    def runs(self, next_seq: dict[str, int]) -> list[tuple[str, int, list[EventRow]]]:
        """(session_id, seq of the first row, rows) per append, in queue order.
        `next_seq` as given to `place`; {} gives seqs relative to the heads."""
        return [
            (a[0].session_id, next_seq.get(a[0].session_id, 0) + a[2], a[0].rows)
            for a in self._appends
            if a is not None
        ]
