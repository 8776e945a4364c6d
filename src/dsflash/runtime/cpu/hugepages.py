"""Host memory for the weights the decode kernels stream: anonymous, 2 MiB-aligned, advised for transparent huge
pages.

A decode GEMV reads several rows (or tiles) at once, each stream crossing a 4 KiB page every few hundred bytes; on
4 KiB pages the TLB misses cost a fifth of the time (the 1.3 GB bf16 head of V4.1: 55-56 ms on the checkpoint's
mapping or a plain copy, 46 ms on huge pages, 2 cores). Where the kernel does not do THP for madvised memory
(`/sys/kernel/mm/transparent_hugepage/enabled` = never) this is ordinary memory.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch

PAGE = 4096
HUGE = 2 << 20
MIN_BYTES = 4 << 20  # smaller buffers gain nothing measurable and would round up to a huge page


def empty(nbytes: int, own_mapping: bool = False) -> np.ndarray:
    """uint8 [nbytes], zero-filled, page-aligned; huge-page aligned and advised when at least MIN_BYTES.

    own_mapping: always a mapping of its own, never heap memory, whatever the size (its pages may then be replaced,
    runtime/experts/filemap.py, without touching anything the allocator hands out again)."""
    if nbytes < MIN_BYTES and not own_mapping:
        raw = np.zeros(nbytes + PAGE, dtype=np.uint8)
        start = -raw.ctypes.data % PAGE
        return raw[start : start + nbytes]
    huge = nbytes >= MIN_BYTES
    buf = mmap.mmap(-1, nbytes + (HUGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(buf, dtype=np.uint8)  # holds the mapping for as long as any view of it lives
    start = -raw.ctypes.data % (HUGE if huge else PAGE)
    return raw[start : start + nbytes]


def copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of host tensor t in huge-page memory (t itself, made contiguous, when small or not on the
    host: a GPU weight stays where it is)."""
    nbytes = t.numel() * t.element_size()
    if nbytes < MIN_BYTES or t.device.type != "cpu":
        return t.contiguous()
    out = torch.from_numpy(empty(nbytes)).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
