"""Device: where the expert slots live and how an expert's packed tiles are applied to activations.

The engine only needs three things from a device: a pool of fixed-size slot buffers allocated once, a store range
brought into a slot (copied; on the CPU mapped where the system allows, runtime/experts/filemap.py), and the expert FFN
computed straight from a slot's block-float tiles (and close(), to let go of whatever helps it copy). CPU is below;
a Tenstorrent or CUDA back end implements the same calls.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from dsflash.model.experts import swiglu
from dsflash.runtime.cpu import hugepages, native, rows
from dsflash.runtime.experts import filemap

# a copy into a slot is split over the rank's threads above this size: one thread copying from the page cache gets
# about half of what two get (4.2 vs 8.3 GB/s here)
SPLIT_COPY_BYTES = 1 << 20

# share of the host's available memory the CPU slot pool may take: the page cache must keep holding the store the
# misses are read from (and the Engram tables)
CPU_SLOT_SHARE = 0.5

# rows of x at or below which the expert runs as fused GEMVs on the packed tiles (decode); above it the tiles are
# expanded to bf16 and multiplied as matrices (prefill, expert-major: many tokens per expert). Where the matrices
# run on AMX with panels expanded in L2, that pays from fewer rows (2 cores, 2048 x 5120 bfp4_b: GEMV 0.80 ms vs
# 1.01 at 4 rows, 1.51 vs 1.03 at 6, 2.85 vs 1.21 at 16): a real model's prefill gives most experts 2-20 tokens.
GEMV_MAX_ROWS = 16
AMX_GEMV_MAX_ROWS = 4
# likewise for the fp32 product with panels expanded where multiplied (native.packed_linear; 2 cores, AVX2, [2304,
# 5120] bfp4_b: GEMV 3.1 ms vs 3.0 at 6 rows, 4.2 vs 3.0 at 8, 8.0 vs 3.1 at 16)
F32_GEMV_MAX_ROWS = 6


@dataclass(frozen=True)
class PackedMatrix:
    """One packed matrix inside a slot: byte range and the padded (multiple-of-32) shape its tiles cover."""

    offset: int
    nbytes: int
    rows: int
    cols: int


@dataclass(frozen=True)
class ShardLayout:
    """A rank's shard of one expert in a slot: w1, w3 [inter_pad, d], w2 [d, inter_pad], in this tile format."""

    fmt: str
    w1: PackedMatrix
    w3: PackedMatrix
    w2: PackedMatrix
    nbytes: int


class Device(Protocol):
    name: str

    def slot_budget(self) -> int:
        """Bytes a slot pool may take on this device now (dense weights and decode state already placed)."""
        ...

    def allocate(self, n_slots: int, nbytes: int): ...

    def load(self, slots, slot: int, fd: int, offset: int, nbytes: int) -> None: ...

    def expert(
        self, slots, slot: int, layout: ShardLayout, x: torch.Tensor, w: torch.Tensor, limit: float
    ) -> torch.Tensor: ...

    def experts(
        self, slots, ids: list[int], layout: ShardLayout, x: torch.Tensor, w: torch.Tensor, limit: float
    ) -> torch.Tensor:
        """The routed sum of several resident experts over the same tokens: w [t, n] holds expert ids[i]'s weights
        in column i -> fp32 [t, d], the experts added in the order given (expert_sum, or one fused call)."""
        ...

    def routed(
        self,
        slots,
        ids: list[int],
        layout: ShardLayout,
        x: torch.Tensor,
        route: torch.Tensor,
        w: torch.Tensor,
        limit: float,
    ) -> torch.Tensor | None:
        """A few tokens, each through its own resident experts in one call: route [t, k] indexes ids, w [t, k] ->
        fp32 [t, d], token i the sum over j in order of expert(ids[route[i, j]]) * w[i, j] with the bits experts()
        gives it alone; None where the device has no such call for these tokens (the caller goes expert by
        expert)."""
        ...

    def close(self) -> None: ...


