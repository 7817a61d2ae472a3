"""msgpack bytes of numpy arrays, equal byte for byte to msgspec's encoding of their lists.

A sample's tokens, loss mask and logprobs are most of a session's result
(10k+ numbers per sample). `replay reclassify` only encodes them, so building
Python lists first (`ndarray.tolist`) and then walking those lists in the
encoder cost more than the rest of the reduction; here each array is encoded
with a few vectorised numpy operations instead.

The output is exactly what `msgspec.msgpack.encode(array.tolist())` gives:
msgpack's smallest integer format per value (as msgspec picks it) and every
float as a float64 (msgspec never narrows a Python float), so digests and
stored projections do not change. Anything outside the cases below (an
object array, integers beyond 32 bits) goes through msgspec itself.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from replay.samples import Sample, SessionResult

_encoder = msgspec.msgpack.Encoder(order="deterministic")


def array_header(n: int) -> bytes:
    """msgpack's header of an array of `n` items."""
    if n < 16:
        return bytes([0x90 | n])
    if n < 2**16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def encode_array(values: Any) -> bytes:
    """msgpack bytes of a 1-D integer or float array as a list (a list: msgspec's own)."""
    if not isinstance(values, np.ndarray) or values.ndim != 1:
        return _encoder.encode(values)
    if values.dtype.kind in "iu":  # not "b": msgpack has booleans of its own
        return _encode_ints(values)
    if values.dtype.kind == "f":
        return _encode_floats(values)
    return _encoder.encode(values.tolist())


# msgpack's float 64: the 0xCB marker, then the big-endian double (9 bytes, packed).
_FLOAT64 = np.dtype([("marker", "u1"), ("value", ">f8")])


def _encode_floats(values: np.ndarray) -> bytes:
    """One packed record per value: a field assignment converts each double at
    once, where writing 8 bytes into every 9-byte row went byte by byte (5x)."""
    out = np.empty(values.size, dtype=_FLOAT64)
    out["marker"] = 0xCB
    out["value"] = values
    return array_header(values.size) + out.tobytes()


def _encode_ints(values: np.ndarray) -> bytes:
    n = values.size
    if n == 0:
        return array_header(0)
    lo, hi = int(values.min()), int(values.max())
    if lo >= 0 and hi <= 127:  # all positive fixints (a loss mask): one byte each
        return array_header(n) + values.astype(np.uint8).tobytes()
    if lo < 0 or hi > 2**32 - 1:  # not token ids: msgspec's own encoding
        return _encoder.encode(values.tolist())
    # One row per value: the marker (or the fixint itself), then its
    # big-endian payload; row k keeps its first length(k) bytes (fixint 1,
    # uint8 2, uint16 3, uint32 5), and the kept bytes in row order are the
    # encoding. Vocabularies under 65,536 ids need 3 columns, not 5.
    v = values.astype(np.uint32)
    u8, u16 = v > 127, v > 255
    width = 5 if hi > 65535 else 3
    rows = np.empty((n, width), dtype=np.uint8)
    keep = np.empty((n, width), dtype=bool)
    keep[:, 0], keep[:, 1], keep[:, 2] = True, u8, u16
    if width == 3:
        rows[:, 0] = np.where(u16, 0xCD, np.where(u8, 0xCC, v))
        rows[:, 1] = np.where(u16, v >> 8, v)
        rows[:, 2] = v
    else:
        u32 = v > 65535
        rows[:, 0] = np.where(u32, 0xCE, np.where(u16, 0xCD, np.where(u8, 0xCC, v)))
        rows[:, 1] = np.where(u32, v >> 24, np.where(u16, v >> 8, v))
        rows[:, 2] = np.where(u32, v >> 16, v)
        rows[:, 3] = v >> 8
        rows[:, 4] = v
        keep[:, 3] = keep[:, 4] = u32
    return array_header(n) + np.compress(keep.ravel(), rows.ravel()).tobytes()


# The sample fields a packed result holds as numpy arrays (`reduce_session(packed=True)`).
PACKED_FIELDS = ("tokens", "loss_mask", "rollout_logprobs")


def unpacked(result: SessionResult) -> SessionResult:
    """`result` with every sample's packed arrays as the lists a `Sample` declares."""
    if not any(isinstance(s.tokens, np.ndarray) for s in result.samples):
        return result
    return msgspec.structs.replace(result, samples=[unpacked_sample(s) for s in result.samples])


def unpacked_sample(sample: Sample) -> Sample:
    """`sample` with its packed arrays (if any) as lists."""
    lists = {
        name: value.tolist()
        for name in PACKED_FIELDS
        if isinstance(value := getattr(sample, name), np.ndarray)
    }
    return msgspec.structs.replace(sample, **lists) if lists else sample
