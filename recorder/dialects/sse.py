"""Server-sent events on the wire: a frame is (event name, data), encoded as SSE text.

Every dialect answers a stream as a list of frames (`Dialect.frames`);
`recorder.dialects.sse` writes them to the client.
"""

from __future__ import annotations

from typing import Any

import msgspec

_encoder = msgspec.json.Encoder()


SseFrame = tuple[str | None, Any]
"""(event name, data): no name writes a `data:` line only (OpenAI); bytes data goes as is."""


def encode_sse(event: str | None, data: Any) -> bytes:
    payload = data if isinstance(data, bytes) else _encoder.encode(data)
    head = b"" if event is None else b"event: " + event.encode() + b"\n"
    return head + b"data: " + payload + b"\n\n"
