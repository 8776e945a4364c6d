"""KV compressor and the two-level lightning indexer of V4.1 (arch §5.4, §5.5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsflash.config import LayerSpec, ModelConfig
from dsflash.formats import fp4
from dsflash.model.layers import ColumnParallelLinear, Linear, RMSNorm, Rope
from dsflash.model.parallel import TP
from dsflash.model.state import LayerState


def group_range(group0: int | torch.Tensor, n: int, device) -> torch.Tensor:
    """The compressed groups group0.. [n]; a device tensor group0 [1] (a static step) is one group already."""
    if isinstance(group0, torch.Tensor):
        return group0
    return torch.arange(group0, group0 + n, device=device)


class Compressor(nn.Module):
    """Pools `ratio` consecutive tokens into one normalised latent (pre-RoPE). Only KV-source layers own one."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(cfg.hidden_size, cfg.head_dim)
        if ratio > 1:
            self.wgate = Linear(cfg.hidden_size, cfg.head_dim)
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunk's projections that forward() pools: (kv, gate scores; None at ratio 1). A batched decode step
        computes them for all its tokens in one product and hands each sequence its row."""
        if self.ratio == 1:
            return self.wkv(x), None
        return self.wkv(x.float()), self.wgate(x.float())

    def forward(self, x: torch.Tensor, start_pos: int, st: LayerState, proj=None) -> torch.Tensor | None:
        """x [b, s, d] -> latents [b, n, hd] of the groups completed by this chunk, or None. proj: project(x)
        where the caller computed it already."""
        r = self.ratio
        kv, score = self.project(x) if proj is None else proj
        if r == 1:  # every token is its own group: no gate, no pooling
            return self.norm(kv)
        done = start_pos % r  # tokens of the open group already seen
        kv = torch.cat([st.pending_kv[: x.shape[0], :done], kv], dim=1)
        score = torch.cat([st.pending_score[: x.shape[0], :done], score], dim=1)
        if st.journal is not None:  # a speculative verify: a rollback rebuilds the pending group from these
            st.journal.append((start_pos - done, kv, score))
        full = kv.shape[1] // r * r
        st.pending_kv[: x.shape[0], : kv.shape[1] - full] = kv[:, full:]
        st.pending_score[: x.shape[0], : kv.shape[1] - full] = score[:, full:]
        if full == 0:
            return None
        kv, score = kv[:, :full].unflatten(1, (-1, r)), score[:, :full].unflatten(1, (-1, r))
        # an independent softmax per channel over the group's tokens
        pooled = (kv * score.softmax(dim=2)).sum(dim=2)
        return self.norm(pooled.to(x.dtype))

    def static(self, x: torch.Tensor, pos: torch.Tensor, st: LayerState) -> torch.Tensor:
        """One token x [b, 1, d] at device position pos [1] (attention.Step.static) -> the latent [b, 1, hd] of
        its group pooled over the tokens seen so far: the group's final latent when pos completes it; before that
        a value no query can select yet (its group is not visible), overwritten on the group's next token."""
        r, b = self.ratio, x.shape[0]
        if r == 1:
            return self.norm(self.wkv(x))
        slot = pos % r
        st.pending_kv[:b].index_copy_(1, slot, self.wkv(x.float()))
        st.pending_score[:b].index_copy_(1, slot, self.wgate(x.float()))
        seen = (torch.arange(r, device=x.device) <= slot).view(1, r, 1)
        score = st.pending_score[:b].masked_fill(~seen, -torch.inf)
        pooled = (st.pending_kv[:b] * score.softmax(dim=1)).sum(dim=1, keepdim=True)
        return self.norm(pooled.to(x.dtype))


