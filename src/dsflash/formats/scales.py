"""Power-of-two (E8M0) scales exactly as DeepSeek's kernels round them."""

from __future__ import annotations

import torch

E8M0_BIAS = 127


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for fp32 x > 0, read off the IEEE bits (exponent, +1 if any mantissa bit is set).

    The kernels do it this way rather than with log2/ceil, and the two differ at fp32 rounding edges.
    """
    bits = x.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & ((1 << 23) - 1)
    log2_ceil = exp - 127 + (man != 0).to(torch.int32)
    return ((log2_ceil + 127) << 23).view(torch.float32)


def scale_for(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """Power-of-two scale so that amax / scale <= max_value: 2^ceil(log2(amax * fp32(1/max_value)))."""
    inv = torch.tensor(1.0 / max_value, dtype=torch.float32)
    return pow2_ceil(amax.float() * inv)


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (float8_e8m0fnu or uint8) -> fp32 2^(e-127)."""
    if s.dtype == torch.uint8:
        s = s.view(torch.float8_e8m0fnu)
    return s.float()


def float_to_e8m0(s: torch.Tensor) -> torch.Tensor:
    """Exact powers of two (fp32, normal range) -> float8_e8m0fnu."""
    bits = s.float().contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF).to(torch.uint8)
    return e.view(torch.float8_e8m0fnu)
