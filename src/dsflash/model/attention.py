"""Shared-KV MQA over a sliding window plus shared compressed KV, with a sink (arch §4.4, §5.3)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dsflash.config import LayerSpec, ModelConfig
from dsflash.errors import ConfigError
from dsflash.formats import fp4, fp8
from dsflash.model.compressor import Compressor, Indexer, group_range
from dsflash.model.layers import ColumnParallelLinear, Linear, RMSNorm, Rope, RowParallelLinear, _param
from dsflash.model.parallel import TP
from dsflash.model.state import DecodeState, LayerState

# bound on the gathered [queries, selected, head_dim] block in sparse attention
_GATHER_BUDGET = 1 << 24


@dataclass
class Step:
    """One forward call: positions, state, and what earlier layers published for later ones.

    A static step (start_pos None) is one token whose position is only the device tensor `positions` [1]: every
    shape is fixed and no value travels to the host, so the same calls serve any position (a captured CUDA graph
    replays them). It attends over the whole window ring and the whole compressed cache with masks instead of
    slicing what is visible; the results equal the dynamic step's to float rounding."""

    start_pos: int | None
    length: int
    state: DecodeState
    qat: bool = True
    positions: torch.Tensor = None  # [s] absolute positions of this chunk
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index-source layer -> [b, s, k]
    candidates: torch.Tensor | None = None  # [b, s, n_compressed] from the candidate source
    trace: dict | None = None

    @property
    def static(self) -> bool:
        return self.start_pos is None

    @property
    def end(self) -> int:
        return self.start_pos + self.length


@dataclass
class BatchStep:
    """One decode token of each of several sequences, each at its own position over its own state: the dense parts
    see the tokens as one chunk [1, B] (one pass over their weights), attention runs per sequence (`steps[i]`)."""

    steps: list[Step]
    positions: torch.Tensor  # [B] each token's absolute position
    trace: dict | None = None
    static: bool = False


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float):
    """q [b, s, h, d], kv [b, n, d] (K = V), sink [h], idx [b, s, k] (-1 = none) -> [b, s, h, d].

    Softmax over the selected rows with the per-head sink logit in the denominator only.
    """
    b, s, h, d = q.shape
    if kv.shape[1] <= 2 * idx.shape[-1] and b * s * h * kv.shape[1] <= _GATHER_BUDGET:
        return _dense_attention(q, kv, sink, idx, scale)
    out = torch.empty(b, s, h, d, dtype=torch.float32, device=q.device)
    step = max(1, _GATHER_BUDGET // max(1, b * idx.shape[-1] * d))
    batch, kv = torch.arange(b, device=q.device).view(b, 1, 1), kv.float()
    for i in range(0, s, step):
        sl = idx[:, i : i + step].long()
        rows = kv[batch, sl.clamp_min(0)]  # [b, c, k, d]
        logits = torch.einsum("bchd,bckd->bchk", q[:, i : i + step].float(), rows)
        p, denom = _sink_softmax(logits, sl >= 0, sink, scale)
        out[:, i : i + step] = torch.einsum("bchk,bckd->bchd", p, rows) / denom.unsqueeze(-1)
    return out.to(q.dtype)


def _dense_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float):
    """sparse_attention where the selection covers most rows (a short context, a verify's few queries over the
    same window): every query against every row, the selected logits picked out and the weights scattered back,
    instead of a [k, d] copy of the rows per query."""
    b, s, h, _ = q.shape
    rows = kv.float()
    sel = idx.long()
    at = sel.clamp_min(0).unsqueeze(2).expand(b, s, h, sel.shape[-1])
    logits = torch.einsum("bshd,bnd->bshn", q.float(), rows).gather(-1, at)
    p, denom = _sink_softmax(logits, sel >= 0, sink, scale)  # p is 0 where not selected: its scatter adds nothing
    weights = torch.zeros(b, s, h, rows.shape[1], dtype=torch.float32, device=q.device).scatter_add_(-1, at, p)
    return (torch.einsum("bshn,bnd->bshd", weights, rows) / denom.unsqueeze(-1)).to(q.dtype)


