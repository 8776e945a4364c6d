"""FP8 E4M3 with E8M0 block scales: checkpoint dequantization, quantization (for writers) and the
fake-quant (quantize -> dequantize) that DeepSeek applies to activations inside the model."""

from __future__ import annotations

import torch

from dsflash.formats.scales import e8m0_to_float, float_to_e8m0, scale_for

E4M3_MAX = 448.0


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round to nearest even, saturating at +-448 (a bare cast gives NaN)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _expand(scale: torch.Tensor, block: int, rows: int, cols: int) -> torch.Tensor:
    return scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]


def dequant_block(weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """W[o, i] = e4m3(W_q[o, i]) * S[o // B, i // B]. weight [O, I] e4m3, scale [ceil(O/B), ceil(I/B)] -> fp32."""
    rows, cols = weight.shape
    want = (-(-rows // block), -(-cols // block))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit weight {tuple(weight.shape)} (block {block})")
    return weight.float() * _expand(e8m0_to_float(scale), block, rows, cols)


def quant_block(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 or bf16 [O, I] -> (e4m3 [O, I], e8m0 [ceil(O/B), ceil(I/B)]) with power-of-two scales per block."""
    rows, cols = w.shape
    if rows % block == 0 and cols % block == 0:  # whole blocks: one fp32 copy, divided in place, no padding
        blocks = w.reshape(rows // block, block, cols // block, block)
        scale = scale_for(blocks.abs().amax(dim=(1, 3)).float().clamp_min(1e-30), E4M3_MAX)
        x = blocks.to(torch.float32, copy=True)
        x.div_(scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
        return x.to(torch.float8_e4m3fn).view(rows, cols), float_to_e8m0(scale)
    w = w.float()
    pad = torch.zeros(-(-rows // block) * block, -(-cols // block) * block, dtype=torch.float32)
    pad[:rows, :cols] = w
    blocks = pad.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [ro, B, co, B]
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-30)
    scale = scale_for(amax, E4M3_MAX)
    q = to_e4m3(w / _expand(scale, block, rows, cols))
    return q, float_to_e8m0(scale)


def dequant_rows(table: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, block: int) -> torch.Tensor:
    """Dequantize only the looked-up rows of an FP8 table with per-row, per-`block` column scales.
    table [R, D] e4m3, scale [R, D / block] e8m0, rows int64 [...] -> fp32 [..., D]."""
    flat = rows.reshape(-1)
    values = table[flat].float().unflatten(-1, (-1, block))
    scales = e8m0_to_float(scale[flat]).unsqueeze(-1)
    return (values * scales).flatten(-2).reshape(*rows.shape, table.shape[-1])


def qdq(x: torch.Tensor, block: int) -> torch.Tensor:
    """Fake-quant over the last dim in blocks: power-of-two scale from amax (floored at 1e-4), e4m3 round."""
    xg = x.float().unflatten(-1, (-1, block))
    amax = xg.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    s = scale_for(amax, E4M3_MAX)
    return (to_e4m3(xg / s).float() * s).flatten(-2).to(x.dtype)
