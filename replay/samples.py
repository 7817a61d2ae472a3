"""Training samples: the reducer's output records, their invariants and bytes.

A `Sample` is what a trainer consumes (see `replay.export` for the mapping to
slime's `Sample` and verl's agent-loop output). `SessionResult` is one
session's reduction: samples plus the segments they came from and why things
were dropped or masked. Both have a canonical msgpack encoding (sorted map
keys, no defaults omitted) so equal results have equal bytes and digests.
"""

from __future__ import annotations

import threading
from typing import Any, Literal

import msgspec
import numpy as np
import xxhash
import zstandard

SampleStatus = Literal["completed", "truncated", "aborted", "failed"]
SegmentKind = Literal["subagent", "wipe", "final", "side"]


class Tensor(msgspec.Struct, frozen=True, array_like=True):
    """A small dense int32 tensor kept as raw little-endian bytes."""

    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def from_array(cls, array: np.ndarray) -> Tensor:
        arr = np.ascontiguousarray(array, dtype="<i4")
        return cls(shape=tuple(int(d) for d in arr.shape), data=arr.tobytes())

    def to_array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype="<i4").reshape(self.shape)


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """One training sample: a prompt and a response with a per-token loss mask.

    `loss_mask`, `rollout_logprobs` and `weight_versions` cover the response
    only. Trainable tokens (mask 1) are engine output with the engine's
    logprob; every mask-0 token has logprob 0. `weight_versions` names the
    weight version that emitted each engine token ("" for inserted tokens:
    tool results, user text, template glue), also where a rule masked it.
    """

    tokens: list[int]
    prompt_len: int
    response_len: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    weight_versions: list[str]
    status: SampleStatus
    reward: float
    rollout_id: str
    session_id: str
    metadata: dict[str, Any] = {}
    routed_experts: Tensor | None = None


class Segment(msgspec.Struct, frozen=True, kw_only=True):
    """One chain of a session, classified. `dropped` says why it built no sample."""

    kind: SegmentKind
    chain_id: int
    turns: list[int]
    first_seq: int
    last_seq: int
    total_tokens: int
    trainable_tokens: int
    dispatch_tool_use_id: str | None = None
    dropped: str | None = None


class SessionResult(msgspec.Struct, frozen=True, kw_only=True):
    """A session reduced under one rules version."""

    session_id: str
    rules_version: str
    status: SampleStatus
    reward: float
    segments: list[Segment]
    samples: list[Sample]
    placeholder: bool
    turns_total: int
    turns_used: int
    tito_failed_turns: int
    aborts: int
    diagnostics: list[str]
    # Where the engine's output tokens went: "engine output", "trained", and
    # the untrained ones by reason; engine output = trained + the reasons.
    token_accounting: dict[str, int] = {}


class InvariantViolation(AssertionError):
    pass


_encoder = msgspec.msgpack.Encoder(order="deterministic")
_result_decoder = msgspec.msgpack.Decoder(SessionResult)
_sample_decoder = msgspec.msgpack.Decoder(Sample)


def encode_result(result: SessionResult) -> bytes:
    """Canonical bytes of a result (stable across runs and machines)."""
    return _encoder.encode(result)


def decode_result(payload: bytes) -> SessionResult:
    """A result from its canonical bytes, or from them as a projection stores them
    (`stored_result`)."""
    return _result_decoder.decode(result_bytes(payload))


# A zstd frame starts with these bytes; a result's msgpack starts with a map header
# (0x80-0x8f, 0xde, 0xdf), so the two cannot be mistaken for one another.
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_STORED_LEVEL = 1


def stored_result(payload: bytes) -> bytes:
    """A result's canonical bytes as a `samples/` projection row holds them: zstd.

    A session's samples are ~140 kB at 10k tokens, mostly float64 logprobs
    that came from float32 (half their bytes zero) and token ids: level 1
    stores ~3.4x fewer bytes. Measured on 2,000 such sessions: 287 -> 85 MB
    written per `replay reclassify`, and less CPU for the compression and the
    write (0.6-0.8 s) than for the write alone (1.1 s). The row's digest stays
    that of the canonical bytes (`digest_bytes(payload)`).
    """
    return _compressor().compress(payload)


