"""Stop strings over streamed text: hold back what may start a stop string, cut before a match."""

from __future__ import annotations

from collections.abc import Iterable


def partial_suffix_len(text: str, candidates: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some candidate (it may still grow into one)."""
    best = 0
    for cand in candidates:
        # only suffixes longer than the best so far can win; a full candidate is a match, not a partial
        for k in range(min(len(text), len(cand) - 1), best, -1):
            if cand.startswith(text[-k:]):
                best = k
                break
    return best


def find_earliest(text: str, candidates: Iterable[str], start: int = 0) -> tuple[int, str] | None:
    """(position, candidate) of the leftmost occurrence in `text[start:]`; the longer candidate wins a tie."""
    found = None
    for cand in candidates:
        pos = text.find(cand, start)
        if pos >= 0 and (found is None or pos < found[0] or (pos == found[0] and len(cand) > len(found[1]))):
            found = (pos, cand)
    return found


class StopMatcher:
    """feed(text) -> text safe to emit; after a match `stopped` is set and later text is dropped."""

    def __init__(self, stops: Iterable[str] = (), include_stop_str_in_output: bool = False):
        self.stops = tuple(dict.fromkeys(s for s in stops if s))  # empty strings would match everywhere
        self.include = include_stop_str_in_output
        self.stopped = False
        self.matched: str | None = None
        self._held = ""

    def feed(self, text: str) -> str:
        """Release the text that can no longer be part of a stop string."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        hit = find_earliest(buf, self.stops)
        if hit is not None:
            pos, stop = hit
            self.stopped, self.matched, self._held = True, stop, ""
            return buf[: pos + len(stop)] if self.include else buf[:pos]
        keep = partial_suffix_len(buf, self.stops)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def finish(self) -> str:
        """End of stream: held text was not a stop string after all."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    @property
    def held(self) -> str:
        """Text withheld so far (a possible start of a stop string)."""
        return self._held