def _sink_softmax(logits: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float):
    """logits [b, s, h, k] of the selected rows, valid [b, s, k] -> (unnormalised weights, their denominator with
    the per-head sink's mass)."""
    logits = torch.where(valid.unsqueeze(2), logits, -torch.inf) * scale
    top = logits.amax(dim=-1, keepdim=True).clamp_min(-1e30)
    p = torch.exp(logits - top)
    return p, p.sum(dim=-1) + torch.exp(sink.float().view(1, 1, logits.shape[2]) - top.squeeze(-1))


def _group(step: Step, r: int) -> int | torch.Tensor:
    """The first group a step's latents belong to (a static step's open group, complete or not)."""
    return step.positions // r if step.static else step.start_pos // r


def static_window_rows(ring: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at device position pos [1]: its kv written into the ring [b, W, d], then the whole ring and which
    slots it may attend to (those already written: the ring keeps exactly the last W positions)."""
    b, W = kv.shape[0], ring.shape[1]
    ring[:b].index_copy_(1, pos % W, kv.to(ring.dtype))
    slot = torch.arange(W, device=kv.device)
    held = pos - (pos - slot) % W  # the newest position congruent to each slot; negative: never written
    idx = torch.where(held >= 0, slot, -1)
    return ring[:b].to(kv.dtype), idx.view(1, 1, W).expand(b, -1, -1)


def window_indices(start_pos: int, length: int, n_prev: int, window: int, device) -> torch.Tensor:
    """Rows of [previous n_prev window rows ; this chunk] each query sees: its last `window` positions. Only as
    many columns as there are rows: early in a sequence a window-wide index would gather mostly nothing."""
    width = min(window, n_prev + length)
    last = n_prev + torch.arange(length, device=device).unsqueeze(1)  # query's own row
    idx = last - width + 1 + torch.arange(width, device=device)
    return torch.where(idx < 0, -1, idx)


def ring_read(ring: torch.Tensor, start_pos: int, n: int) -> torch.Tensor:
    """The n positions before start_pos from a ring [b, W, d], oldest first."""
    slots = torch.arange(start_pos - n, start_pos, device=ring.device) % ring.shape[1]
    return ring[:, slots]


def ring_write(ring: torch.Tensor, kv: torch.Tensor, start_pos: int) -> None:
    """Store kv [b, s, d] for positions start_pos.. into the ring (only the last W survive)."""
    W, s = ring.shape[1], kv.shape[1]
    keep = min(W, s)
    slots = torch.arange(start_pos + s - keep, start_pos + s, device=ring.device) % W
    ring[: kv.shape[0], slots] = kv[:, s - keep :].to(ring.dtype)


def _token(proj, i: int):
    """Token i's rows of a batched step's projections (a tuple of [1, B, ...] tensors or None), or None."""
    return None if proj is None else tuple(None if t is None else t[:, i : i + 1] for t in proj)


class Attention(nn.Module):
    """Low-rank Q, one shared K=V head, grouped low-rank output; compressed KV on ratio > 0 layers."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, tp: TP, rope: Rope):
        super().__init__()
        self.spec, self.tp, self.rope = spec, tp, rope
        H, G, hd = cfg.num_attention_heads, cfg.o_groups, cfg.head_dim
        if H % tp.size:
            raise ConfigError(f"tensor-parallel degree {tp.size} does not divide the {H} attention heads")
        self.n_local, self.head_dim, self.window = H // tp.size, hd, cfg.sliding_window
        self.o_lora_rank, self.scale = cfg.o_lora_rank, hd**-0.5
        # this rank's heads, and the output groups they touch: a group split over two ranks gets a partial
        # projection on each, which the wo_b all-reduce sums (so any degree dividing H works, not only G's)
        h0, per_group = tp.rank * self.n_local, H // G
        g0, g1 = h0 // per_group, -(-(h0 + self.n_local) // per_group)
        self.groups_local, self.per_group = g1 - g0, per_group
        self.head_slot = torch.arange(h0, h0 + self.n_local) - g0 * per_group
        group_rows = (torch.arange(g0, g1).unsqueeze(1) * cfg.o_lora_rank + torch.arange(cfg.o_lora_rank)).flatten()
        self.attn_sink = _param(self.n_local, shard={0: torch.arange(h0, h0 + self.n_local)})
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, H * hd, tp)
        self.wkv = Linear(cfg.hidden_size, hd)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        # block diagonal over groups (each group projects only its own heads), applied as an einsum
        self.wo_a = Linear(per_group * hd, group_rows.numel(), shard={0: group_rows})
        self.wo_b = RowParallelLinear(G * cfg.o_lora_rank, cfg.hidden_size, tp, cols=group_rows)
        if spec.is_kv_source:
            self.compressor = Compressor(cfg, spec.ratio)
        if spec.is_index_source:
            self.indexer = Indexer(cfg, spec, tp)
        # a runtime's kernel of sparse_attention (same math, each query on its own: a query's bits then do not
        # depend on the queries beside it), returning None where it does not apply; None: torch's
        self.fused_attention = None

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [b, s, d] -> [b, s, d] (a BatchStep: x [1, B, d], token i of sequence step.steps[i])"""
        if isinstance(step, BatchStep):
            return self.forward_batch(x, step)
        cis = self.rope.cis(step.positions)
        q, qr = self.queries(x, cis)
        kv = self.window_kv(x, cis, step.qat)
        kv, idx = self.window_rows(kv, step)
        if self.spec.ratio:
            ckv, cidx = self.compressed_rows(x, qr, step, offset=kv.shape[1])
            kv, idx = torch.cat([kv, ckv], dim=1), torch.cat([idx, cidx], dim=-1)
        o = self.attend(q, kv, idx)
        return self.output(self.rope.rotate(o, cis, inverse=True))

    def attend(self, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        o = self.fused_attention(q, kv, self.attn_sink, idx, self.scale) if self.fused_attention else None
        return sparse_attention(q, kv, self.attn_sink, idx, self.scale) if o is None else o

    def forward_batch(self, x: torch.Tensor, batch: BatchStep) -> torch.Tensor:
        """x [1, B, d]: the projections over all B tokens at once, the attention of each over its own state."""
        cis = self.rope.cis(batch.positions)
        q, qr = self.queries(x, cis)
        kv_all = self.window_kv(x, cis, batch.steps[0].qat)
        # the compressor's and the indexer's projections of all B tokens in one product each; their pooling,
        # scoring and selection then run per sequence over its own state
        spec = self.spec
        comp = self.compressor.project(x) if spec.ratio and spec.is_kv_source else None
        index = self.indexer.project(x, qr) if spec.ratio and spec.is_index_source else None
        outs = []
        for i, step in enumerate(batch.steps):
            kv, idx = self.window_rows(kv_all[:, i : i + 1], step)
            if self.spec.ratio:
                ckv, cidx = self.compressed_rows(x[:, i : i + 1], qr[:, i : i + 1], step, offset=kv.shape[1],
                                                 proj=(_token(comp, i), _token(index, i)))  # fmt: skip
                kv, idx = torch.cat([kv, ckv], dim=1), torch.cat([idx, cidx], dim=-1)
            outs.append(self.attend(q[:, i : i + 1], kv, idx))
        return self.output(self.rope.rotate(torch.cat(outs, dim=1), cis, inverse=True))

    def queries(self, x: torch.Tensor, cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotated queries [b, s, heads, head_dim], the normed low-rank query qr, which the indexer reads too)"""
        qr = self.q_norm(self.wq_a(x))
        return self.rope.rotate(self.wq_b(qr).unflatten(-1, (self.n_local, self.head_dim)), cis), qr

    def window_kv(self, x: torch.Tensor, cis: torch.Tensor, qat: bool) -> torch.Tensor:
        kv = self.rope.rotate(self.kv_norm(self.wkv(x)), cis)
        # V4.1 keeps the window KV in FP8 over the whole vector, rotary tail included
        return fp8.qdq(kv, 32) if qat else kv

    def window_rows(self, kv: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """[earlier window rows ; this chunk's kv] and each query's window indices into it."""
        ring = step.state.layers[self.spec.layer_id].window
        if step.static:
            return static_window_rows(ring, kv, step.positions)
        n_prev = min(self.window, step.start_pos)
        rows = torch.cat([ring_read(ring, step.start_pos, n_prev)[: kv.shape[0]].to(kv.dtype), kv], dim=1)
        ring_write(ring, kv, step.start_pos)
        idx = window_indices(step.start_pos, step.length, n_prev, self.window, kv.device)
        return rows, idx.unsqueeze(0).expand(kv.shape[0], -1, -1)

    def compressed_rows(self, x, qr, step: Step, offset: int, proj=(None, None)) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared compressed KV visible to this chunk, and each query's selected entries (+offset). proj: the
        compressor's and the indexer's projections of x where the caller computed them (else None)."""
        spec, layers = self.spec, step.state.layers
        r, b = spec.ratio, x.shape[0]
        latent = None
        if spec.is_kv_source:
            st, c = layers[spec.layer_id], self.compressor
            latent = c.static(x, step.positions, st) if step.static else c(x, step.start_pos, st, proj[0])
        if spec.is_index_source:
            idx = self.select(x, qr, latent, step, offset, proj[1])
            step.topk[spec.layer_id] = idx
        else:
            idx = step.topk[spec.topk_source]
        if latent is not None:
            self.store_latent(latent, _group(step, r), layers[spec.layer_id], step.qat)
        # a static step reads the whole cache: entries not complete yet are never selected
        n_visible = None if step.static else step.end // r
        return layers[spec.kv_source].compressed[:b, :n_visible], idx

    def select(self, x, qr, latent, step: Step, offset: int, proj=None) -> torch.Tensor:
        spec, ix = self.spec, self.indexer
        if not step.static and step.end // spec.ratio == 0:
            return torch.empty(x.shape[0], step.length, 0, dtype=torch.long, device=x.device)
        if latent is not None:  # the indexer needs the latent before RoPE and quantization
            ix.write_keys(latent, _group(step, spec.ratio), self.rope, step.state.layers[spec.layer_id], step.qat)
        n_keys = None if step.static else step.end // spec.ratio
        keys = step.state.layers[spec.kv_source].index_keys[: x.shape[0], :n_keys]
        s, visible = ix.scores(x, qr, keys, step.positions, self.rope, step.qat, proj)
        if spec.is_candidate_source:
            step.candidates = ix.candidates(s, visible)
            if step.trace is not None:
                step.trace["candidate_mask"] = step.candidates
        elif spec.uses_candidates:
            s = s.masked_fill(~step.candidates, -torch.inf)
        idx = ix.select_static(s, visible, offset) if step.static else ix.select(s, visible, step.end, offset)
        if step.trace is not None:
            step.trace.setdefault("index_topk", {})[spec.layer_id] = torch.where(idx >= 0, idx - offset, -1)
        return idx

    def store_latent(self, latent: torch.Tensor, group0: int | torch.Tensor, st: LayerState, qat: bool) -> None:
        r, groups = self.spec.ratio, group_range(group0, latent.shape[1], latent.device)
        latent = self.rope.rotate(latent, self.rope.cis(r * groups))
        if qat:  # compressed KV: FP4 in groups of 16 with E4M3 scales
            latent = fp4.qdq(latent, 16, e4m3_scale=True)
        st.compressed[: latent.shape[0]].index_copy_(1, groups, latent.to(st.compressed.dtype))

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output projection. o [b, s, h, hd] -> [b, s, d]"""
        b, s = o.shape[:2]
        if self.groups_local * self.per_group != self.n_local:  # heads of groups held by other ranks count as 0
            full = o.new_zeros(b, s, self.groups_local * self.per_group, self.head_dim)
            if self.head_slot.device != o.device:  # once: a captured step may not copy from the host
                self.head_slot = self.head_slot.to(o.device)
            o = full.index_copy(2, self.head_slot, o)
        u = self.wo_a.grouped(o.reshape(b, s, self.groups_local, -1), self.groups_local)
        return self.wo_b(u.flatten(2))
