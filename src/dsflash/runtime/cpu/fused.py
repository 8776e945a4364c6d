"""The model's kernel hooks filled for the device: chains of small torch operations a decode step runs many times,
each replaced by one kernel call of the same math.

On the CPU a decode step interleaves those chains with GEMVs that stream hundreds of megabytes: every chain then
starts with cold caches, and torch's dispatch of a single small operation costs 150-350 us there against 1-3 us
warm, where a C function is entered in ~65 us. One call per chain is what pays, more than the arithmetic.
"""

from __future__ import annotations

import torch

from dsflash.model import mhc
from dsflash.model.attention import Attention
from dsflash.model.block import Block
from dsflash.model.compressor import Indexer
from dsflash.model.engram import Engram
from dsflash.model.layers import RMSNorm
from dsflash.model.moe import Gate, SharedExpert
from dsflash.runtime.cpu import native
from dsflash.runtime.cpu.dense import Fp8Weight

FUSED_MIXES_MAX = 1 << 15  # values of x (tokens x hc x d) up to which mHC's mixes run as one C call
ROUTE_MAX_ROWS = 8  # tokens up to which the router runs as one C call


def fill(model: torch.nn.Module, gpu_sinkhorn=None) -> None:
    """Every block's Sinkhorn as one kernel (`gpu_sinkhorn`, the Triton one, for a model on a GPU; C on the CPU),
    the torch version where that is unavailable: same math, a fraction of the launches (it was about a quarter of a
    small model's decode step). On the CPU also: decode's mixing weights (mhc.mixes), the collapse with the norm
    after it, the expansion, the shared expert's FFN, every RMSNorm, the MoE router, the rotary embeddings and
    Engram's gated write, one C call each; and sparse attention and the indexer's scores, each query on its own
    (a query's bits then do not depend on the queries beside it: a verify's positions get the plain steps')."""
    on_gpu = gpu_sinkhorn is not None
    if on_gpu:
        kernel = gpu_sinkhorn
    elif native.lib() is not None:
        kernel = native.sinkhorn
    else:
        return

    def sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        out = kernel(c, iters, eps)
        return mhc.sinkhorn(c, iters, eps) if out is None else out

    def mixes(x: torch.Tensor, *args):
        # one thread's C loop against torch's BLAS: faster up to ~32k values (a token at V4.1's widths, 128 of the
        # embedded model's), slower beyond
        return native.mhc_mixes(x, *args) if x.numel() <= FUSED_MIXES_MAX else None

    for m in model.modules():
        if isinstance(m, Block):
            m.sinkhorn = sinkhorn
    if on_gpu:
        return
    for rope in getattr(model, "ropes", {}).values():
        rope.fused = native.rope_rotate
    for m in model.modules():
        if isinstance(m, Attention):
            m.fused_attention = native.sparse_attention
        elif isinstance(m, Indexer):
            m.fused_scores = native.index_scores
        if isinstance(m, Block):
            m.fused_mixes = mixes
            m.fused_collapse_norm = native.hc_collapse_norm
            m.fused_expand = native.hc_expand
        elif isinstance(m, SharedExpert):
            m.fused = _ffn(m)
        elif isinstance(m, RMSNorm):
            m.fused = native.rms_norm
        elif isinstance(m, Gate):
            m.fused = _route
        elif isinstance(m, Engram):
            m.fused = native.engram_gate


def _ffn(m: SharedExpert):
    """A decode row through the shared expert in one call where its three matrices are FP8 blocks, else None."""
    w1, w3, w2 = (lin.packed for lin in (m.w1, m.w3, m.w2))
    if not all(isinstance(w, Fp8Weight) for w in (w1, w3, w2)) or len({w.block for w in (w1, w3, w2)}) != 1:
        return None

    def ffn(x: torch.Tensor) -> torch.Tensor | None:
        if x.shape[0] == 1:
            return native.fp8_ffn_decode(w1.q, w1.scale256, w3.q, w3.scale256, w2.q, w2.scale256, w1.block, x, m.limit)
        if x.shape[0] > native.SWIGLU_MAX_ROWS:
            return None
        # a batched decode step's rows: the one-call form's activation on the same products, so each row has the
        # bits it has alone (libm's expf and torch's vectorised silu differ by an ulp, which a tiny model amplifies)
        g, u = m.w1(x), m.w3(x)
        h = native.swiglu(g.float(), u, torch.ones(x.shape[0], 1), m.limit)
        return None if h is None else m.w2(h).float()

    return ffn


def _route(g: Gate, x: torch.Tensor):
    # its products run dot by dot: a prefill chunk's are the BLAS's job (128 tokens x 256 experts: 12 ms against ~1)
    if x.shape[0] > ROUTE_MAX_ROWS:
        return None
    return native.moe_route(x, g.weight, g.bias, g.temp, g.score_func, g.topk, g.norm_topk, g.route_scale)
