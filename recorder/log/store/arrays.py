"""Content-addressed array pieces: hashing and (de)compression, no I/O.

An array is stored as a chain of pieces. A piece holds one suffix of data and
names its parent (the prefix it extends) by digest, so a turn whose prompt
extends the previous turn's prompt stores only its new tokens. A piece's
digest hashes the parent digest, the dtype and the raw suffix bytes, so the
digest of the last piece names the whole array (a hash chain) and equal
content written twice is one row.

Small int32 suffixes and float32 ones are byte-shuffled before zstd: grouping
the 1st, 2nd, 3rd and 4th byte of every element lets zstd see the
near-constant high bytes of token ids and float exponents as long runs. An
int32 suffix of `RAW_INT32_MIN_BYTES` or more is also compressed as it is,
and the smaller kept: in real text zstd finds repeated runs of tokens (words,
code lines), which shuffling cuts apart (a spine piece of ~2k tokens: 18%
smaller); ids without repeats compress better shuffled. A float64 suffix (engine
logprobs) whose every value is a float32 one (SGLang computes logprobs in
float32) is stored as those float32s, shuffled (`CODEC_F32_SHUFFLED`); a
decode widens them back and the digest check proves every bit came back.
Other float64 suffixes are shuffled, as before.

A piece may also be compressed against a *basis*: another stored array whose
whole content serves as a zstd raw-content dictionary (`CODEC_ZSTD_BASIS`).
An agent re-sends its whole conversation every turn, so a request body
compressed against the previous body costs only what changed. The basis
names an encoding, not content: it is not hashed into the digest. A piece's
`depth` counts the basis hops a cold read of it may need (0: no basis), so
writers can bound how many arrays one read decodes.

A piece may instead be a *copy* of a range of its basis's bytes
(`CODEC_COPY_BASIS`): it stores only the offset and the length, no dictionary
and no compression. A session's request bodies end with the same system prompt
and tools every turn, so each body's unchanged tail is stored in 16 bytes.

A piece may also be a *concatenation* of stored pieces (`CODEC_CONCAT`): its
data lists their digests, its raw bytes are their suffixes joined. A chain's
spine (`recorder.server.snapshot`) repeats tokens whose per-turn pieces are
stored already: it names them instead of storing them again (16 bytes a
piece, where the tokens cost ~1 byte each), and a read fetches the named
pieces alone, not their chains. So does a turn's output after its input,
naming the output ids its GenerateResult stored. The digest is over the joined bytes, as for
any piece, so a read verifies the parts it joined.

A piece that extends a parent may be compressed against the parent array's
last `PRIOR_BYTES` bytes (`CODEC_ZSTD_PRIOR`): a turn's new messages and
new tokens repeat the words, paths and code of the turns just before them
(`tools/bench_training.py`'s log: a measured turn's new messages 40% smaller,
its new tokens 26%; all bodies 13%, all token ids 11%).
A read of the piece reads its parent's chain anyway, so the dictionary costs
no extra piece: `basis` names the parent, and `depth` stays 0. The writer
has those bytes in memory (the body or the token list it stores a suffix
of) and passes them (`encode_array(prior=)`); nothing is read back.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import msgspec
import numpy as np
import zstandard

from recorder.log.events import ArrayRef, DType
from recorder.log.store.errors import ArrayNotFound, CorruptArray

DIGEST_SIZE: Final = 16
_NO_PARENT: Final = b"\x00" * DIGEST_SIZE
_PERSON: Final = b"tr-array-v1"
_ZSTD_LEVEL: Final = 3

# Codec ids stored per piece, so the format can change without rewriting rows.
CODEC_ZSTD: Final = 1
CODEC_ZSTD_SHUFFLED: Final = 2
CODEC_ZSTD_BASIS: Final = 3  # raw bytes, zstd with the basis array's bytes as dictionary
CODEC_COPY_BASIS: Final = 4  # raw bytes = the basis array's bytes [offset, offset + n)
CODEC_F32_SHUFFLED: Final = 5  # float64 raw bytes = the shuffled float32 values, widened
CODEC_CONCAT: Final = 6  # raw bytes = the suffixes of the pieces whose digests `data` lists
CODEC_ZSTD_PRIOR: Final = 7  # raw bytes, zstd with the parent's last PRIOR_BYTES as dictionary
# How much of the parent a `CODEC_ZSTD_PRIOR` piece is compressed against: the
# previous turn or so. A piece costs ~18 us more than plainly (a compressor and
# its dictionary built per piece); 8 kB packs ~5% more for ~10 us more, 32 kB
# ~10% more for ~80 us more.
# Part of codec 7's format: stored pieces were compressed against exactly this
# many bytes, so it never changes (another size is another codec).
PRIOR_BYTES: Final = 4096
PRIOR_DTYPES: Final = ("int32", "uint8")  # text and token ids; not logprobs
# Shorter suffixes are compressed plainly: loading the dictionary (~15 us) is
# worth it only for a turn's new messages or tokens, not a few ids.
PRIOR_MIN_BYTES: Final = 64
# int32 suffixes of at least this many bytes are compressed unshuffled (see above).
RAW_INT32_MIN_BYTES: Final = 4096
_COPY_RANGE: Final = struct.Struct("<QQ")  # (offset, n): a copy piece's data
# A basis-coded piece is kept only if it is at most this fraction of the plain
# encoding: otherwise its dependency on the basis is not worth a cold read.
BASIS_MAX_RATIO: Final = 0.75

NUMPY_DTYPES: Final[dict[str, np.dtype]] = {
    "int32": np.dtype("<i4"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),  # logprobs exactly as the engine sent them (JSON doubles)
    "uint8": np.dtype("u1"),
}


class Piece(msgspec.Struct, frozen=True):
    """One stored row of the `arrays` table."""

    digest: bytes
    parent: bytes | None
    dtype: str
    total_length: int  # elements in the whole array this piece ends
    codec: int
    data: bytes
    basis: bytes | None = None  # digest of the array whose bytes are the dictionary
    depth: int = 0  # basis hops to decode this piece: 0, or 1 + the basis array's depth


class DecodedPiece(msgspec.Struct, frozen=True):
    """A verified piece with its suffix as a read-only numpy array."""

    digest: bytes
    parent: bytes | None
    dtype: str
    total_length: int
    suffix: np.ndarray
    depth: int = 0


# A keyed-up hasher to copy (never updated itself): a copy costs a third less
# than a new blake2b with `person`, and a replay hashes every piece it reads.
_HASHER: Final = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_PERSON)
_DTYPE_TAGS: Final = {name: name.encode("ascii").ljust(8, b"\x00") for name in NUMPY_DTYPES}


def piece_digest(parent: bytes | None, dtype: str, raw: bytes | memoryview | np.ndarray) -> bytes:
    """`raw`: the suffix's bytes, or a C-contiguous buffer of them (hashed in place)."""
    h = _HASHER.copy()
    h.update(parent or _NO_PARENT)
    tag = _DTYPE_TAGS.get(dtype)
    h.update(tag if tag is not None else dtype.encode("ascii").ljust(8, b"\x00"))
    h.update(raw)
    return h.digest()


