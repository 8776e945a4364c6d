"""The CUDA device: expert slots in GPU memory filled from the store through pinned staging buffers, the routed
expert FFN straight from a slot's bfp tiles, and dense weights kept as the checkpoint's FP8 blocks (bf16 where it has
no FP8) on the GPU. Every product is the Triton kernel of runtime/cuda/triton_linear.py (bf16 tensor-core products of x
split in two bf16 terms, fp32 sums).

Imported only when a rank runs on CUDA: the CPU engine needs neither triton nor a GPU. With TRITON_INTERPRET=1 the
same classes run on CPU tensors (tests/unit/test_triton_linear.py checks the path that way where no GPU exists).
"""

from __future__ import annotations

import torch
from torch import nn

from dsflash.model.experts import swiglu
from dsflash.runtime.cpu import dense
from dsflash.runtime.cpu.dense import Bf16Weight, Fp8Weight
from dsflash.runtime.cuda import triton_linear
from dsflash.runtime.experts.device import PackedMatrix, ShardLayout, SplitReader, expert_sum

SLOT_ALIGN = 256  # bytes: every slot starts where a vector load of its tiles is aligned


class CudaWeight(Bf16Weight):
    """A dense matrix [O, I] in bf16 on the GPU (exact for the checkpoint's bf16 and FP8 values)."""

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return triton_linear.linear(x.reshape(-1, x.shape[-1]), self.w, "bf16").view(*lead, -1)


class CudaFp8Weight(Fp8Weight):
    """A dense matrix [O, I] as the checkpoint's FP8 E4M3 bytes with power-of-two block scales on the GPU: half the
    bytes of bf16 for a decode step to read, decoded exactly in the kernel."""

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        return triton_linear.linear(flat, self.q, "fp8", scale=self.scale, block=self.block).view(*lead, -1)

    def grouped(self, x: torch.Tensor, groups: int) -> None:
        return None  # the host kernel's one-call form: on the GPU the groups go one by one


def pack_dense(model: nn.Module, device: torch.device, ckpt, fmt: str = "fp8") -> int:
    """Every matrix of `model` on `device`, in the formats the CPU engine keeps (runtime.dense.pack_dense: FP8 blocks
    where the checkpoint stores FP8 and fmt is "fp8", bf16 elsewhere); returns the bytes they hold."""
    # a GPU's decode step is bound by its launches, not the head's bytes: the head stays bf16 alone
    total = dense.pack_dense(model, ckpt, fmt, huge_pages=False, screen_head=False)
    for m in model.modules():
        p = getattr(m, "packed", None)
        if isinstance(p, Fp8Weight):
            m.packed = CudaFp8Weight(p.q.to(device), p.scale.to(device), p.block)
        elif isinstance(p, Bf16Weight):
            m.packed = CudaWeight(p.w.to(device))
    return total


class CudaDevice:
    """Device (runtime/experts/device.py) on one GPU. A miss is read from the page cache into one of two pinned buffers
    while the other's copy to the GPU is still in flight; copies and expert kernels share the current stream, so a
    slot is never overwritten while a kernel still reads it."""

    name = "cuda"

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._staging: list[torch.Tensor] = []
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._next = 0
        self._read = SplitReader()  # one thread reads the page cache at ~8 GB/s; the link takes ~55

    def slot_budget(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return max(0, free - max(1 << 30, total // 20))  # headroom for activations, workspaces, fragmentation

    def allocate(self, n_slots: int, nbytes: int) -> torch.Tensor:
        stride = -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN
        return torch.zeros((n_slots, stride), dtype=torch.uint8, device=self.device)

    def _buffer(self, nbytes: int) -> tuple[int, torch.Tensor]:
        if not self._staging or self._staging[0].numel() < nbytes:
            self.synchronize()
            pin = self.device.type == "cuda"  # only pinned pages copy asynchronously
            self._staging = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
            self._done = [None, None]
        i, self._next = self._next, 1 - self._next
        if self._done[i] is not None:
            self._done[i].synchronize()  # its previous copy to the GPU has finished: the buffer may be refilled
        return i, self._staging[i]

    def load(self, slots: torch.Tensor, slot: int, fd: int, offset: int, nbytes: int) -> None:
        i, buf = self._buffer(nbytes)
        self._read(fd, memoryview(buf.numpy())[:nbytes], offset)
        slots[slot, :nbytes].copy_(buf[:nbytes], non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._done[i] = event

    def synchronize(self) -> None:
        for e in self._done:
            if e is not None:
                e.synchronize()

    def close(self) -> None:
        self.synchronize()
        self._staging = []
        self._read.close()

    def experts(
        self, slots: torch.Tensor, ids: list[int], layout: ShardLayout, x: torch.Tensor, w: torch.Tensor, limit: float
    ) -> torch.Tensor:
        return expert_sum(self, slots, ids, layout, x, w, limit)

    def routed(self, slots, ids, layout, x, route, w, limit) -> None:
        """No fused call for several tokens' own experts here: expert by expert (CachedExperts)."""
        return None

    def expert(
        self, slots: torch.Tensor, slot: int, layout: ShardLayout, x: torch.Tensor, w: torch.Tensor, limit: float
    ) -> torch.Tensor:
        """Routed expert on tokens x [t, d] with routing weights w [t, 1] -> this rank's partial fp32 [t, d]."""
        mem = slots[slot]

        def apply(m: PackedMatrix, a: torch.Tensor) -> torch.Tensor:
            return triton_linear.linear(a, mem[m.offset : m.offset + m.nbytes], layout.fmt, (m.rows, m.cols))

        return _ffn(apply, layout, x, w, limit)

    def experts_by_table(
        self, slots: torch.Tensor, table: torch.Tensor, layout: ShardLayout, x: torch.Tensor, w: torch.Tensor,
        limit: float,
    ) -> torch.Tensor:  # fmt: skip
        """experts() with the slots in a device int tensor table [k] (int32 or int64) that the kernels read: no host
        sync and no slot number in the launches, so a CUDA graph captured once replays for whatever slots the table
        holds then. w [t, k] -> this rank's partial fp32 [t, d], the experts added in table order."""
        if table.dim() != 1 or w.dim() != 2 or w.shape[1] != table.shape[0]:
            raise ValueError(f"routing weights {list(w.shape)} do not match a slot table {list(table.shape)}")
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for i in range(table.shape[0]):
            slot = table[i : i + 1]

            def apply(m: PackedMatrix, a: torch.Tensor, slot=slot) -> torch.Tensor:
                return triton_linear.linear(a, slots, layout.fmt, (m.rows, m.cols), slot=slot, offset=m.offset)

            y += _ffn(apply, layout, x, w[:, i : i + 1], limit)
        return y


def _ffn(apply, layout: ShardLayout, x: torch.Tensor, w: torch.Tensor, limit: float) -> torch.Tensor:
    """The expert FFN with apply(matrix, a) as its products: w2 (swiglu(w1 x, w3 x) * w), cut to x's width."""
    h = swiglu(apply(layout.w1, x), apply(layout.w3, x), limit) * w
    return apply(layout.w2, h)[:, : x.shape[1]]
