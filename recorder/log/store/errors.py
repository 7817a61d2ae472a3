"""The store's error tree: what callers catch, each saying what to do next.

Apart from the interface (base.py) so the array codec (arrays.py) can raise
them without importing the interface that names its types.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class ConcurrencyConflict(StoreError):
    """The session stream was not at the expected sequence number.

    Nothing of the batch was written; re-read the session and retry.
    """

    def __init__(self, session_id: str, expected_seq: int, actual_seq: int) -> None:
        super().__init__(
            f"session {session_id!r}: expected next seq {expected_seq}, but the stream is at "
            f"{actual_seq}; re-read the session and retry"
        )
        self.session_id = session_id
        self.expected_seq = expected_seq
        self.actual_seq = actual_seq


class IdempotencyConflict(StoreError):
    """An event id was re-sent with a different payload."""


class CorruptArray(StoreError):
    """A stored array failed its hash check on read."""


class ArrayNotFound(CorruptArray):
    """A ref (or an `extends=` parent) names an array this database does not hold."""


class StorageUnavailable(StoreError):
    """The log cannot be written now (disk full, database unreachable, store closed).

    Nothing of the write was acknowledged. The message is plain (no driver
    internals: hosts, ports, links); the driver's error is the `__cause__`,
    for the server log. Retry once the storage is back.
    """


class SchemaOutOfDate(StoreError):
    """The database is at an older migration revision than this code needs."""
