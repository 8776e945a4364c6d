"""Where routed experts live, behind one small interface (STYLE: ExpertBackend)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class ExpertBackend(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Routed sum for one MoE layer. x [t, d], ids / weights [t, k] -> fp32 [t, d] (this rank's partial)."""
        ...


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate) * up in fp32 with DeepSeek's clamp: up on both sides, gate from above only."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up


def expert_ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """One SwiGLU expert; the routing weight scales the activation before w2. x [t, d] -> fp32 [t, d]"""
    xw = x.to(w1.dtype)
    h = swiglu(F.linear(xw, w1), F.linear(xw, w3), limit)
    if weight is not None:
        h = weight * h
    return F.linear(h.to(w2.dtype), w2).float()


class ResidentExperts:
    """Every expert in process memory, dequantized: the reference back end.

    weights[(layer, expert)] = (w1 [inter, d], w3 [inter, d], w2 [d, inter]).
    """

    def __init__(
        self, weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]], swiglu_limit: float
    ):
        self.weights = weights
        self.limit = swiglu_limit

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():  # ascending, as DeepSeek accumulates
            tok, slot = torch.where(ids == e)
            w1, w3, w2 = self.weights[(layer, e)]
            y[tok] += expert_ffn(x[tok], w1, w3, w2, self.limit, weights[tok, slot, None])
        return y
