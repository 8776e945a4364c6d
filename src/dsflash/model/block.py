"""The pieces every block-stack shares: Block (attention + MoE between hc mixes), embedding, head, ropes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsflash.config import LayerSpec, ModelConfig
from dsflash.model import mhc
from dsflash.model.attention import Attention, Step
from dsflash.model.experts import ExpertBackend
from dsflash.model.layers import RMSNorm, Rope, _param
from dsflash.model.moe import MoE
from dsflash.model.parallel import TP


def make_ropes(cfg: ModelConfig) -> dict[bool, Rope]:
    """compressed layers: compress_rope_theta with YaRN; ratio-0 layers: rope_theta without (keyed by ratio > 0)."""
    rd, ys = cfg.qk_rope_head_dim, cfg.rope_scaling
    return {
        True: Rope(
            rd, cfg.compress_rope_theta, ys.original_max_position_embeddings, ys.factor, ys.beta_fast, ys.beta_slow
        ),
        False: Rope(rd, cfg.rope_theta),
    }


class Block(nn.Module):
    """Attention and MoE, each between a collapse (pre) and an expansion (post, comb) of the hc streams.

    The collapse weights are pipelined: attention uses the previous block's FFN `pre`, the FFN uses the
    `pre` computed for attention (arch §5.2).
    """

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, tp: TP, rope: Rope, attention_cls=Attention):
        super().__init__()
        self.spec = spec
        d, hc = cfg.hidden_size, cfg.hc_mult
        self.hc_args = (cfg.hc_sinkhorn_iters, cfg.rms_norm_eps, cfg.hc_eps)
        self.sinkhorn = mhc.sinkhorn  # a runtime may put a fused kernel of the same math here (about 120 small ops)
        # a runtime may put a fused mhc.mixes here too: (x, fn, scale, base, *hc_args) -> (pre, post, comb), or None
        # where it does not pay
        self.fused_mixes = None
        # and a fused collapse + RMSNorm, (x, weights, norm weight, eps) -> normed, and a fused expand with
        # mhc.expand's arguments, each returning None where it does not apply
        self.fused_collapse_norm = None
        self.fused_expand = None
        self.attn = attention_cls(cfg, spec, tp, rope)
        self.ffn = MoE(cfg, spec, tp)
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        n_mix = (2 + hc) * hc
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", _param(n_mix, hc * d))
            setattr(self, f"hc_{part}_base", _param(n_mix))
            setattr(self, f"hc_{part}_scale", _param(3))

    def mixes(self, x: torch.Tensor, part: str):
        fn, scale, base = (getattr(self, f"hc_{part}_{n}") for n in ("fn", "scale", "base"))
        out = self.fused_mixes(x, fn, scale, base, *self.hc_args) if self.fused_mixes is not None else None
        return out if out is not None else mhc.mixes(x, fn, scale, base, *self.hc_args, normalize=self.sinkhorn)

    def collapse_norm(self, x: torch.Tensor, weights: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        out = self.fused_collapse_norm(x, weights, norm.weight, norm.eps) if self.fused_collapse_norm else None
        return out if out is not None else norm(mhc.collapse(x, weights))

    def expand(self, f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        out = self.fused_expand(f, x, post, comb) if self.fused_expand else None
        return out if out is not None else mhc.expand(f, x, post, comb)

    def forward(self, x, pre_mix, step: Step, experts: ExpertBackend, *attn_args):
        """x [b, s, hc, d], pre_mix [b, s, hc] -> (x, this block's FFN pre weights for the next block)."""
        attn_pre, post, comb = self.mixes(x, "attn")
        a = self.collapse_norm(x, pre_mix, self.attn_norm)
        x = self.expand(self.attn(a, step, *attn_args), x, post, comb)
        ffn_pre, post, comb = self.mixes(x, "ffn")
        f = self.collapse_norm(x, attn_pre, self.ffn_norm)
        x = self.expand(self.ffn(f, experts, step.trace), x, post, comb)
        return x, ffn_pre


class Embedding(nn.Module):
    """Token embedding (vocab-split over ranks; off-rank rows contribute zeros before the all-reduce)."""

    def __init__(self, vocab: int, dim: int, tp: TP):
        super().__init__()
        self.tp = tp
        self.part = tp.part(vocab)
        self.weight = _param(self.part, dim, shard={0: tp.indices(vocab)})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight).float()
        local = ids - self.tp.rank * self.part
        off = (local < 0) | (local >= self.part)
        y = F.embedding(local.masked_fill(off, 0), self.weight).float().masked_fill(off.unsqueeze(-1), 0)
        return self.tp.all_reduce(y)


class Head(nn.Module):
    """fp32 logits, vocab-split over ranks and gathered."""

    packed = None  # a runtime's device format for the weight (layers.PackedWeight)

    def __init__(self, vocab: int, dim: int, tp: TP):
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.weight = _param(tp.part(vocab), dim, shard={0: tp.indices(vocab)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        screened = getattr(self.packed, "logits", None)  # a head that gathers itself (runtime.cpu.dense.ScreenedHead)
        if screened is not None:
            return screened(x, self.tp, self.vocab)
        if self.packed is not None:
            local = self.packed.linear(x)
        else:
            w = self.weight
            local = F.linear(x.to(w.dtype), w).float()
        logits = self.tp.all_gather_last(local)
        return logits[..., : self.vocab]  # an uneven split pads the last rank
