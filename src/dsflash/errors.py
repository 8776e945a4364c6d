"""Exception types shared by every layer. The CLI prints them as one line; the server maps them to HTTP."""


class DsflashError(Exception):
    """Base of every error we raise on purpose; its message is the whole story for the user."""


class ConfigError(DsflashError):
    """A config.json we cannot run: unknown keys, wrong types, inconsistent schedule."""


class CheckpointError(DsflashError):
    """A checkpoint that does not match its config: missing, extra or mis-shaped tensors, bad shards."""


class ModelSourceError(DsflashError):
    """A model name, repo id or directory that cannot be resolved to files on disk."""


class UnsupportedInput(DsflashError):
    """Input the model cannot take (image tokens without a vision tower, token ids out of range)."""


class InvalidRequest(DsflashError):
    """A request parameter with a wrong type or value; `param` names it for the OpenAI envelope."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextTooLong(InvalidRequest):
    """Prompt plus requested tokens exceed the context length."""


class Overloaded(DsflashError):
    """The request queue is full; the client should retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class NotReady(DsflashError):
    """The engine is still loading."""


class OutOfMemory(DsflashError):
    """One request needed more memory than the host (or GPU) had; it failed alone and the engine goes on."""


class EngineDead(DsflashError):
    """A rank or the engine thread died; the engine cannot serve any more requests."""


class StoreCorrupt(DsflashError):
    """The packed expert store fails verification (checksum, manifest or size)."""


class StoreMismatch(DsflashError):
    """The packed expert store was built for another model, revision, TP degree or format version."""


class NoSpace(DsflashError):
    """Not enough free disk for what must be written (checked before writing any of it)."""
