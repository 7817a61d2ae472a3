"""Event payloads compressed against a fixed dictionary of recurring words (no I/O).

An event payload is a short msgpack array (~50-500 bytes) whose bytes are
largely the same words turn after turn: SGLang's sampling parameter names,
Anthropic's usage keys and content block shapes, stop reasons, dialect names,
a state snapshot's field names. zstd alone cannot shrink ~300 bytes; against
a raw-content dictionary holding those words a generate attempt loses ~60%, a
response ~35%, a snapshot ~15% (`tools/bench_training.py`: event payloads
-28%). The words come from the wire protocols and our own schema, never from
a session's content.

A packed payload is `PACKED`, the dictionary's version, then a magicless zstd
frame. `PACKED` is 0xC1, the one byte msgpack never uses, so a payload that
starts with anything else is plain msgpack (every payload written before, and
any payload packing would not make smaller).

A version's dictionary never changes once rows may hold it: `DICTIONARIES`
maps each version to its bytes, checked at import against a pinned digest. A
better dictionary is a new version; old ones stay readable.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Final

import msgspec
import zstandard

PACKED: Final = 0xC1
VERSION: Final = 1
# Shorter payloads are not worth a compression attempt (~4 us each): a turn's
# generate attempt, response and state snapshot are longer and lose the most;
# its request, chain decision, rendered input and verdict are mostly ids and
# digests (the request loses 4%).
MIN_PACK_BYTES: Final = 200
_LEVEL: Final = 1  # level 3 packs these payloads 1% smaller, ~25% slower

# Version 1: what the bytes are built from. Frozen (see the module docstring).
_WORDS_V1: Final = (
    {
        "max_new_tokens": 4096,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
        "stop_token_ids": [2],
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
    },
    {
        "input_tokens": 1000,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 100,
    },
    [
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "toolu_", "name": "", "input": {}},
        {"type": "thinking", "thinking": "", "signature": ""},
    ],
    [
        "tool_use", "end_turn", "max_tokens", "stop_sequence", "stop", "length", "abort",
        "/v1/messages", "/v1/chat/completions", "/v1/responses", "anthropic", "openai_chat",
        "openai_responses", "extend", "new", "first", "extends", "compaction", "subagent",
        "diverged", "side", "msg_", "chatcmpl-", "resp_", "http://", "sglang", "builtin",
        "tool=", "reasoning=", "int32", "float64", "uint8", "float32", "live-1",
    ],
    {
        "seq": 0, "attempt": 0, "opened_ts": 0.0, "metadata": {}, "engine_url": "",
        "overrides": {}, "next_turn": 0, "turns_completed": 0, "chains": [],
        "main_chain_id": 0, "pending_dispatches": [], "next_chain_id": 1, "clock": 0,
        "max_chains": 32,
    },
)  # fmt: skip
_DIGESTS: Final = {1: "f394852331b26112d2a5a65159b13ee5"}


def _build(words: tuple[object, ...]) -> bytes:
    return b"".join(msgspec.msgpack.encode(w) for w in words)


def _checked(version: int, data: bytes) -> bytes:
    digest = hashlib.blake2b(data, digest_size=16).hexdigest()
    if digest != _DIGESTS[version]:
        raise AssertionError(
            f"event payload dictionary v{version} changed (digest {digest}): stored payloads "
            "depend on its exact bytes; restore it and add a new version instead"
        )
    return data


DICTIONARIES: Final[dict[int, bytes]] = {1: _checked(1, _build(_WORDS_V1))}

_local = threading.local()


class UnknownDictionary(ValueError):
    """A payload packed with a dictionary version this code does not have."""


def _compressor() -> zstandard.ZstdCompressor:
    """The compressor for `VERSION`; use it under `_compress_lock` (not thread-safe)."""
    params = zstandard.ZstdCompressionParameters.from_level(
        _LEVEL,
        # Tables sized for a dictionary and a payload of a few kB: ~50 kB of
        # context instead of level 3's 1.3 MB, and quicker to reset.
        window_log=12,
        hash_log=10,
        chain_log=10,
        format=zstandard.FORMAT_ZSTD1_MAGICLESS,
        write_content_size=1,
        write_checksum=0,
        write_dict_id=0,
    )
    dictionary = _dictionary(VERSION)
    dictionary.precompute_compress(compression_params=params)
    return zstandard.ZstdCompressor(dict_data=dictionary, compression_params=params)


def _decompressor(version: int) -> zstandard.ZstdDecompressor:
    cache: dict[int, zstandard.ZstdDecompressor] | None = getattr(_local, "decompressors", None)
    if cache is None:
        cache = _local.decompressors = {}
    d = cache.get(version)
    if d is None:
        d = cache[version] = zstandard.ZstdDecompressor(
            dict_data=_dictionary(version), format=zstandard.FORMAT_ZSTD1_MAGICLESS
        )
    return d


def _dictionary(version: int) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(
        DICTIONARIES[version], dict_type=zstandard.DICT_TYPE_RAWCONTENT
    )


# One compressor for every thread, built at import: a request's memory and time
# never include building one (events are encoded on the loop and on writer
# threads), and a compression (~4 us) holds the lock only that long.
_COMPRESSOR: Final = _compressor()
# zstd sizes its buffers on first use (~64 kB): a window's worth now, not in a request.
_COMPRESSOR.compress(bytes(1 << 13))
_compress_lock = threading.Lock()


def pack(payload: bytes) -> bytes:
    """`payload` packed, or unchanged when packing would not make it smaller."""
    if len(payload) < MIN_PACK_BYTES:
        return payload
    with _compress_lock:
        frame = _COMPRESSOR.compress(payload)
    packed = bytes((PACKED, VERSION)) + frame
    return packed if len(packed) < len(payload) else payload


def unpack(payload: bytes) -> bytes:
    """The msgpack bytes of a stored payload, packed or not.

    Raises `UnknownDictionary` for a newer dictionary version and
    `msgspec.DecodeError` for damaged bytes (as damaged msgpack would).
    """
    if not payload or payload[0] != PACKED:
        return payload
    version = payload[1] if len(payload) > 1 else 0
    if version not in DICTIONARIES:
        raise UnknownDictionary(
            f"an event payload packed with dictionary v{version}, which this code does not "
            "know; upgrade trajectory-recorder to read this log"
        )
    try:
        return _decompressor(version).decompress(payload[2:])
    except zstandard.ZstdError as exc:
        raise msgspec.DecodeError(f"a packed event payload is damaged ({exc})") from None