class Indexer(nn.Module):
    """Scores the compressed positions for every query and keeps the top `index_topk` (arch §5.5).

    Key side only on KV-source layers (wk, k_norm); query side on every index-source layer.
    """

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, tp: TP):
        super().__init__()
        self.spec, self.tp = spec, tp
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.topk = cfg.index_topk
        self.block_size, self.topk_blocks = cfg.candidate_block_size, cfg.candidate_topk_blocks
        # heads split over ranks when they divide evenly (scores are then all-reduced), else replicated
        self.split = tp.size > 1 and cfg.index_n_heads % tp.size == 0
        self.n_local = cfg.index_n_heads // tp.size if self.split else cfg.index_n_heads
        q_out, w_out = cfg.index_n_heads * cfg.index_head_dim, cfg.index_n_heads
        if self.split:
            self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, q_out, tp)
            self.weights_proj = ColumnParallelLinear(cfg.hidden_size, w_out, tp)
        else:
            self.wq_b, self.weights_proj = Linear(cfg.q_lora_rank, q_out), Linear(cfg.hidden_size, w_out)
        if spec.is_kv_source:
            self.wk = Linear(cfg.head_dim, cfg.index_head_dim)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps)
        # a runtime's kernel of the scores' sum over heads (q, keys, w) -> [b, s, t], each query on its own, or None
        # where it does not apply; None: torch's
        self.fused_scores = None

    def write_keys(self, latent: torch.Tensor, group0: int | torch.Tensor, rope: Rope, st: LayerState, qat: bool):
        """Index keys of new latents [b, n, hd] (pre-RoPE), rotated at their group's first token (group0: an int,
        or a static step's device tensor [1])."""
        r = self.spec.ratio
        k = self.k_norm(self.wk(latent))
        groups = group_range(group0, k.shape[1], k.device)
        k = rope.rotate(k, rope.cis(r * groups))
        if qat:
            k = fp4.qdq(k, 32)
        st.index_keys[: k.shape[0]].index_copy_(1, groups, k.to(st.index_keys.dtype))

    def project(self, x: torch.Tensor, qr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The query side's projections that scores() reads (a batched step's in one product for all tokens)."""
        return self.wq_b(qr), self.weights_proj(x)

    def scores(self, x, qr, keys, positions, rope: Rope, qat: bool, proj=None) -> torch.Tensor:
        """I[b, s, t] = sum_h w_h relu(q_h . k_t); entries a query cannot see yet are -inf. proj: project(x, qr)
        where the caller computed it already."""
        q, w = self.project(x, qr) if proj is None else proj
        q = rope.rotate(q.unflatten(-1, (self.n_local, self.head_dim)), rope.cis(positions))
        if qat:
            q = fp4.qdq(q, 32)
        w = w * (self.head_dim**-0.5 * self.n_heads**-0.5)
        s = self.fused_scores(q, keys, w) if self.fused_scores is not None else None
        if s is None:
            s = torch.einsum("bshd,btd->bsht", q.float(), keys.float())
            s = (s.relu_() * w.float().unsqueeze(-1)).sum(dim=2)
        if self.split:
            s = self.tp.all_reduce(s)
        visible = (positions + 1) // self.spec.ratio  # [s] compressed entries complete at each query
        hidden = torch.arange(s.shape[-1], device=s.device) >= visible.unsqueeze(-1)
        return s.masked_fill(hidden, -torch.inf), visible

    def select(self, s: torch.Tensor, visible: torch.Tensor, end: int, offset: int) -> torch.Tensor:
        """Top-k compressed positions per query, ascending; unreachable -> -1, others + offset. [b, s, k] int"""
        k = min(self.topk, end // self.spec.ratio)
        idx = s.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
        return torch.where(idx < visible.unsqueeze(-1), idx + offset, -1)

    def select_static(self, s: torch.Tensor, visible: torch.Tensor, offset: int) -> torch.Tensor:
        """select() over the whole compressed cache [b, 1, width] with a fixed k: entries a query can see but
        that the candidate blocks masked (-inf) still rank above the ones it cannot see, so while at most k are
        visible every one of them is taken, as select() takes them."""
        reach = torch.arange(s.shape[-1], device=s.device) < visible.unsqueeze(-1)
        s = torch.where(reach, s.clamp_min(torch.finfo(s.dtype).min), -torch.inf)
        idx = s.topk(min(self.topk, s.shape[-1]), dim=-1, sorted=False).indices.sort(dim=-1).values
        return torch.where(idx < visible.unsqueeze(-1), idx + offset, -1)

    def candidates(self, s: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Level one: keep the best `topk_blocks` blocks per query (the newest partial one forced in)."""
        width, bs = s.shape[-1], self.block_size
        blocks = F.pad(s, (0, -width % bs), value=-torch.inf).unflatten(-1, (-1, bs)).amax(dim=-1)
        n_blocks = blocks.shape[-1]
        newest = (visible - 1).div(bs, rounding_mode="floor").unsqueeze(-1)
        blocks = blocks.masked_fill(torch.arange(n_blocks, device=s.device) == newest, torch.inf)
        top = blocks.topk(min(self.topk_blocks, n_blocks), dim=-1)
        keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top.indices, top.values > -torch.inf)
        return keep.repeat_interleave(bs, dim=-1)[..., :width]
