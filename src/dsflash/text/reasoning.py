"""Split generated text into reasoning and content at `</think>`."""

from __future__ import annotations

from typing import Literal, NamedTuple

from dsflash.text.stops import find_earliest, partial_suffix_len
from dsflash.text.tokenizer import THINK_CLOSE, THINK_OPEN
from dsflash.text.tools import BLOCK_OPENERS

REASONING: Literal["reasoning"] = "reasoning"
CONTENT: Literal["content"] = "content"

# A tool-call block ends the reasoning even when the model forgot `</think>`: DeepSeek's format never puts calls
# inside reasoning, and treating them as reasoning hides the call from the client (a known failure of other servers).
_ENDS = (THINK_CLOSE, *("\n\n" + o for o in BLOCK_OPENERS), *BLOCK_OPENERS)


class Segment(NamedTuple):
    """A run of text of one kind."""

    kind: Literal["reasoning", "content"]
    text: str


class ReasoningParser:
    """feed(text) -> [Segment]; with thinking on, the prompt opened `<think>`, so the output starts as reasoning."""

    def __init__(self, thinking: bool = True):
        self.thinking = thinking
        self._state = "start" if thinking else CONTENT
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        """True until the reasoning has ended."""
        return self._state != CONTENT

    def feed(self, text: str) -> list[Segment]:
        """Consume a chunk; return the segments that are now certain."""
        if self._state == CONTENT:
            return [Segment(CONTENT, text)] if text else []
        self._buf += text
        out: list[Segment] = []
        if self._state == "start" and not self._skip_echoed_open():
            return out
        hit = find_earliest(self._buf, _ENDS)
        if hit is None:
            keep = partial_suffix_len(self._buf, _ENDS)
            _add(out, REASONING, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return out
        pos, end = hit
        _add(out, REASONING, self._buf[:pos])
        # `</think>` is dropped; a tool-call opener (with its blank line) belongs to the content
        _add(out, CONTENT, self._buf[pos + len(end) :] if end == THINK_CLOSE else self._buf[pos:])
        self._state, self._buf = CONTENT, ""
        return out

    def finish(self) -> list[Segment]:
        """End of stream: whatever is held is reasoning (the model never closed it)."""
        out: list[Segment] = []
        _add(out, REASONING if self._state != CONTENT else CONTENT, self._buf)
        self._buf = ""
        return out

    def _skip_echoed_open(self) -> bool:
        """Drop a `<think>` the model wrote itself at the start; False while that is still undecided."""
        head = self._buf.lstrip()
        if head.startswith(THINK_OPEN):
            self._buf = head[len(THINK_OPEN) :]
        elif THINK_OPEN.startswith(head):
            return False
        self._state = REASONING
        return True


def _add(out: list[Segment], kind, text: str) -> None:
    if text:
        out.append(Segment(kind, text))


def split_reasoning(text: str, thinking: bool = True) -> tuple[str, str]:
    """(reasoning, content) of a whole completion."""
    parser = ReasoningParser(thinking)
    parts = parser.feed(text) + parser.finish()
    return (
        "".join(s.text for s in parts if s.kind == REASONING),
        "".join(s.text for s in parts if s.kind == CONTENT),
    )
