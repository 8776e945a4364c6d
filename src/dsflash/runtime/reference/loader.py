"""Build a model from a checkpoint: dense weights into the module, routed experts into a back end."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsflash.checkpoint.index import Checkpoint
from dsflash.checkpoint.load import load_experts, load_into
from dsflash.config import ModelConfig
from dsflash.model.experts import ExpertBackend, ResidentExperts
from dsflash.model.parallel import TP
from dsflash.model.transformer import Transformer


@dataclass
class LoadedModel:
    cfg: ModelConfig
    model: Transformer
    experts: ExpertBackend


def build_model(
    ckpt: Checkpoint, token_map: list[int] | None, tp: TP | None = None, qat: bool = True, dspark: bool = True
) -> Transformer:
    """The dense part of the model with its weights loaded (experts are separate)."""
    model = Transformer(ckpt.config, tp=tp, token_map=token_map, qat=qat, dspark=dspark)
    load_into(model, ckpt)
    return model.eval()


def load_reference(
    ckpt: Checkpoint,
    token_map: list[int] | None,
    qat: bool = True,
    dspark: bool = True,
    expert_dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    """DeepSeek's math on the CPU in fp32 with every expert resident: the quality reference.

    expert_dtype bfloat16 holds the same expert values (FP4 x E8M0 is exact in bf16) in half the memory, at the
    price of bf16-rounded activations inside the experts: for speed baselines of wide models, not for gates.
    """
    cfg = ckpt.config
    model = build_model(ckpt, token_map, qat=qat, dspark=dspark)
    experts = ResidentExperts(load_experts(ckpt, cfg, dspark=dspark, dtype=expert_dtype), cfg.swiglu_limit)
    return LoadedModel(cfg, model, experts)
