"""DSpark block-parallel draft head (arch §5.9): stages under mtp.*, forward only; acceptance is the caller's."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dsflash.config import LayerSpec, ModelConfig
from dsflash.model import mhc
from dsflash.model.attention import Attention, Step, ring_write, sparse_attention
from dsflash.model.block import Block, Embedding, Head
from dsflash.model.layers import Linear, RMSNorm, Rope
from dsflash.model.parallel import TP


class DSparkAttention(Attention):
    """Draft queries attend to the target model's window (main_x per position) plus all draft keys."""

    def forward(self, x: torch.Tensor, step: Step, main_x: torch.Tensor) -> torch.Tensor:
        """x [b, beta, d] drafts at positions start_pos+1.., main_x [b, 1, d] the target context at start_pos."""
        ring = step.state.layers[self.spec.layer_id].window
        self.seed(main_x, step)
        beta, W = x.shape[1], self.window
        cis = self.rope.cis(torch.arange(step.start_pos + 1, step.start_pos + 1 + beta, device=x.device))
        qr = self.q_norm(self.wq_a(x))
        q = self.rope.rotate(self.wq_b(qr).unflatten(-1, (self.n_local, self.head_dim)), cis)
        kv = torch.cat([ring[: x.shape[0]].to(x.dtype), self.window_kv(x, cis, step.qat)], dim=1)
        filled = min(W, step.start_pos + 1)
        idx = torch.cat([torch.arange(filled), W + torch.arange(beta)]).to(x.device)
        o = sparse_attention(q, kv, self.attn_sink, idx.view(1, 1, -1).expand(x.shape[0], beta, -1), self.scale)
        return self.output(self.rope.rotate(o, cis, inverse=True))

    def seed(self, main_x: torch.Tensor, step: Step) -> None:
        """Write the target context's window KV for positions start_pos.. into this stage's ring."""
        pos = torch.arange(step.start_pos, step.start_pos + main_x.shape[1], device=main_x.device)
        ring_write(
            step.state.layers[self.spec.layer_id].window,
            self.window_kv(main_x, self.rope.cis(pos), step.qat),
            step.start_pos,
        )


class DSparkBlock(Block):
    """One DSpark stage: an ordinary ratio-0 block (own experts) whose attention sees the target context."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, tp: TP, rope: Rope, first: bool, last: bool):
        super().__init__(cfg, spec, tp, rope, attention_cls=DSparkAttention)
        d = cfg.hidden_size
        if first:
            self.main_proj = Linear(d * len(cfg.dspark_target_layer_ids), d)
            self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        if last:
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, tp)
            self.confidence_head = ConfidenceHead(d + cfg.dspark_markov_rank)


class MarkovHead(nn.Module):
    """Bias on the next draft's logits from the previous drafted token: embed [V, r], head [V, r]."""

    def __init__(self, vocab: int, rank: int, tp: TP):
        super().__init__()
        self.embed = Embedding(vocab, rank, tp)
        self.head = Head(vocab, rank, tp)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.embed(ids)
        return self.head(emb), emb


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = Linear(dim, 1)

    def forward(self, y: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([y, emb], dim=-1).float()).float().squeeze(-1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def draft(
    model,
    stages: nn.ModuleList,
    token: torch.Tensor,
    main_hidden: torch.Tensor,
    start_pos: int,
    state,
    experts,
    sample: Callable[[torch.Tensor], torch.Tensor] = greedy,
    qat: bool = True,
):
    """After the target consumed position start_pos: seed the stages' windows (start_pos 0, whole prefill)
    or draft beta tokens. token [b] the sampled token, main_hidden [b, s, n_taps*d] the taps of this call.
    Returns None for a prefill, else (ids [b, beta+1] with ids[:, 0] = token, logits [b, beta, V], confidence)."""
    first, last = stages[0], stages[-1]
    main_x = first.main_norm(first.main_proj(main_hidden))
    step = Step(
        start_pos,
        main_hidden.shape[1],
        state,
        qat,
        torch.arange(start_pos, start_pos + main_hidden.shape[1], device=main_hidden.device),
    )
    if start_pos == 0 or main_hidden.shape[1] > 1:
        for stage in stages:
            stage.attn.seed(main_x, step)
        return None
    cfg = model.cfg
    beta = cfg.dspark_block_size
    ids = token.new_full((token.shape[0], beta), cfg.dspark_noise_token_id)
    ids[:, 0] = token
    x = model.embed(ids).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)
    pre_mix = mhc.identity_pre(x)
    for stage in stages:
        x, pre_mix = stage(x, pre_mix, step, experts, main_x)
    y = mhc.collapse(x, pre_mix)
    logits = model.head(last.norm(y))
    out = token.new_empty(token.shape[0], beta + 1)
    out[:, 0] = token
    embeds = []
    for i in range(beta):  # each draft's Markov bias depends on the token drafted before it
        bias, emb = last.markov_head(out[:, i])
        logits[:, i] += bias
        embeds.append(emb)
        out[:, i + 1] = sample(logits[:, i])
    confidence = last.confidence_head(y, torch.stack(embeds, dim=1))
    return out, logits, confidence
