"""The engine's dense weights: FP8 blocks where the checkpoint has FP8, bfloat16 elsewhere; fp32 products.

Both formats hold the checkpoint's values exactly (FP8 x power-of-two block scale; BF16). Few rows (decode) run
the native GEMV kernels: fp32 activations, fp32 products, about one read of the weight. Many rows (prefill) expand
the weight and multiply as matrices, in the prefill matmul mode (runtime.spec.EngineSpec): bf16x2 on AMX (x as
two bf16 terms, fp32 sums in a fixed order per output; FP8 expands panel by panel inside the product), fp32
(native.packed_linear: panels expanded inside the product, fp32 sums in a fixed order per output, on AVX2 /
AVX-512 F; else the BLAS on a whole expansion), or bf16 on the BLAS where every rank computes whole outputs (fp32
where a rank produces partial sums). fp32 and bf16x2 runs at any TP degree differ from a TP-1 run only in the order
partial sums are added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsflash.formats import fp8
from dsflash.model.block import Head
from dsflash.model.layers import Linear, RowParallelLinear
from dsflash.runtime.cpu import hugepages, native, rows

GEMV_MAX_ROWS = 8  # more rows are multiplied as matrices
# where the matrices are multiplied on AMX (bf16x2), the GEMV is faster only for fewer rows (2 cores, 4096 x 5120:
# FP8 level at 4 rows, AMX 1.2x faster at 6 and 2.7x at 16; bf16 AMX faster from 2 rows)
AMX_GEMV_MAX_ROWS = {"fp8": 4, "bf16": 1}


def _gemv_rows(matmul, fmt: str) -> int:
    if matmul == native.BF16X2 and native.amx_ready() and not rows.is_decoding():
        return AMX_GEMV_MAX_ROWS[fmt]
    return native.fp8_gemv_max_rows(GEMV_MAX_ROWS) if fmt == "fp8" else GEMV_MAX_ROWS


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


def _matmul(flat: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return F.linear(flat.to(dtype), w.to(dtype)).float()


class Fp8Weight:
    """FP8 E4M3 [O, I] with one power-of-two scale per block x block tile."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        block: int,
        matmul: torch.dtype | str = torch.float32,
        scale256: torch.Tensor | None = None,
    ):
        self.q, self.block, self.matmul = q, block, matmul
        self.scale = scale  # fp32 [ceil(O/B), ceil(I/B)]
        # the kernel's decode leaves a 2^-8 for the scale to undo
        self.scale256 = (scale * 256).contiguous() if scale256 is None else scale256

    @classmethod
    def exact(cls, w: torch.Tensor, block: int, matmul: torch.dtype | str = torch.float32) -> Fp8Weight | None:
        """Quantize a weight that came from FP8 blocks; None if that does not reproduce it exactly."""
        q, s = fp8.quant_block(w.float(), block)
        s = s.float()
        if not torch.equal(fp8.dequant_block(q, s, block), w.float()):
            return None
        return cls(q.view(torch.uint8).contiguous(), s, block, matmul)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        flat, lead = _rows(x)
        if flat.shape[0] <= _gemv_rows(self.matmul, "fp8"):
            y = native.fp8_gemv(self.q, self.scale256, self.block, flat)
            if y is not None:
                return y.view(*lead, -1)
        amx = self.matmul == native.BF16X2
        if amx:  # each 32-row panel expanded where it is multiplied, not the whole matrix through memory first
            y = native.amx_packed(flat, self.q, "fp8", tuple(self.q.shape), self.scale256, self.block)
            if y is not None:
                return y.view(*lead, -1)
        if self.matmul == torch.float32:  # the same, for the fp32 product (AVX2 / AVX-512 F)
            y = native.packed_linear(flat, self.q, "fp8", tuple(self.q.shape), self.scale256, self.block)
            if y is not None:
                return y.view(*lead, -1)
        w = native.fp8_dequant(self.q, self.scale256, self.block, torch.bfloat16 if amx else self.matmul)
        if amx:
            return native.amx_linear(flat, w).view(*lead, -1)
        if w is None:
            w = fp8.dequant_block(self.q.view(torch.float8_e4m3fn), self.scale, self.block)
        return _matmul(flat, w, self.matmul).view(*lead, -1)

    @classmethod
    def quantized(cls, w: torch.Tensor, block: int, matmul: torch.dtype | str = torch.float32) -> Fp8Weight:
        """Round any weight to FP8 blocks (power-of-two scale from each block's largest magnitude), a slice of
        rows at a time: no fp32 copy of a whole vocabulary-sized matrix."""
        step = block * max(1, (1 << 26) // (block * max(1, w.shape[1])))  # ~256 MB of fp32 at a time
        qs, ss = [], []
        for r in range(0, w.shape[0], step):
            q, s = fp8.quant_block(w[r : r + step], block)
            qs.append(q.view(torch.uint8))
            ss.append(s.float())
        return cls(torch.cat(qs).contiguous(), torch.cat(ss), block, matmul)

    def grouped(self, x: torch.Tensor, groups: int) -> torch.Tensor | None:
        """Block-diagonal use (layers.Linear.grouped) of one decode row, x [..., groups, I], in one kernel call;
        None where that does not apply (more rows, no kernels): the caller multiplies group by group."""
        if x[..., 0, 0].numel() != 1 or self.q.shape[0] % groups:
            return None
        y = native.fp8_gemv_grouped(self.q, self.scale256, self.block, x.reshape(groups, -1))
        return None if y is None else y.view(*x.shape[:-1], -1)

    def rows(self, start: int, stop: int) -> Fp8Weight:
        if start % self.block or (stop % self.block and stop != self.q.shape[0]):
            raise ValueError(f"rows {start}:{stop} do not follow the {self.block}-row scale blocks")
        b0, b1 = start // self.block, -(-stop // self.block)
        # a grouped projection takes its groups every step: views only, no arithmetic
        return type(self)(self.q[start:stop], self.scale[b0:b1], self.block, self.matmul, self.scale256[b0:b1])


class Bf16Weight:
    def __init__(self, w: torch.Tensor, matmul: torch.dtype | str = torch.float32):
        self.w, self.matmul = w.to(torch.bfloat16).contiguous(), matmul

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        flat, lead = _rows(x)
        if flat.shape[0] <= _gemv_rows(self.matmul, "bf16"):
            y = native.bf16_gemv(self.w, flat)
            if y is not None:
                return y.view(*lead, -1)
        if self.matmul == native.BF16X2:
            return native.amx_linear(flat, self.w).view(*lead, -1)
        if self.matmul == torch.float32:  # rows widened to fp32 where multiplied, not the whole matrix first
            y = native.packed_linear(flat, self.w, "bf16", tuple(self.w.shape))
            if y is not None:
                return y.view(*lead, -1)
        return _matmul(flat, self.w, self.matmul).view(*lead, -1)

    def rows(self, start: int, stop: int) -> Bf16Weight:
        return type(self)(self.w[start:stop], self.matmul)


# decode logits rows re-scored from the bf16 head (ScreenedHead): twice the top-logprobs the API returns (20), so
# the sampled token, its alternatives and most of a sampling distribution's mass carry the bf16 head's bits
HEAD_EXACT = 64
# a head below this many bf16 bytes a rank is not screened: it sits in the caches, and the screen's top-k and
# re-scoring would cost more than its reads (the tiny fixtures' heads are 128-192 KB; V4.1's 1.3 GB at TP 1)
SCREEN_HEAD_MIN_BYTES = 64 << 20


class ScreenedHead:
    """The vocabulary head with an FP8 screen for decode: few rows score the whole vocabulary from an FP8 copy of
    the bf16 weight (half the bytes; the head is the largest matrix a decode step reads), then the HEAD_EXACT
    highest are re-scored from the bf16 rows: the same bits the bf16 GEMV gives them. Only the tail (tokens
    outside the top HEAD_EXACT) keeps FP8-rounded weights, where an error changes a tiny probability and the
    softmax's sum a little. Many rows (prefill) multiply the bf16 weight.

    The screened set is the same at every TP degree: it is chosen on the gathered screen logits (the FP8 rows'
    results do not depend on the shard), each rank re-scores the candidates it holds, and one sum over ranks
    (every candidate has exactly one non-zero contribution) gives all ranks the same values."""

    def __init__(self, w: torch.Tensor, block: int, matmul: torch.dtype | str = torch.float32):
        self.exact = Bf16Weight(w, matmul)
        self.screen = Fp8Weight.quantized(self.exact.w, block, matmul)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return self.exact.linear(x)

    def rows(self, start: int, stop: int) -> Bf16Weight:
        return self.exact.rows(start, stop)

    def logits(self, x: torch.Tensor, tp, vocab: int) -> torch.Tensor:
        """x [..., d] -> fp32 logits [..., vocab], gathered over tp's ranks (each holds a vocabulary slice)."""
        flat, lead = _rows(x)
        screen = None
        if flat.shape[0] <= min(_gemv_rows(self.screen.matmul, "fp8"), GEMV_MAX_ROWS):  # decode steps only
            screen = native.fp8_gemv(self.screen.q, self.screen.scale256, self.screen.block, flat)
        if screen is None:
            return tp.all_gather_last(self.exact.linear(flat))[:, :vocab].view(*lead, vocab)
        logits = tp.all_gather_last(screen)[:, :vocab].contiguous()  # padding past the vocabulary never competes
        top = native.top_indices(logits, HEAD_EXACT)
        part = screen.shape[-1]
        exact = torch.zeros(top.shape, dtype=torch.float32)
        for r in range(flat.shape[0]):
            mine = (top[r] // part == tp.rank).nonzero().squeeze(-1)
            if mine.numel():
                exact[r, mine] = native.bf16_gemv_rows(self.exact.w, top[r, mine] - tp.rank * part, flat[r])
        logits.scatter_(-1, top, tp.all_reduce(exact))
        return logits.view(*lead, vocab)


def pack_dense(
    model: nn.Module,
    ckpt,
    fmt: str = "fp8",
    matmul: torch.dtype | str = torch.float32,
    huge_pages: bool = True,
    screen_head: bool | None = None,
) -> int:
    """Replace every matrix of `model` by its device format; returns the bytes the packed weights hold.

    fmt "fp8": FP8 where the checkpoint stores FP8, bf16 elsewhere, and the head (bf16 in the checkpoint) with an
    FP8 screen for decode (ScreenedHead) where `screen_head` says (None: a head of at least SCREEN_HEAD_MIN_BYTES).
    fmt "bf16": bf16 everywhere.
    matmul: the prefill product mode, torch.float32, native.BF16X2, or torch.bfloat16 (only where a rank computes
    whole outputs: partial sums then run in fp32).
    """
    block = ckpt.config.fp8_block
    total = 0
    for name, m in model.named_modules():
        if not isinstance(m, Linear | Head):
            continue
        # row-parallel layers and the grouped wo_a (a group may straddle ranks) sum partial products: fp32-grade
        partial = isinstance(m, RowParallelLinear) or name.endswith(".wo_a")
        dtype = torch.float32 if partial and matmul == torch.bfloat16 else matmul
        packed = None
        stored = ckpt.entry(f"{name}.weight").dtype if f"{name}.weight" in ckpt else None
        if fmt == "fp8" and stored == "F8_E4M3":
            packed = Fp8Weight.exact(m.weight.data, block, dtype)
        if packed is None and isinstance(m, Head) and fmt == "fp8" and _screens(m.weight, screen_head):
            packed = ScreenedHead(m.weight.data, block, dtype)
        if packed is None:
            packed = Bf16Weight(m.weight.data, dtype)
        if huge_pages:  # the host's kernels stream them; weights bound for a GPU skip the copy
            _to_huge_pages(packed)
        m.packed = packed
        m.weight.data = torch.empty(0)  # the packed copy is the weight now
        total += _nbytes(packed)
    return total


def _screens(w: torch.Tensor, screen_head: bool | None) -> bool:
    if native.lib() is None:  # no FP8 GEMV to screen with
        return False
    return w.numel() * 2 >= SCREEN_HEAD_MIN_BYTES if screen_head is None else screen_head


def _to_huge_pages(p) -> None:
    """The packed matrix off the checkpoint's mapping (or a 4 KiB-page copy) into huge pages, once: the decode GEMV
    streams it (runtime/cpu/hugepages.py). Row slices of it (rows(), a grouped projection's groups) are views."""
    if isinstance(p, ScreenedHead):  # decode reads the screen; the bf16 rows only where re-scored (or prefill)
        p.screen.q = hugepages.copy(p.screen.q)
    elif isinstance(p, Fp8Weight):
        p.q = hugepages.copy(p.q)
    else:
        p.w = hugepages.copy(p.w)


def decode_bytes(model: nn.Module) -> int:
    """Bytes of the packed weights one decode step reads: a screened head's FP8 copy and the bf16 rows it
    re-scores, not its whole bf16 matrix (which only prefill multiplies)."""
    total = 0
    for m in model.modules():
        p = getattr(m, "packed", None)
        if isinstance(p, ScreenedHead):
            total += _nbytes(p.screen) + HEAD_EXACT * p.exact.w.shape[1] * 2
        elif p is not None:
            total += _nbytes(p)
    return total


def _nbytes(p) -> int:
    if isinstance(p, ScreenedHead):
        return _nbytes(p.exact) + _nbytes(p.screen)
    if isinstance(p, Fp8Weight):
        return p.q.numel() + p.scale.numel() * 4
    return p.w.numel() * 2
