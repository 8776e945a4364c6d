"""Fill a module whose parameter names are checkpoint names; build the resident expert weights."""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from dsflash.config import ModelConfig
from dsflash.errors import CheckpointError

log = logging.getLogger(__name__)

EXPERT = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")


def load_into(module: nn.Module, ckpt) -> None:
    """Fill every parameter and buffer of `module` from the checkpoint tensor of the same name.

    Parameters arrive dequantized (fp32) and sliced to their TP shard; buffers are what a model keeps as stored
    (the Engram tables, FP8 looked up row by row) and are bound zero-copy in their stored dtype.
    """
    have = set(ckpt.names())
    missing = []
    for name, p in module.named_parameters():
        if name not in have:
            missing.append(name)
            continue
        t = shard_tensor(ckpt.tensor(name), getattr(p, "shard", {}))
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"{name}: checkpoint shape {tuple(t.shape)}, model expects {tuple(p.shape)}")
        p.data = t.to(p.dtype)
    for name, _ in module.named_buffers():
        if name not in have:
            missing.append(name)
            continue
        owner, attr = _owner(module, name)
        setattr(owner, attr, ckpt.raw(name))
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    vision = ckpt.vision_names()
    if vision:
        log.warning("skipping %d vision-tower tensors: images are not supported", len(vision))


def shard_tensor(t: torch.Tensor, shard: dict[int, torch.Tensor]) -> torch.Tensor:
    """This rank's part of a full checkpoint tensor: entries `shard[dim]` along each split dim, -1 = zeros."""
    for dim, idx in shard.items():
        out = t.index_select(dim, idx.clamp_min(0))
        pad = idx < 0
        if bool(pad.any()):
            view = [1] * t.dim()
            view[dim] = idx.numel()
            out = out.masked_fill(pad.view(view), 0)
        t = out
    return t


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, attr = name.rsplit(".", 1)
    return module.get_submodule(path), attr


def expert_layer_id(cfg: ModelConfig, kind: str, index: int) -> int:
    """Checkpoint block namespace -> layer id as the model counts it (DSpark stages follow the backbone)."""
    return index if kind == "layers" else cfg.num_hidden_layers + index


def load_experts(
    ckpt, cfg: ModelConfig, dspark: bool = True, inter: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> dict:
    """(layer, expert) -> dequantized (w1, w3, w2) fp32 for every routed expert; `inter` selects this rank's
    intermediate rows of w1/w3 and columns of w2 (tensor parallel, -1 = zero padding)."""
    found: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for name in ckpt.names():
        m = EXPERT.match(name)
        if not m or m.group(5) != "weight" or (m.group(1) == "mtp" and not dspark):
            continue
        key = (expert_layer_id(cfg, m.group(1), int(m.group(2))), int(m.group(3)))
        t = ckpt.tensor(name)
        if inter is not None:
            t = shard_tensor(t, {1 if m.group(4) == "w2" else 0: inter})
        found.setdefault(key, {})[m.group(4)] = t.to(dtype)
    out = {}
    for key, parts in found.items():
        if set(parts) != {"w1", "w2", "w3"}:
            raise CheckpointError(f"expert {key[1]} of layer {key[0]} lacks {sorted({'w1', 'w2', 'w3'} - set(parts))}")
        out[key] = (parts["w1"], parts["w3"], parts["w2"])
    return out