def as_suffix(array: np.ndarray, dtype: DType | None) -> tuple[np.ndarray, DType]:
    """Validate and normalise an array to a contiguous little-endian 1-D array."""
    arr = np.asarray(array)
    if arr.ndim != 1:
        raise ValueError(f"put_array stores 1-D arrays; got shape {arr.shape}: flatten it first")
    name = dtype or _dtype_name(arr.dtype)
    target = NUMPY_DTYPES[name]
    if arr.dtype != target:
        if not np.can_cast(arr.dtype, target, casting="same_kind") or (
            arr.dtype.kind in "iu" and arr.size and not _fits(arr, target)
        ):
            raise ValueError(f"cannot store a {arr.dtype} array as {name} without loss")
        arr = arr.astype(target)
    return np.ascontiguousarray(arr), name


def _dtype_name(dt: np.dtype) -> DType:
    if dt.kind in "iu" and dt != np.dtype("u1"):
        return "int32"
    if dt.kind == "f":
        return "float64" if dt.itemsize == 8 else "float32"
    if dt == np.dtype("u1"):
        return "uint8"
    raise ValueError(f"arrays of dtype {dt} cannot be stored; use int32, float32, float64 or uint8")


def _fits(arr: np.ndarray, target: np.dtype) -> bool:
    info = np.iinfo(target)
    return bool(arr.min() >= info.min and arr.max() <= info.max)


def _shuffle(raw: bytes, itemsize: int) -> bytes:
    return np.frombuffer(raw, np.uint8).reshape(-1, itemsize).T.tobytes()


def _unshuffle(data: bytes, itemsize: int) -> bytes:
    return np.frombuffer(data, np.uint8).reshape(itemsize, -1).T.tobytes()


def encode_piece(suffix: np.ndarray, dtype: DType, parent: ArrayRef | None) -> Piece:
    """The row to store for `suffix` appended to `parent` (None: a root piece)."""
    return _encode_raw(suffix.tobytes(), len(suffix), dtype, parent)


