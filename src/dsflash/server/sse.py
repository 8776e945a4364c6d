"""Server-sent events as OpenAI clients read them: `data: <json>\n\n`, comment pings, `data: [DONE]`."""

from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"  # a comment line; clients skip it, proxies see traffic during a long prefill
HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def dumps(obj) -> bytes:
    """Compact JSON; NaN and infinities are a bug upstream, not something to put on the wire."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def frame(obj) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def raw_frame(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"
