"""The gate suite: what text is scored, how many tokens, and the thresholds (the reference box's results)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

# the QuietBox 2 engine's published numbers against DeepSeek's CPU reference (docs: seed.md)
PREFILL_MIN_TOP1, PREFILL_MAX_KL = 0.98, 0.035
DECODE_MIN_TOP1, DECODE_MAX_KL = 0.985, 0.030
DEFAULT_TOKENS = 768  # 512 prefill + 256 teacher-forced decode steps


@dataclass(frozen=True)
class Thresholds:
    prefill_top1: float = PREFILL_MIN_TOP1
    prefill_kl: float = PREFILL_MAX_KL
    decode_top1: float = DECODE_MIN_TOP1
    decode_kl: float = DECODE_MAX_KL

    def failures(self, report: dict) -> list[str]:
        out = []
        for part, top1, kl in (("prefill", self.prefill_top1, self.prefill_kl),
                               ("decode", self.decode_top1, self.decode_kl)):  # fmt: skip
            r = report[part]
            if r["decisive_top1"] < top1:
                out.append(f"{part} decisive top-1 {r['decisive_top1']:.4f} < {top1}")
            if r["mean_kl"] > kl:
                out.append(f"{part} mean KL {r['mean_kl']:.4f} > {kl}")
        return out


def mixed_text() -> str:
    """Prose, code, tables and numbers: the text every gate run scores."""
    return (resources.files("dsflash") / "data" / "gates" / "mixed.txt").read_text(encoding="utf-8")


def split(total: int) -> tuple[int, int]:
    """(prefill, decode) tokens for a budget: 2:1 like 512 + 256."""
    if total < 3:
        raise ValueError("the gates need at least 3 tokens")
    prefill = max(1, round(total * 2 / 3))
    return prefill, total - prefill


def gate_tokens(encode, bos: int | None, total: int, text: str | None = None) -> list[int]:
    """BOS + the text (default: the mixed text), repeated as needed, cut to `total` tokens."""
    text = mixed_text() if text is None else text
    body = encode(text)
    if not body:  # the repetition below would never end
        raise ValueError("the gate text encodes to no tokens")
    ids = ([bos] if bos is not None else []) + body
    while len(ids) < total:
        ids += encode("\n\n" + text)
    return ids[:total]
