"""Linear layers (plain and tensor-parallel), RMSNorm and rotary embeddings with YaRN (arch §4.4)."""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dsflash.model.parallel import TP


def _param(*shape: int, dtype: torch.dtype = torch.float32, shard: dict | None = None) -> nn.Parameter:
    """An empty parameter for the loader to fill (empty() costs nothing until written).

    shard {dim: indices}: which entries of the checkpoint tensor this rank holds along each split dim (-1 = zero
    padding); the loader applies it, so the model alone decides how it is split.
    """
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.shard = shard or {}
    return p


class PackedWeight(Protocol):
    """A weight kept in a device format (FP8 blocks, bf16, ...) with its own matmul kernel."""

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> fp32 [..., out]"""
        ...

    def rows(self, start: int, stop: int) -> PackedWeight:
        """The output rows [start, stop) as a weight of their own (a view)."""
        ...


class Linear(nn.Module):
    """y = x W^T with W [out, in] (dequantized at load). A runtime may pack W for its device (`packed`)."""

    packed: PackedWeight | None = None

    def __init__(self, in_features: int, out_features: int, shard: dict | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, in_features, shard=shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The wider of x's and W's dtype: a bf16 weight rounds the matmul input, not the fp32 activations after it."""
        if self.packed is not None:
            return self.packed.linear(x)
        w = self.weight
        return F.linear(x.to(w.dtype), w).to(torch.promote_types(x.dtype, w.dtype))

    def grouped(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        """Block-diagonal use of W viewed as [groups, out/groups, in]: x [..., groups, in] -> [..., groups, out/g]."""
        per = self.out_features // groups
        if self.packed is not None:
            fused = getattr(self.packed, "grouped", None)  # all groups in one call, where the format has it
            y = fused(x, groups) if fused is not None else None
            if y is not None:
                return y
            parts = [self.packed.rows(g * per, (g + 1) * per).linear(x[..., g, :]) for g in range(groups)]
            return torch.stack(parts, dim=-2)
        w = self.weight.view(groups, per, -1)
        return torch.einsum("...gd,grd->...gr", x.to(w.dtype), w).to(torch.promote_types(x.dtype, w.dtype))


class ColumnParallelLinear(Linear):
    """Output features split over ranks (padded when uneven); each rank's output slice is complete."""

    def __init__(self, in_features: int, out_features: int, tp: TP):
        super().__init__(in_features, tp.part(out_features), shard={0: tp.indices(out_features)})


class RowParallelLinear(Linear):
    """Input features split over ranks; the partial sums are all-reduced (unless the caller folds the reduction
    into a later one: reduce=False). `cols` overrides the even split."""

    def __init__(
        self, in_features: int, out_features: int, tp: TP, cols: torch.Tensor | None = None, reduce: bool = True
    ):
        cols = tp.indices(in_features) if cols is None else cols
        super().__init__(cols.numel(), out_features, shard={1: cols})
        self.tp, self.reduce = tp, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.tp.all_reduce(y) if self.reduce else y


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)
        self.fused = None  # a runtime's kernel of the same math: (x, weight, eps) -> y, or None where it does not apply

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fused(x, self.weight, self.eps) if self.fused is not None else None
        if y is not None:
            return y
        # fp32 statistics always: V4.1's eps is 1e-20, which only fp32 can see
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / RMS over the last dim, fp32, keepdim."""
    return torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)


class Rope:
    """Interleaved rotary embedding on the last `dim` channels; YaRN when original_len > 0."""

    def __init__(
        self,
        dim: int,
        base: float,
        original_len: int = 0,
        factor: float = 1.0,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
    ):
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        if original_len > 0:

            def corrected_dim(rotations: float) -> float:
                return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

            low = max(math.floor(corrected_dim(beta_fast)), 0)
            high = min(math.ceil(corrected_dim(beta_slow)), dim - 1)
            ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
            smooth = 1 - ramp  # kept as DeepSeek writes it: 1 - (1 - ramp) is not always ramp in fp32
            freqs = freqs / factor * (1 - smooth) + freqs * smooth
        self.dim = dim
        self.freqs = freqs
        self.fused = None  # a runtime's kernel of rotate: (x, cis, dim, inverse) -> the same, or None

    def cis(self, positions: torch.Tensor) -> torch.Tensor:
        """Unit complex rotations [n, dim/2] for integer positions [n]."""
        if self.freqs.device != positions.device:  # once: a captured step may not copy from the host
            self.freqs = self.freqs.to(positions.device)
        angles = torch.outer(positions.to(torch.float32), self.freqs)
        return torch.polar(torch.ones_like(angles), angles)

    def rotate(self, x: torch.Tensor, cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the last `dim` channels of x [b, s, (h,) d] by cis [s, dim/2]; returns a new tensor."""
        y = self.fused(x, cis, self.dim, inverse) if self.fused is not None else None
        if y is not None:
            return y
        head, tail = x[..., : -self.dim], x[..., -self.dim :]
        z = torch.view_as_complex(tail.float().unflatten(-1, (-1, 2)).contiguous())
        c = cis.conj() if inverse else cis
        c = c.view(1, c.shape[0], *([1] * (z.dim() - 3)), c.shape[-1])
        tail = torch.view_as_real(z * c).flatten(-2).to(x.dtype)
        return torch.cat([head, tail], dim=-1)
