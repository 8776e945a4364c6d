"""MoE: sqrtsoftplus router with selection-only bias, routed experts through an ExpertBackend, shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsflash.config import LayerSpec, ModelConfig
from dsflash.model.experts import ExpertBackend, swiglu
from dsflash.model.layers import ColumnParallelLinear, RowParallelLinear, _param
from dsflash.model.parallel import TP


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.topk, self.score_func, self.temp = spec.n_active, cfg.scoring_func, cfg.gate_temp
        self.norm_topk, self.route_scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = _param(spec.n_experts, cfg.hidden_size)
        self.bias = _param(spec.n_experts)
        if cfg.vision_config is not None and not spec.is_dspark:
            self.bias_vl = _param(spec.n_experts)  # image-span routing bias; loaded, unused for text
        self.fused = None  # a runtime's kernel of forward: (gate, x) -> the same, or None where it does not apply

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [t, d] -> (weights fp32 [t, k], ids [t, k]); the bias picks experts but never scales them."""
        out = self.fused(self, x) if self.fused is not None else None
        if out is not None:
            return out
        z = F.linear(x.float(), self.weight.float()) / self.temp
        if self.score_func == "softmax":
            scores = z.softmax(dim=-1)
        elif self.score_func == "sigmoid":
            scores = z.sigmoid()
        else:
            scores = F.softplus(z).sqrt()
        ids = (scores + self.bias.float()).topk(self.topk, dim=-1)[1]
        w = scores.gather(1, ids)
        if self.norm_topk and self.topk > 1:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)  # 1e-20, not norm_eps: as in training
        return w * self.route_scale, ids


class SharedExpert(nn.Module):
    """The always-on expert, split over ranks along the intermediate dimension."""

    def __init__(self, cfg: ModelConfig, tp: TP):
        super().__init__()
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = ColumnParallelLinear(d, inter, tp)
        self.w3 = ColumnParallelLinear(d, inter, tp)
        self.w2 = RowParallelLinear(inter, d, tp, reduce=False)  # reduced together with the routed experts
        self.limit = cfg.swiglu_limit
        self.fused = None  # a runtime's one-call form of partial: x -> the same, or None where it does not apply

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output, fp32 [t, d] (V4.1 clamps the shared expert too)."""
        y = self.fused(x) if self.fused is not None else None
        return y if y is not None else self.w2(swiglu(self.w1(x), self.w3(x), self.limit)).float()


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, tp: TP):
        super().__init__()
        self.layer_id, self.tp = spec.layer_id, tp
        self.gate = Gate(cfg, spec)
        self.shared_experts = SharedExpert(cfg, tp)

    def forward(self, x: torch.Tensor, experts: ExpertBackend, trace: dict | None = None) -> torch.Tensor:
        """x [b, s, d] -> [b, s, d]; one all-reduce for routed and shared partial sums together."""
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat)
        if trace is not None:
            trace.setdefault("moe", {})[self.layer_id] = (ids, weights)
        y = experts(self.layer_id, flat, ids, weights) + self.shared_experts.partial(flat)
        return self.tp.all_reduce(y).to(x.dtype).view(x.shape)
