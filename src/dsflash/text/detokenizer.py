"""Incremental decode of a token stream: per-token text deltas that never split a UTF-8 character."""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from dataclasses import dataclass

from dsflash.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Piece:
    """What one token released: `text` starts at character `offset` of the decoded output.

    `text` may be empty (the token ends mid-character, or is a skipped special) or may carry bytes of earlier tokens
    that completed a character now. `token_bytes` are the token's own bytes (OpenAI logprobs `bytes`).
    """

    token_id: int
    text: str
    offset: int
    token_bytes: bytes


class Detokenizer:
    """feed(token_id) -> Piece; joining every Piece.text and finish() gives the tokenizer's decode of the ids."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        # specials such as BOS/EOS vanish, but markup the parsers need (<think>, </think>, ｜DSML｜) always shows
        self._skip = tokenizer.special_ids - tokenizer.markup_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []
        self._length = 0

    def feed(self, token_id: int) -> Piece:
        """Decode one more token."""
        raw = self.tokenizer.token_bytes(token_id)
        text = "" if token_id in self._skip else self._utf8.decode(raw)
        return self._emit(token_id, text, raw)

    def feed_many(self, token_ids: Iterable[int]) -> list[Piece]:
        """Decode several tokens, one Piece each."""
        return [self.feed(t) for t in token_ids]

    def finish(self) -> str:
        """End of stream: bytes of a character that never completed become U+FFFD."""
        tail = self._utf8.decode(b"", final=True)
        self._parts.append(tail)
        self._length += len(tail)
        return tail

    @property
    def text(self) -> str:
        """All text released so far."""
        return "".join(self._parts)

    @property
    def pending_bytes(self) -> bytes:
        """Bytes of an unfinished character held back."""
        return self._utf8.getstate()[0]

    def _emit(self, token_id: int, text: str, raw: bytes) -> Piece:
        piece = Piece(token_id, text, self._length, raw)
        if text:
            self._parts.append(text)
            self._length += len(text)
        return piece


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A token shown on its own (logprobs `token`): its text, or `bytes:\\xNN..` when it is not whole UTF-8."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
