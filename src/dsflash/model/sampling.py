"""The sampling filters (temperature, then top_k, min_p relative to the most likely, top_p: vLLM's order) as one
definition: the sampler draws from what they keep, and speculative decoding's draft q and target p are the same
distribution, so accepting with min(1, p/q) keeps exactly what plain decoding samples."""

from __future__ import annotations

import numpy as np
import torch


def filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """(token ids, their unnormalised probabilities, the largest 1) of logits [V] after the filters, over the tokens
    still possible only (a constraint's mask leaves few), sorting only what top_p can keep: torch's sort over the
    whole vocabulary costs more than a small model's decode step (docs/performance.md). ids is None when no filter
    applies (every token, probabilities in id order)."""
    x = logits.float().contiguous().cpu().numpy() / np.float32(temperature)
    top = x.max()
    if not np.isfinite(top):  # NaN logits, or every token masked: a failed request, never an arbitrary token
        raise ValueError(f"no token can be drawn: the largest logit is {top}")
    e = np.exp(x - top)  # what is masked is 0
    if top_k == 0 and min_p == 0 and top_p == 1:
        return None, e
    ids = np.flatnonzero(e)  # partitions are slow on ties: the filters select among the possible tokens only
    v = e[ids]
    if 0 < top_k < v.shape[0]:
        keep = v >= np.partition(v, v.shape[0] - top_k)[v.shape[0] - top_k]
        ids, v = ids[keep], v[keep]
    if min_p > 0:
        keep = v >= min_p
        ids, v = ids[keep], v[keep]
    if top_p < 1:
        keep = _nucleus(v, top_p)
        ids, v = ids[keep], v[keep]
    return ids, v


def probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """float64 probabilities [V] of what filtered() keeps (0 elsewhere)."""
    ids, v = filtered(logits, temperature, top_k, top_p, min_p)
    p = v.astype(np.float64)
    if ids is not None:
        p = np.zeros(logits.shape[-1], dtype=np.float64)
        p[ids] = v
    return torch.from_numpy(p / p.sum())


def _nucleus(v: np.ndarray, top_p: float, first: int = 1024) -> np.ndarray:
    """Indices of the smallest most-likely set of v whose mass reaches top_p of the whole (the most likely always
    stays): sorted among the `first` largest, then 8x as many, until the set fits."""
    need, n, k = top_p * float(v.sum(dtype=np.float64)), v.shape[0], first
    while k < n:
        part = np.argpartition(v, n - k)[n - k :]
        if float(v[part].sum(dtype=np.float64)) >= need:
            break
        k *= 8
    else:
        part = np.arange(n)
    order = part[np.argsort(-v[part])]
    before = np.cumsum(v[order], dtype=np.float64) - v[order]
    keep = order[before < need]
    return keep if keep.shape[0] else order[:1]  # a top_p below the float's resolution: the most likely alone
