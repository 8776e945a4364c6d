"""FP4 E2M1: checkpoint experts (nibble pairs in I8 with per-32 E8M0 scales) and the FP4 fake-quant
points of the model (E8M0 power-of-two scales, or E4M3 scales for the compressed KV latent)."""

from __future__ import annotations

import torch

from dsflash.formats.fp8 import to_e4m3
from dsflash.formats.scales import e8m0_to_float, float_to_e8m0, scale_for

E2M1_MAX = 6.0
GROUP = 32  # checkpoint FP4 scale group along K
# magnitudes by 3-bit code; code bit 3 is the sign
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP4_TABLE = torch.cat([E2M1_VALUES, -E2M1_VALUES])
# decision boundaries between neighbouring magnitudes; on an exact tie round to the even code,
# which is the upper one at 0.75, 1.75 and 3.5
_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_TIE_UP = torch.tensor([False, True, False, True, False, True, False])


_ON_DEVICE: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(_MIDS, _TIE_UP, FP4_TABLE) on `device`, copied once: a captured CUDA graph may not copy from the host."""
    if device not in _ON_DEVICE:
        _ON_DEVICE[device] = (_MIDS.to(device), _TIE_UP.to(device), FP4_TABLE.to(device))
    return _ON_DEVICE[device]


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 already scaled into [-6, 6] -> uint8 codes 0..15 (round to nearest even, sign kept)."""
    mag = x.abs().unsqueeze(-1)
    mids, tie_up, _ = _tables(x.device)
    code = (mag > mids).sum(-1) + ((mag == mids) & tie_up).sum(-1)
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of fp32 x in [-6, 6]."""
    return _tables(x.device)[2][e2m1_codes(x).long()]


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """I8/uint8 [..., K/2] -> uint8 codes [..., K]; element 2k is the low nibble of byte k."""
    b = packed.view(torch.uint8)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> int8 [..., K/2] (low nibble = even element), the checkpoint layout."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)


def dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W[o, i] = fp4(o, i) * S[o, i // 32]. packed I8 [O, I/2], scale E8M0 [O, I/32] -> fp32 [O, I]."""
    values = FP4_TABLE[unpack_codes(packed).long()]
    s = e8m0_to_float(scale)
    if values.shape[-1] != s.shape[-1] * GROUP:
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not fit weight {tuple(packed.shape)}")
    return (values.unflatten(-1, (-1, GROUP)) * s.unsqueeze(-1)).flatten(-2)


def quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [O, I] -> (I8 [O, I/2], E8M0 [O, I/32]) with scale 2^ceil(log2(amax/6)) per group of 32."""
    g = w.float().unflatten(-1, (-1, GROUP))
    s = scale_for(g.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2.0**-126), E2M1_MAX)
    codes = e2m1_codes((g / s).clamp(-E2M1_MAX, E2M1_MAX)).flatten(-2)
    return pack_codes(codes), float_to_e8m0(s.squeeze(-1))


def qdq(x: torch.Tensor, block: int = 32, e4m3_scale: bool = False) -> torch.Tensor:
    """Fake-quant to E2M1 in blocks over the last dim.

    E8M0 (default): scale 2^ceil(log2(amax/6)), amax floored at 6*2^-126 (indexer q and k).
    E4M3: scale e4m3(amax/6), amax floored at 6*2^-9 (compressed KV latent, groups of 16).
    """
    xg = x.float().unflatten(-1, (-1, block))
    amax = xg.abs().amax(dim=-1, keepdim=True)
    if e4m3_scale:
        s = to_e4m3(amax.clamp_min(E2M1_MAX * 2.0**-9) / E2M1_MAX).float()
    else:
        s = scale_for(amax.clamp_min(E2M1_MAX * 2.0**-126), E2M1_MAX)
    v = (xg / s).clamp(-E2M1_MAX, E2M1_MAX)
    return (e2m1_round(v) * s).flatten(-2).to(x.dtype)
