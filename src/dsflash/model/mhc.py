"""Manifold-constrained hyper-connections: hc residual streams mixed by pre / post / comb (arch §4.3, §5.2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mixes(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    iters: int,
    eps: float,
    hc_eps: float,
    normalize=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [b, s, hc, d], fn [(2+hc)hc, hc*d] -> pre [b, s, hc], post [b, s, hc], comb [b, s, hc(src), hc(dst)].
    normalize: the Sinkhorn implementation (default `sinkhorn`; a runtime may pass a fused kernel of the same math)."""
    hc = x.shape[2]
    flat = x.flatten(2).float()
    # one RMS statistic per token over all hc*d values, applied after the projection
    m = F.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    return pre, post, (normalize or sinkhorn)(comb, iters, hc_eps)


def sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Softmax over the last axis (+eps), then alternate column / row normalisation to ~doubly stochastic."""
    c = torch.exp(c - c.amax(dim=-1, keepdim=True))
    c = c / c.sum(dim=-1, keepdim=True) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def collapse(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of the streams. x [b, s, hc, d], weights [b, s, hc] -> [b, s, d]"""
    return torch.sum(weights.unsqueeze(-1) * x.float(), dim=2).to(x.dtype)


def expand(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k f + sum_j comb[j, k] X_j. f [b, s, d], residual [b, s, hc, d] -> [b, s, hc, d]"""
    mixed = torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=2)
    return (post.unsqueeze(-1) * f.unsqueeze(-2) + mixed).type_as(f)


def identity_pre(x: torch.Tensor) -> torch.Tensor:
    """The first block's collapse weights: one-hot on stream 0 (all streams are equal there)."""
    pre = x.new_zeros(*x.shape[:3], dtype=torch.float32)
    pre[..., 0] = 1.0
    return pre
