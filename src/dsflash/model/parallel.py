"""Tensor parallelism: the TP context, how each rank's slice of a dimension is chosen, and the only calls to
torch.distributed collectives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TP:
    """Which slice of every parallel layer this process holds. size 1 is the no-op reference."""

    size: int = 1
    rank: int = 0
    group: Any = None
    host_staging: bool = False  # collectives of device tensors go through host copies (gloo between GPU ranks)

    @classmethod
    def single(cls) -> TP:
        return cls()

    @classmethod
    def from_process_group(cls, group: Any = None, host_staging: bool = False) -> TP:
        return cls(size=dist.get_world_size(group), rank=dist.get_rank(group), group=group, host_staging=host_staging)

    def _staged(self, x: torch.Tensor) -> torch.Tensor:
        return x.cpu() if self.host_staging else x

    def part(self, n: int) -> int:
        """This rank's share of a dimension split over ranks; an uneven split is padded (ceil)."""
        return -(-n // self.size)

    def indices(self, n: int) -> torch.Tensor:
        """Which of n entries this rank holds, [part], with -1 for padding past the end."""
        idx = self.rank * self.part(n) + torch.arange(self.part(n))
        return torch.where(idx < n, idx, -1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results over ranks, in fp32 so that bf16 partials do not lose the small terms."""
        if self.size == 1:
            return x
        y = self._staged(x.float())
        dist.all_reduce(y, group=self.group)
        return y.to(device=x.device, dtype=x.dtype)

    def agree_min(self, n: int) -> int:
        """The smallest of every rank's n: a start-up decision all ranks must share (one int, once)."""
        if self.size == 1:
            return n
        nccl = dist.get_backend(self.group) == "nccl"
        t = torch.tensor([n], dtype=torch.int64, device="cuda" if nccl else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's slice along the last dim (vocabulary-split logits)."""
        if self.size == 1:
            return x
        mine = self._staged(x.contiguous())
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.group)
        return torch.cat(parts, dim=-1).to(x.device)