def _encode_raw(
    raw: bytes, n: int, dtype: DType, parent: ArrayRef | None, prior: bytes | None = None
) -> Piece:
    parent_digest = parent.digest if parent is not None else None
    if prior and parent is not None and dtype in PRIOR_DTYPES and len(raw) >= PRIOR_MIN_BYTES:
        # Not compared with the plain encoding (a second compression per turn):
        # a dictionary only adds matches, and token ids packed unshuffled on
        # their prior beat them shuffled alone (16% smaller).
        codec, data = CODEC_ZSTD_PRIOR, _compress_on_prior(raw, prior)
    else:
        codec, data = _compress(raw, dtype)
    total = (parent.length if parent is not None else 0) + n
    digest = piece_digest(parent_digest, dtype, raw)
    basis = parent_digest if codec == CODEC_ZSTD_PRIOR else None
    return Piece(digest, parent_digest, dtype, total, codec, data, basis)


def prior_bytes(parent: ArrayRef, content: np.ndarray | bytes) -> bytes:
    """The dictionary of a `CODEC_ZSTD_PRIOR` piece after `parent`, from the parent's content.

    `content`: the parent array (or any tail of it at least `PRIOR_BYTES`
    long). Raises ValueError when it is too short to hold the dictionary:
    a wrong dictionary would make the piece undecodable.
    """
    view = memoryview(content).cast("B") if isinstance(content, np.ndarray) else memoryview(content)
    need = min(PRIOR_BYTES, parent.length * NUMPY_DTYPES[parent.dtype].itemsize)
    if len(view) < need:
        raise ValueError(f"prior= holds {len(view)} bytes; the parent's last {need} are needed")
    return bytes(view[len(view) - need :])


