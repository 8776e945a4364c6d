"""Agreement between reference and candidate logits: decisive top-1, KL(p_ref || p), |delta logit|."""

from __future__ import annotations

import numpy as np

DECISIVE_MARGIN = 0.10


def top1_margin(logits: np.ndarray) -> np.ndarray:
    """Gap between the best and second-best logit per row. [n, V] -> [n]"""
    top2 = np.partition(logits, -2, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare_logits(ref: np.ndarray, got: np.ndarray, margin: float = DECISIVE_MARGIN) -> dict:
    """ref, got [n, V]. A position is decisive when the reference's top-1 margin is >= `margin`."""
    if ref.shape != got.shape:
        raise ValueError(f"logit shapes differ: {ref.shape} vs {got.shape}")
    n = ref.shape[0]
    if n == 0:
        return {"n": 0, "n_decisive": 0, "decisive_top1": 1.0, "mean_kl": 0.0, "mean_abs": 0.0, "max_abs": 0.0}
    decisive = top1_margin(ref) >= margin
    agree = ref.argmax(-1) == got.argmax(-1)
    lp, lq = log_softmax(ref), log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    diff = np.abs(ref.astype(np.float64) - got)
    return {
        "n": int(n),
        "n_decisive": int(decisive.sum()),
        "decisive_top1": float(agree[decisive].mean()) if decisive.any() else 1.0,
        "mean_kl": float(kl.mean()),
        "mean_abs": float(diff.mean()),
        "max_abs": float(diff.max()),
    }


def next_token_loss(logits: np.ndarray, ids: list[int]) -> float:
    """Mean -log p(ids[i + 1]) over the rows of a prefill's logits [len(ids), V] (the last row predicts nothing)."""
    lp = log_softmax(logits[:-1])
    return float(-lp[np.arange(len(lp)), np.asarray(ids[1 : len(lp) + 1])].mean())


def within_golden_tolerance(report: dict, tol: dict) -> bool:
    """The fixtures' rule: argmax equal at every decisive position, mean and max |delta| bounded."""
    return (
        report["decisive_top1"] == 1.0 and report["mean_abs"] <= tol["mean_abs"] and report["max_abs"] <= tol["max_abs"]
    )