def expert_sum(
    device: Device, slots, ids: list[int], layout: ShardLayout, x: torch.Tensor, w: torch.Tensor, limit: float
) -> torch.Tensor:
    """Device.experts as one Device.expert call per expert."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for i, slot in enumerate(ids):
        y += device.expert(slots, slot, layout, x, w[:, i : i + 1], limit)[:, : x.shape[1]]
    return y


def gemv_rows(dtype) -> int:
    """The most rows of x an expert's product takes as GEMVs on the tiles in this prefill mode; more are matrices.
    A batched decode step (rows.decoding) keeps them all on the GEMVs: each token gets its solo bits."""
    if rows.is_decoding():
        return GEMV_MAX_ROWS
    if dtype == native.BF16X2 and native.amx_ready():
        return AMX_GEMV_MAX_ROWS
    return F32_GEMV_MAX_ROWS if dtype == torch.float32 and native.f32_packed_ready() else GEMV_MAX_ROWS


def host_available() -> int:
    """Bytes the host can hand out without swapping: MemAvailable (free pages plus reclaimable page cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def read_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill view from fd at offset (pread; a store that ends early is an error)."""
    got, nbytes = 0, len(view)
    while got < nbytes:  # short reads are legal
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise OSError(f"expert store ended early at byte {offset + got}")
        got += n


class SplitReader:
    """Reads a store range into memory, split over torch's thread count in page-aligned pieces above
    SPLIT_COPY_BYTES. Every piece finishes (or fails) before the call returns, so the target is never used or
    reused while a thread still writes it."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, fd: int, view: memoryview, offset: int) -> None:
        nbytes = len(view)
        parts = max(1, torch.get_num_threads()) if nbytes >= SPLIT_COPY_BYTES else 1
        if parts == 1:
            read_into(fd, view, offset)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(parts, thread_name_prefix="dsflash-slot-copy")
        step = -(-nbytes // parts // 4096) * 4096
        pieces = [self._pool.submit(read_into, fd, view[a : a + step], offset + a) for a in range(0, nbytes, step)]
        for p in pieces:
            p.exception()
        for p in pieces:
            p.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class CpuDevice:
    """Slots in process memory; experts computed by the native block-float kernels (runtime/cpu/native.py).

    Few tokens per expert (decode): fused GEMVs straight on the tiles, fp32 activations. Many (prefill): the tiles
    expand (exactly) and multiply as matrices in `matmul_dtype`: fp32 (native.packed_linear, the tiles expanded
    panel by panel inside the product; the BLAS on a whole expansion without AVX2), native.BF16X2 (AMX, fp32-grade
    activations; panels as well) or bf16 (the BLAS in bf16 for w1 and w3; w2, whose outputs are partial sums, then
    in fp32).
    """

    name = "cpu"

    def __init__(self, matmul_dtype: torch.dtype | str = torch.float32, slot_fill: str = "map"):
        if slot_fill not in ("map", "copy"):
            raise ValueError(f"slot_fill is map or copy, not {slot_fill!r}")
        self.matmul_dtype = matmul_dtype
        self.slot_fill = slot_fill
        self._read = SplitReader()
        self._mapped: set[int] = set()  # addresses of slots whose pages are the store's (filemap)

    def slot_budget(self) -> int:
        return int(CPU_SLOT_SHARE * host_available())

    def allocate(self, n_slots: int, nbytes: int) -> np.ndarray:
        """uint8 [n_slots, nbytes], page-aligned (huge pages where the host gives them: the GEMV streams the slots),
        touched once so the pool is resident from the start."""
        stride = -(-nbytes // 4096) * 4096
        slots = hugepages.empty(n_slots * stride, own_mapping=self.slot_fill == "map").reshape(n_slots, stride)
        slots.fill(0)
        return slots

    def load(self, slots: np.ndarray, slot: int, fd: int, offset: int, nbytes: int) -> None:
        """Store bytes [offset, offset + nbytes) of fd into the slot: its pages mapped (slot_fill "map", where the
        system and the offset allow it), else copied."""
        row = slots[slot]
        addr = row.ctypes.data
        if self.slot_fill == "map":
            if offset + nbytes > (size := os.fstat(fd).st_size):
                raise OSError(f"expert store ended early at byte {size}")
            was_mapped = addr in self._mapped
            self._mapped.add(addr)  # a read error below leaves the range mapping the file
            if filemap.map_file(addr, filemap.page_round(nbytes), fd, offset):
                return
            if not was_mapped:  # not mapped: the range is still the slot's own memory
                self._mapped.discard(addr)
        if addr in self._mapped:  # a mapped slot, or one that failed to map: writable memory again to copy into
            filemap.map_anon(addr, len(row))
            self._mapped.discard(addr)
        self._read(fd, memoryview(row)[:nbytes], offset)

    def close(self) -> None:
        self._read.close()

    def experts(
        self, slots: np.ndarray, ids: list[int], layout: ShardLayout, x: torch.Tensor, w: torch.Tensor, limit: float
    ) -> torch.Tensor:
        """One token (decode): the whole layer's experts in one native call (native.moe_decode); more: one by one."""
        if x.shape[0] == 1:
            y = native.moe_decode(slots, ids, layout, x, w, limit)
            if y is not None:
                return y[:, : x.shape[1]]
        return expert_sum(self, slots, ids, layout, x, w, limit)

    def routed(
        self,
        slots: np.ndarray,
        ids: list[int],
        layout: ShardLayout,
        x: torch.Tensor,
        route: torch.Tensor,
        w: torch.Tensor,
        limit: float,
    ) -> torch.Tensor | None:
        """Tokens whose products run as GEMVs (a batched decode step's, whatever their count; a verify's few
        positions) in one native call (native.moe_decode_batch), each expert read once for all its tokens; None
        for more (prefill: expert by expert, as matrices) or without kernels."""
        if not rows.is_decoding() and x.shape[0] > gemv_rows(self.matmul_dtype):
            return None
        y = native.moe_decode_batch(slots, ids, layout, x, route, w, limit)
        return None if y is None else y[:, : x.shape[1]]

    def expert(
        self, slots: np.ndarray, slot: int, layout: ShardLayout, x: torch.Tensor, w: torch.Tensor, limit: float
    ) -> torch.Tensor:
        """Routed expert on tokens x [t, d] with routing weights w [t, 1] -> this rank's partial fp32 [t, d]."""
        mem, fmt = slots[slot], layout.fmt

        def view(m: PackedMatrix) -> np.ndarray:
            return mem[m.offset : m.offset + m.nbytes]

        def apply(m: PackedMatrix, a: torch.Tensor, dtype) -> torch.Tensor:
            if a.shape[0] <= gemv_rows(dtype):
                return native.gemv(view(m), (m.rows, m.cols), fmt, a)
            if dtype == native.BF16X2:
                y = native.amx_packed(a, view(m), fmt, (m.rows, m.cols))  # panels expanded where multiplied
                return y if y is not None else native.amx_linear(a, native.dequant_bf16(view(m), (m.rows, m.cols), fmt))
            if dtype == torch.float32:  # panels expanded where multiplied (AVX2 / AVX-512), else the whole matrix
                y = native.packed_linear(a, view(m), fmt, (m.rows, m.cols))
                return y if y is not None else F.linear(a.float(), native.dequant_f32(view(m), (m.rows, m.cols), fmt))
            w = native.dequant_bf16(view(m), (m.rows, m.cols), fmt)
            return F.linear(a.to(torch.bfloat16), w).float()

        # w1 / w3 give whole intermediate rows on every rank; w2's outputs are partial sums: fp32 (TP-invariant)
        g, u = apply(layout.w1, x, self.matmul_dtype), apply(layout.w3, x, self.matmul_dtype)
        h = native.swiglu(g, u, w, limit)  # moe_decode's activation: a batched token gets its solo bits
        if h is None:
            h = swiglu(g, u, limit) * w
        return apply(layout.w2, h, torch.float32 if self.matmul_dtype == torch.bfloat16 else self.matmul_dtype)
