"""Tensor parallelism: the TP context, how each rank's slice of a dimension is chosen, and the only calls to
torch.distributed collectives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# how long a watched collective waits between two looks at its peers
WAIT_SLICE = timedelta(seconds=1)


def collective(run: Callable, *args, watch: Callable[[], None] | None = None, **kwargs) -> None:
    """Run a torch.distributed collective; with watch, wait for it in slices and call watch() between them (it
    raises where a peer process is gone). gloo does not always fail a send whose peer was killed: it can wait out
    the group's whole timeout (tests/model/test_parallel_watch.py)."""
    if watch is None:
        run(*args, **kwargs)
        return
    work = run(*args, async_op=True, **kwargs)
    while True:
        try:
            work.wait(timeout=WAIT_SLICE)
            return
        except RuntimeError:
            if work.is_completed():  # failed, not merely unfinished
                raise
        watch()


@dataclass(frozen=True)
class TP:
    """Which slice of every parallel layer this process holds. size 1 is the no-op reference."""

    size: int = 1
    rank: int = 0
    group: Any = None
    host_staging: bool = False  # collectives of device tensors go through host copies (gloo between GPU ranks)
    # rank 0's look at the processes it spawned, between slices of a gloo collective (NCCL waits as it does)
    watch: Callable[[], None] | None = None

    @classmethod
    def single(cls) -> TP:
        return cls()

    @classmethod
    def from_process_group(cls, group: Any = None, host_staging: bool = False) -> TP:
        return cls(size=dist.get_world_size(group), rank=dist.get_rank(group), group=group, host_staging=host_staging)

    def _run(self, run: Callable, *args, **kwargs) -> None:
        collective(run, *args, watch=self.watch if self.group is None else None, group=self.group, **kwargs)

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
        self._run(dist.all_reduce, y)
        return y.to(device=x.device, dtype=x.dtype)

    def agree_min(self, n: int) -> int:
        """The smallest of every rank's n: a start-up decision all ranks must share (one int, once)."""
        if self.size == 1:
            return n
        nccl = dist.get_backend(self.group) == "nccl"
        t = torch.tensor([n], dtype=torch.int64, device="cuda" if nccl else "cpu")
        self._run(dist.all_reduce, t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's slice along the last dim (vocabulary-split logits)."""
        if self.size == 1:
            return x
        mine = self._staged(x.contiguous())
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        self._run(dist.all_gather, parts, mine)
        return torch.cat(parts, dim=-1).to(x.device)
