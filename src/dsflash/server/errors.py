"""Exception -> (HTTP status, OpenAI error envelope, headers): the one table. Nothing else knows status codes."""

from __future__ import annotations

import json

from dsflash.errors import (
    ContextTooLong,
    DsflashError,
    EngineDead,
    InvalidRequest,
    ModelSourceError,
    NotReady,
    OutOfMemory,
    Overloaded,
    UnsupportedInput,
)


class HttpError(DsflashError):
    """Errors that only exist at the HTTP edge (routing, auth, body size); `kind` picks the row below."""

    def __init__(self, kind: str, message: str, allow: str | None = None):
        super().__init__(message)
        self.kind, self.allow = kind, allow


# kind / exception type -> (status, OpenAI type, code)
_HTTP = {
    "not_found": (404, "invalid_request_error", None),
    "method": (405, "invalid_request_error", "method_not_allowed"),
    "unauthorized": (401, "invalid_request_error", "invalid_api_key"),
    "too_large": (413, "invalid_request_error", "request_too_large"),
    "bad_json": (400, "invalid_request_error", "invalid_json"),
}
_TABLE: list[tuple[type[BaseException], tuple[int, str, str | None]]] = [
    (ContextTooLong, (400, "invalid_request_error", "context_length_exceeded")),
    (InvalidRequest, (400, "invalid_request_error", None)),
    (UnsupportedInput, (400, "invalid_request_error", "unsupported_input")),
    (ModelSourceError, (404, "invalid_request_error", "model_not_found")),  # a model this server does not serve
    (Overloaded, (429, "rate_limit_error", "queue_full")),
    (NotReady, (503, "unavailable_error", "not_ready")),
    (OutOfMemory, (503, "server_error", "out_of_memory")),  # that request alone: the server goes on
    (EngineDead, (503, "server_error", "engine_dead")),
]
INTERNAL = (500, "server_error", None)


def classify(exc: BaseException) -> tuple[int, dict, list[tuple[str, str]]]:
    """(status, {"error": {...}}, extra headers) of an exception; anything unexpected is a 500 without details."""
    if isinstance(exc, HttpError):
        status, kind, code = _HTTP[exc.kind]
    else:
        status, kind, code = next((row for cls, row in _TABLE if isinstance(exc, cls)), INTERNAL)
    message = str(exc) if status != 500 else "internal server error (see the server log)"
    param = getattr(exc, "param", None)
    headers = []
    if isinstance(exc, Overloaded):
        headers.append(("retry-after", str(max(1, int(exc.retry_after)))))
    if isinstance(exc, HttpError) and exc.allow:
        headers.append(("allow", exc.allow))
    return status, envelope(message, kind, param, code), headers


def envelope(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_frame(exc: BaseException) -> bytes:
    """The SSE data of an error after the stream has started (status 200 is already sent)."""
    _, body, _ = classify(exc)
    return json.dumps(body, ensure_ascii=False).encode()