def result_bytes(stored: bytes) -> bytes:
    """The canonical bytes of a stored result: decompressed if `stored_result`
    compressed them, as they are if not (rows written before it)."""
    if stored[:4] == _ZSTD_MAGIC:
        return _decompressor().decompress(stored)
    return stored


def _compressor() -> zstandard.ZstdCompressor:
    c: zstandard.ZstdCompressor | None = getattr(_local, "compressor", None)
    if c is None:  # one per thread: an instance must not be shared between threads
        c = _local.compressor = zstandard.ZstdCompressor(level=_STORED_LEVEL)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


_local = threading.local()


def encode_sample(sample: Sample) -> bytes:
    return _encoder.encode(sample)


def decode_sample(payload: bytes) -> Sample:
    return _sample_decoder.decode(payload)


def digest_bytes(payload: bytes) -> str:
    """128-bit XXH3 of `payload`, as hex: what tells two results' bytes apart
    (a projection row's digest, `result_digest`).

    Not a defence against anyone: nothing here chooses the bytes to collide.
    `replay reclassify` digests ~140 kB per session; BLAKE2b took ~12% of its
    instructions, XXH3 reads the bytes about 15 times faster.
    """
    return xxhash.xxh3_128_hexdigest(payload)


def sample_digest(sample: Sample) -> str:
    return digest_bytes(encode_sample(sample))


def result_digest(result: SessionResult) -> str:
    return digest_bytes(encode_result(result))


def trainable_tokens(sample: Sample) -> int:
    return sum(sample.loss_mask)


def check_invariants(
    sample: Sample,
    *,
    context_length: int | None = None,
    engine_tokens: list[tuple[int, int, float]] | None = None,
    routed_experts: tuple[int, int] | None = None,
) -> None:
    """Raise `InvariantViolation` unless the sample keeps the seed-003 contract.

    `engine_tokens`, when given, is the multiset of (position in tokens,
    token id, logprob) the engine emitted: every masked-in token must be one
    of them, with exactly that logprob.
    """

    def fail(msg: str) -> None:
        raise InvariantViolation(f"sample {sample.session_id}: {msg}")

    if sample.prompt_len < 0 or sample.response_len < 0:
        fail(f"negative lengths {sample.prompt_len}/{sample.response_len}")
    if len(sample.tokens) != sample.prompt_len + sample.response_len:
        fail(
            f"len(tokens)={len(sample.tokens)} != prompt_len {sample.prompt_len} + "
            f"response_len {sample.response_len}"
        )
    for name in ("loss_mask", "rollout_logprobs", "weight_versions"):
        n = len(getattr(sample, name))
        if n != sample.response_len:
            fail(f"len({name})={n} != response_len {sample.response_len}")
    if any(m not in (0, 1) for m in sample.loss_mask):
        fail("loss_mask holds values other than 0/1")
    if context_length is not None and len(sample.tokens) > context_length:
        fail(f"{len(sample.tokens)} tokens exceed the context budget {context_length}")
    for i, (m, lp) in enumerate(zip(sample.loss_mask, sample.rollout_logprobs, strict=True)):
        if m == 0 and lp != 0.0:
            fail(f"masked response token {i} has logprob {lp} (must be 0)")
        if m == 1 and lp > 0.0:
            fail(f"trainable token {i} has a positive logprob {lp}")
    if sample.status in ("aborted", "failed") and any(sample.loss_mask):
        fail(f"status {sample.status} but {sum(sample.loss_mask)} tokens are trainable")
    if sample.status in ("aborted", "failed") and sample.reward != 0.0:
        fail(f"status {sample.status} but reward {sample.reward}")
    if engine_tokens is not None:
        emitted = {pos: (tok, lp) for pos, tok, lp in engine_tokens}
        for i, m in enumerate(sample.loss_mask):
            if not m:
                continue
            pos = sample.prompt_len + i
            got = (sample.tokens[pos], sample.rollout_logprobs[i])
            if emitted.get(pos) != got:
                fail(f"trainable token at {pos} {got} is not engine output {emitted.get(pos)}")
    if routed_experts is not None:
        if sample.routed_experts is None:
            fail("routed experts configured but missing")
        else:
            want = (len(sample.tokens), *routed_experts)
            if sample.routed_experts.shape != want:
                fail(f"routed_experts shape {sample.routed_experts.shape} != {want}")
            if len(sample.routed_experts.data) != 4 * int(np.prod(want)):
                fail("routed_experts data size does not match its shape")