def _compress_on_prior(raw: bytes, prior: bytes) -> bytes:
    dictionary = zstandard.ZstdCompressionDict(prior, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    return zstandard.ZstdCompressor(
        level=_ZSTD_LEVEL, dict_data=dictionary, write_content_size=True, write_dict_id=False
    ).compress(raw)


def _compress(raw: bytes, dtype: DType) -> tuple[int, bytes]:
    """(codec, compressed bytes) of a suffix's raw bytes, as the module docstring says."""
    compress = _compressor().compress
    itemsize = NUMPY_DTYPES[dtype].itemsize
    if itemsize == 1:
        return CODEC_ZSTD, compress(raw)
    if dtype == "float64":
        with np.errstate(all="ignore"):  # a value beyond float32 is not exact: no warning
            narrow = np.frombuffer(raw, "<f8").astype("<f4")
        if narrow.astype("<f8").tobytes() == raw:  # every bit survives the round trip
            return CODEC_F32_SHUFFLED, compress(_shuffle(narrow.tobytes(), 4))
    shuffled = compress(_shuffle(raw, itemsize))
    if dtype != "int32" or len(raw) < RAW_INT32_MIN_BYTES:
        return CODEC_ZSTD_SHUFFLED, shuffled
    plain = compress(raw)  # a large int32 piece: whichever is smaller
    return (CODEC_ZSTD, plain) if len(plain) < len(shuffled) else (CODEC_ZSTD_SHUFFLED, shuffled)


class EncodedArray(msgspec.Struct, frozen=True):
    """An array ready to store: its ref and the piece(s) that hold it.

    Built without the database (`encode_array`), so a caller can name the ref
    in the events it appends and hand the pieces to that same append.
    `decoded` mirrors `pieces` as verified suffixes, for the store's piece
    cache. No pieces: the array is `extends` itself (an empty suffix).
    `cache=False`: its pieces are stored but not put in the piece cache (as
    `put_array(..., cache=False)`), for what nothing reads hot.
    """

    ref: ArrayRef
    pieces: tuple[Piece, ...] = ()
    decoded: tuple[DecodedPiece, ...] = ()
    cache: bool = True


def encode_array(
    array: np.ndarray,
    *,
    extends: ArrayRef | None = None,
    prior: np.ndarray | bytes | None = None,
) -> EncodedArray:
    """Encode a 1-D array (or, with `extends`, the suffix appended to that array).

    Pure: the same content gives the same ref as `put_array(array,
    extends=extends)` without a basis. Whether `extends` names a stored
    array is checked when the pieces are written. `prior`: the content of
    `extends` (or its tail, see `prior_bytes`), to compress the suffix
    against (`CODEC_ZSTD_PRIOR`); the caller vouches that it is that content.
    """
    suffix, dtype = as_suffix(array, extends.dtype if extends is not None else None)
    if extends is not None and len(suffix) == 0:
        return EncodedArray(extends)
    raw = suffix.tobytes()
    dictionary = None if prior is None or extends is None else prior_bytes(extends, prior)
    piece = _encode_raw(raw, len(suffix), dtype, extends, dictionary)
    # A view of the immutable bytes: read-only, and never aliases the caller's array.
    own = np.frombuffer(raw, NUMPY_DTYPES[dtype])
    decoded = DecodedPiece(piece.digest, piece.parent, dtype, piece.total_length, own)
    return EncodedArray(ArrayRef(piece.digest, piece.total_length, dtype), (piece,), (decoded,))


def encode_concat_piece(
    raw: bytes, dtype: DType, parent: ArrayRef | None, parts: Sequence[bytes]
) -> Piece:
    """The piece for `raw` appended to `parent`, stored as the list of the stored
    pieces (`parts`, by digest) whose suffixes joined are `raw`. One part is
    the same bytes after another parent (a turn's output ids, stored whole
    in its GenerateResult, and as its chain's tokens after its input).

    The caller proves that they are (`part_digest` of each part's parent and
    bytes equals the digest it names): a read that finds otherwise reports
    the piece as corrupt.
    """
    if not parts:
        raise ValueError("a concatenated piece joins one or more pieces")
    parent_digest = parent.digest if parent is not None else None
    n = len(raw) // NUMPY_DTYPES[dtype].itemsize
    total = (parent.length if parent is not None else 0) + n
    digest = piece_digest(parent_digest, dtype, raw)
    if digest in parts:
        raise ValueError("a concatenated piece cannot name itself as a part")
    return Piece(digest, parent_digest, dtype, total, CODEC_CONCAT, b"".join(parts), None, 1)


def encode_concat_array(
    raw: bytes, dtype: DType, parent: ArrayRef | None, parts: Sequence[bytes]
) -> EncodedArray:
    """`encode_concat_piece` as an `EncodedArray` (`raw` after `parent`), ready to append."""
    piece = encode_concat_piece(raw, dtype, parent, parts)
    own = np.frombuffer(raw, NUMPY_DTYPES[dtype])
    decoded = DecodedPiece(piece.digest, piece.parent, dtype, piece.total_length, own, 1)
    return EncodedArray(ArrayRef(piece.digest, piece.total_length, dtype), (piece,), (decoded,))


def concat_parts(piece: Piece) -> list[bytes]:
    """The digests a `CODEC_CONCAT` piece joins (none for any other codec)."""
    if piece.codec != CODEC_CONCAT:
        return []
    data = piece.data
    if not data or len(data) % DIGEST_SIZE:
        raise _corrupt(piece.digest, "lists parts that are not whole digests")
    return [data[i : i + DIGEST_SIZE] for i in range(0, len(data), DIGEST_SIZE)]


def needs_others(piece: Piece) -> bool:
    """Whether decoding `piece` needs other pieces decoded first (a basis or parts)."""
    return piece.basis is not None or piece.codec == CODEC_CONCAT


def piece_bases(piece: Piece) -> list[tuple[str, bytes]]:
    """What `piece` names besides itself: ("extends" | "basis" | "part", digest)."""
    named = [("extends", piece.parent), ("basis", piece.basis)]
    named += [("part", d) for d in concat_parts(piece)]
    return [(what, d) for what, d in named if d is not None]


def external_bases(pieces: Iterable[Piece]) -> set[bytes]:
    """Digests the pieces name (as parent, basis or part) but do not include themselves."""
    pieces = list(pieces)
    own = {p.digest for p in pieces}
    return {d for p in pieces for _, d in piece_bases(p) if d not in own}


def missing_bases(
    requests: Sequence[tuple[int, Sequence[Piece]]], present: set[bytes]
) -> dict[int, ArrayNotFound]:
    """Which requests name a parent or basis that neither the database nor the
    requests still being written hold.

    `present`: digests known to be stored. Iterates to a fixed point, since a
    request that fails takes its pieces away from the requests built on them.
    """
    errors: dict[int, ArrayNotFound] = {}
    while True:
        available = present | {p.digest for i, ps in requests if i not in errors for p in ps}
        found = {}
        for i, pieces in requests:
            if i in errors:
                continue
            for p in pieces:
                for what, d in piece_bases(p):
                    if d not in available:
                        found[i] = _unknown_base(what, d)
        if not found:
            return errors
        errors.update(found)


def _unknown_base(what: str, digest: bytes) -> ArrayNotFound:
    return ArrayNotFound(
        f"{what}= names array {digest.hex()}, which this database does not hold; pass a ref "
        "returned by this store (nothing of this put_array/append was written)"
    )


def basis_dictionary(basis_bytes: bytes) -> zstandard.ZstdCompressionDict:
    """A basis array's raw bytes as a zstd dictionary, ready to compress with.

    Preparing it costs about as much as compressing the basis once; reuse it
    for every piece compressed against the same basis.
    """
    dictionary = zstandard.ZstdCompressionDict(
        basis_bytes, dict_type=zstandard.DICT_TYPE_RAWCONTENT
    )
    dictionary.precompute_compress(level=_ZSTD_LEVEL)
    return dictionary


def encode_piece_on_basis(
    suffix: np.ndarray,
    dtype: DType,
    parent: ArrayRef | None,
    basis: ArrayRef,
    basis_bytes: bytes | zstandard.ZstdCompressionDict,
    basis_depth: int,
) -> Piece:
    """Like `encode_piece`, compressed with the basis array's raw bytes (or
    their `basis_dictionary`) as dictionary; the plain piece when that is not
    clearly smaller."""
    plain = encode_piece(suffix, dtype, parent)
    if not len(suffix) or not basis.length:
        return plain
    dictionary = (
        basis_bytes
        if isinstance(basis_bytes, zstandard.ZstdCompressionDict)
        else basis_dictionary(basis_bytes)
    )
    data = zstandard.ZstdCompressor(
        level=_ZSTD_LEVEL, dict_data=dictionary, write_content_size=True, write_dict_id=False
    ).compress(suffix.tobytes())
    if len(data) > BASIS_MAX_RATIO * len(plain.data):
        return plain
    return msgspec.structs.replace(
        plain, codec=CODEC_ZSTD_BASIS, data=data, basis=basis.digest, depth=basis_depth + 1
    )


def encode_copy_piece(
    raw: bytes,
    dtype: DType,
    parent: ArrayRef | None,
    basis: ArrayRef,
    basis_chain: Sequence[DecodedPiece],
    offset: int,
) -> Piece:
    """The piece for `raw` appended to `parent`, stored as a copy of the basis
    array's bytes at `offset` (`basis_chain`: the basis's verified pieces).

    Raises ValueError when those bytes are not `raw`: a copy piece must decode
    to exactly what it claims, and its digest is checked against `raw`.
    """
    if chain_range(basis_chain, offset, offset + len(raw)) != raw:
        raise ValueError(f"bytes [{offset}, {offset + len(raw)}) of the basis differ from the data")
    depth = chain_depth(list(basis_chain))
    return encode_copy_array(raw, dtype, parent, basis, depth, offset).pieces[0]


def encode_copy_array(
    raw: bytes | memoryview,
    dtype: DType,
    parent: ArrayRef | None,
    basis: ArrayRef,
    basis_depth: int,
    offset: int,
) -> EncodedArray:
    """`raw` appended to `parent`, as a copy of the basis array's bytes at `offset`,
    ready to append (not cached: `cache=False`).

    Pure, and the basis is not read: the caller vouches that those bytes are
    `raw` and that `basis_depth` is the basis chain's depth, because it has just
    encoded the basis from these very bytes (`recorder.server.deltas`: a body's
    stream, copied after the body's own first bytes). A false claim is caught
    by the first read, as a piece that does not match its digest.
    """
    parent_digest = parent.digest if parent is not None else None
    own = np.frombuffer(raw, NUMPY_DTYPES[dtype])
    total = (parent.length if parent is not None else 0) + len(own)
    range_ = _COPY_RANGE.pack(offset, len(raw))
    digest = piece_digest(parent_digest, dtype, raw)
    piece = Piece(
        digest, parent_digest, dtype, total, CODEC_COPY_BASIS, range_, basis.digest, basis_depth + 1
    )
    decoded = DecodedPiece(piece.digest, piece.parent, dtype, piece.total_length, own, piece.depth)
    ref = ArrayRef(piece.digest, piece.total_length, dtype)
    return EncodedArray(ref, (piece,), (decoded,), cache=False)


def chain_range(chain: Sequence[DecodedPiece], start: int, stop: int) -> bytes:
    """Bytes [start, stop) of the array `chain` holds, joining only the pieces they span."""
    out = []
    at = 0
    for piece in chain:
        data = piece.suffix
        end = at + data.nbytes
        if end > start and at < stop:
            view = memoryview(data).cast("B")
            out.append(view[max(start - at, 0) : min(stop, end) - at])
        if end >= stop:
            break
        at = end
    return b"".join(out)


def split_blob(data: bytes, chunk: int | None) -> tuple[bytes, bytes | None]:
    """(`data` column, `data_tail` column) for a piece's compressed bytes.

    The first part holds as many whole `chunk`-byte chunks as fit, the tail
    the rest; `chunk=None` keeps everything in the first part.
    """
    if chunk is None:
        return data, None
    cut = len(data) - len(data) % chunk
    return data[:cut], data[cut:] or None


def join_blob(data: bytes, tail: bytes | None) -> bytes:
    return data + tail if tail else data


_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    """This thread's compressor (no dictionary): building one costs ~4x compressing a
    turn's small piece, and an instance must not be used by two threads at once."""
    c: zstandard.ZstdCompressor | None = getattr(_local, "compressor", None)
    if c is None:
        c = _local.compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor: building one costs ~20x a small piece's decompression,
    and an instance must not be used by two threads at once."""
    d: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def decode_piece(piece: Piece, basis_bytes: bytes | None = None) -> DecodedPiece:
    """Decompress and verify one stored piece; raise `CorruptArray` on any mismatch.

    `basis_bytes`: the raw bytes of the array `piece.basis` names (verified),
    needed by basis-coded pieces only; for a concatenated piece, its parts'
    suffixes joined (`concat_parts`).
    """
    dt = NUMPY_DTYPES.get(piece.dtype)
    try:
        if dt is None:
            raise ValueError(f"unknown dtype {piece.dtype!r}")
        if piece.codec in (CODEC_ZSTD_BASIS, CODEC_COPY_BASIS, CODEC_ZSTD_PRIOR) and (
            piece.basis is None or basis_bytes is None
        ):
            raise ValueError("a basis-coded piece needs its basis array")
        if piece.codec == CODEC_CONCAT:
            if basis_bytes is None:
                raise ValueError("a concatenated piece needs its parts")
            body = basis_bytes
        elif piece.codec == CODEC_ZSTD_BASIS:
            body = _decompressor_for(basis_bytes).decompress(piece.data)  # type: ignore[arg-type]
        elif piece.codec == CODEC_ZSTD_PRIOR:
            if piece.basis != piece.parent:
                raise ValueError("a prior-coded piece is compressed against its parent")
            prior = basis_bytes[-PRIOR_BYTES:]  # type: ignore[index]
            body = _decompressor_for(prior).decompress(piece.data)
        elif piece.codec == CODEC_COPY_BASIS:
            body = _copied_range(piece.data, basis_bytes)  # type: ignore[arg-type]
        else:
            body = _decompressor().decompress(piece.data)
        if piece.codec == CODEC_ZSTD_SHUFFLED:
            if len(body) % dt.itemsize:
                raise ValueError("decompressed size is not a multiple of the item size")
            raw = _unshuffle(body, dt.itemsize)
        elif piece.codec == CODEC_F32_SHUFFLED:
            if piece.dtype != "float64" or len(body) % 4:
                raise ValueError("a float32-coded piece is float64 of whole float32s")
            raw = np.frombuffer(_unshuffle(body, 4), "<f4").astype("<f8").tobytes()
        elif piece.codec in (
            CODEC_ZSTD,
            CODEC_ZSTD_BASIS,
            CODEC_COPY_BASIS,
            CODEC_CONCAT,
            CODEC_ZSTD_PRIOR,
        ):
            raw = body
        else:
            raise ValueError(f"unknown codec {piece.codec}")
    except (zstandard.ZstdError, ValueError) as e:
        raise _corrupt(piece.digest, f"cannot be decoded ({e})") from None
    if piece_digest(piece.parent, piece.dtype, raw) != piece.digest:
        raise _corrupt(piece.digest, "does not match its digest")
    suffix = np.frombuffer(raw, dt)
    return DecodedPiece(
        piece.digest, piece.parent, piece.dtype, piece.total_length, suffix, piece.depth
    )


def decode_rows(rows: Iterable[Sequence[Any]]) -> list[DecodedPiece | Piece]:
    """Stored `arrays` rows (digest, parent, dtype, total_length, codec, data,
    data_tail, basis, basis_depth) as verified pieces, or as stored (`Piece`)
    when decoding needs other pieces first (`needs_others`: a basis or parts).

    One loop over a whole query's rows: a replay decodes every piece it
    reads (~240k for 2,000 sessions x 40 turns), and the per-row calls and
    lookups cost a fifth of the decoding. The shuffled codecs are decoded
    here; any other codec, and any piece that fails a check, goes through
    `decode_piece` (its result, its error).
    """
    decompress = _decompressor().decompress
    hasher = _HASHER.copy
    frombuffer = np.frombuffer
    u8 = np.uint8
    out: list[DecodedPiece | Piece] = []
    append = out.append
    for digest, parent, dtype, total, codec, data, tail, basis, depth in rows:
        digest = bytes(digest)
        parent = None if parent is None else bytes(parent)
        blob = bytes(data) + bytes(tail) if tail else bytes(data)
        if basis is not None or codec == CODEC_CONCAT:
            basis = None if basis is None else bytes(basis)
            append(Piece(digest, parent, dtype, total, codec, blob, basis, depth))
            continue
        dt = NUMPY_DTYPES.get(dtype)
        size = _PLAIN_SHUFFLED.get(codec)
        if dt is not None and size is not None:
            try:
                body = decompress(blob)
            except zstandard.ZstdError:
                body = b""
            size = size or dt.itemsize
            if body and not len(body) % size:
                raw = frombuffer(body, u8).reshape(size, -1).T.tobytes()
                if codec == CODEC_F32_SHUFFLED:
                    widen = dtype == "float64"
                    raw = frombuffer(raw, "<f4").astype("<f8").tobytes() if widen else b""
                h = hasher()
                h.update(parent or _NO_PARENT)
                h.update(_DTYPE_TAGS[dtype])
                h.update(raw)
                if raw and h.digest() == digest:
                    append(DecodedPiece(digest, parent, dtype, total, frombuffer(raw, dt), depth))
                    continue
        append(decode_piece(Piece(digest, parent, dtype, total, codec, blob, None, depth)))
    return out


# Codecs `decode_rows` decodes itself -> the shuffle's item size (0: the dtype's).
_PLAIN_SHUFFLED: Final = {CODEC_ZSTD_SHUFFLED: 0, CODEC_F32_SHUFFLED: 4}


def _copied_range(data: bytes, basis_bytes: bytes) -> bytes:
    """The basis bytes a copy piece names; ValueError when the range is not inside them."""
    if len(data) != _COPY_RANGE.size:
        raise ValueError("a copy piece's range is not 16 bytes")
    offset, n = _COPY_RANGE.unpack(data)
    if offset + n > len(basis_bytes):
        raise ValueError(f"range [{offset}, {offset + n}) is past the basis's {len(basis_bytes)}")
    return basis_bytes[offset : offset + n]


def _decompressor_for(basis_bytes: bytes) -> zstandard.ZstdDecompressor:
    dictionary = zstandard.ZstdCompressionDict(
        basis_bytes, dict_type=zstandard.DICT_TYPE_RAWCONTENT
    )
    return zstandard.ZstdDecompressor(dict_data=dictionary)


def _corrupt(digest: bytes, what: str) -> CorruptArray:
    return CorruptArray(
        f"stored array piece {digest.hex()} {what}: the database file or its backup is "
        "damaged. Restore it from a good copy (`recorder db copy --from GOOD --to NEW`); "
        "events referring to this array cannot be replayed until then"
    )


def missing_piece(digest: bytes) -> ArrayNotFound:
    return ArrayNotFound(
        f"array piece {digest.hex()} is not in this database: the ref comes from another "
        "database or the arrays table was truncated; read it from the store that wrote it"
    )


def chain_bytes(chain: list[DecodedPiece]) -> bytes:
    """The raw bytes of the array a root-first chain of pieces makes up."""
    return b"".join(p.suffix.tobytes() for p in chain)


def chain_depth(chain: list[DecodedPiece]) -> int:
    """Basis hops a cold read of the array `chain` makes up may take."""
    return max(p.depth for p in chain)


def assemble(ref: ArrayRef, chain: list[DecodedPiece]) -> np.ndarray:
    """Concatenate a root-first chain of pieces into the array `ref` names."""
    _check_ref(ref, chain[-1])
    if len(chain) == 1:
        return chain[-1].suffix.copy()
    return np.concatenate([p.suffix for p in chain])


def assemble_shared(
    refs: Sequence[ArrayRef], chain_of: Callable[[bytes], list[DecodedPiece]]
) -> list[np.ndarray]:
    """The arrays `refs` name, where one that is a prefix of another is a view of it.

    A session's engine inputs are each the previous one plus a few new
    tokens, stored as pieces extending it: 300 turns at 120k tokens would
    be 300 separate copies (36M tokens) if each were assembled alone, but are
    all prefixes of the last one. Assembling the longest first and handing
    every ref on its piece chain a slice of that buffer keeps one copy per
    chain. The views are read-only: one caller writing into them would change
    the others' arrays.
    """
    prefixes: dict[bytes, tuple[np.ndarray, DecodedPiece]] = {}
    assembled: dict[bytes, np.ndarray] = {}
    for ref in sorted({r.digest: r for r in refs}.values(), key=lambda r: -r.length):
        shared = prefixes.get(ref.digest)
        if shared is not None:
            buffer, piece = shared
            _check_ref(ref, piece)
            assembled[ref.digest] = buffer[: piece.total_length]
            continue
        chain = chain_of(ref.digest)
        whole = assemble(ref, chain)
        whole.flags.writeable = False
        assembled[ref.digest] = whole
        for piece in chain[:-1]:
            if piece.dtype == ref.dtype:
                prefixes.setdefault(piece.digest, (whole, piece))
    return [assembled[r.digest] for r in refs]


def _check_ref(ref: ArrayRef, last: DecodedPiece) -> None:
    if last.digest != ref.digest or last.total_length != ref.length or last.dtype != ref.dtype:
        raise CorruptArray(
            f"array {ref.digest.hex()}: stored piece says {last.total_length} x {last.dtype}, "
            f"the ref says {ref.length} x {ref.dtype}; the ref was not made by this store"
        )


def retained_nbytes(array: np.ndarray) -> int:
    """Bytes of the buffer that keeps `array`'s data alive.

    More than `array.nbytes` when `array` views part of a bigger buffer: a
    piece sliced out of `np.frombuffer(request_body)` keeps the whole body
    alive for as long as anything holds the piece.
    """
    owner: object = array
    while True:
        if isinstance(owner, np.ndarray):
            if owner.base is None:
                return owner.nbytes
            owner = owner.base
        elif isinstance(owner, memoryview):
            owner = owner.obj
        else:
            return memoryview(owner).nbytes  # type: ignore[arg-type]


def owned(array: np.ndarray) -> np.ndarray:
    """`array` if its buffer is exactly its own bytes, else a read-only copy that is."""
    if retained_nbytes(array) == array.nbytes:
        return array
    return np.frombuffer(array.tobytes(), array.dtype)


class PieceCache:
    """LRU of verified pieces, bounded by the memory they take (0 bytes: disabled).

    A piece is kept with a suffix that owns exactly its bytes (`owned`): a
    view of a bigger buffer (a slice of a request body) is copied out first,
    or the cache would keep whole bodies alive while counting only their
    pieces. Each entry is charged the suffix's buffer plus `ENTRY_OVERHEAD`
    for its Python objects (the struct, digests, numpy header, the buffer's
    header, the dict slot; ~370-430 bytes measured, less for a piece whose
    parent is cached: they share its digest): token pieces are a few
    hundred bytes, so counting only the data would let the real footprint
    reach about twice the bound.
    """

    ENTRY_OVERHEAD: Final = 400

    def __init__(self, max_bytes: int) -> None:
        self._items: OrderedDict[bytes, DecodedPiece] = OrderedDict()
        self._bytes = 0
        self._max = max_bytes

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        """Memory charged to the cached pieces (data + per-entry overhead)."""
        return self._bytes

    @property
    def max_bytes(self) -> int:
        return self._max

    def get(self, digest: bytes) -> DecodedPiece | None:
        p = self._items.get(digest)
        if p is not None:
            self._items.move_to_end(digest)
        return p

    def charge(self, piece: DecodedPiece) -> int:
        """Bytes an entry for `piece` is charged (its suffix's whole buffer + overhead)."""
        return retained_nbytes(piece.suffix) + self.ENTRY_OVERHEAD

    def chain_digests(self, digest: bytes) -> set[bytes]:
        """Digests of the cached pieces of the array `digest` names, from its
        last piece back to the first one not cached."""
        out: set[bytes] = set()
        d: bytes | None = digest
        while d is not None and (piece := self._items.get(d)) is not None:
            out.add(d)
            d = piece.parent
        return out

    def discard(self, digests: Iterable[bytes]) -> None:
        """Drop these pieces if cached (they stay stored; a later read fetches them)."""
        for digest in digests:
            old = self._items.pop(digest, None)
            if old is not None:
                self._bytes -= self.charge(old)

    def put(self, piece: DecodedPiece) -> None:
        if self._max <= 0:
            return
        if piece.digest in self._items:
            self._items.move_to_end(piece.digest)
            return
        suffix = owned(piece.suffix)
        if suffix is not piece.suffix:
            piece = msgspec.structs.replace(piece, suffix=suffix)
        self._items[piece.digest] = piece
        self._bytes += self.charge(piece)
        while self._bytes > self._max and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self._bytes -= self.charge(old)
