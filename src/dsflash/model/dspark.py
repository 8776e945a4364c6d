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
from dsflash.model.sampling import probabilities


class DSparkAttention(Attention):
    """Draft queries attend to the target model's window (main_x per position) plus all draft keys."""

    def forward(self, x: torch.Tensor, step: Step, main_x: torch.Tensor) -> torch.Tensor:
        """x [b, beta, d] drafts at positions start_pos+1.., main_x [b, 1, d] the target context at start_pos."""
        ring = step.state.layers[self.spec.layer_id].window
        self.seed(main_x, step)
        beta, W = x.shape[1], self.window
        cis = self.rope.cis(torch.arange(step.start_pos + 1, step.start_pos + 1 + beta, device=x.device))
        q, _ = self.queries(x, cis)
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


@torch.inference_mode()
def seed(model, stages: nn.ModuleList, main_hidden: torch.Tensor, start_pos: int, state, qat: bool = True) -> None:
    """Write the target context of positions start_pos.. (its taps main_hidden [b, s, n*d]) into every stage's
    window, drafting nothing: what each consumed position leaves for later drafts."""
    first = stages[0]
    main_x = first.main_norm(first.main_proj(main_hidden))
    s = main_hidden.shape[1]
    step = Step(start_pos, s, state, qat, torch.arange(start_pos, start_pos + s, device=main_hidden.device))
    for stage in stages:
        stage.attn.seed(main_x, step)


def gumbel(seed: int, index: int, vocab: int) -> torch.Tensor:
    """float64 Gumbel noise [V] of generated token `index` of a request seeded `seed`: the same on every rank and
    every run, whoever draws that position (a plain step, a draft, a verify)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + index) % (1 << 62))
    return -torch.log(-torch.log(torch.rand(vocab, dtype=torch.float64, generator=g).clamp_min(1e-300)))


def coupled_pick(probs: torch.Tensor, noise: torch.Tensor) -> int:
    """argmax(log p + Gumbel): a draw from p (Gumbel-max) fixed by the noise."""
    return int((probs.log() + noise).argmax())


def draft_sampler(temperature: float, top_k: int, top_p: float, min_p: float, seed: int, index: int = -1):
    """The draws inside a draft: greedy at temperature ~0 (or top_k 1); else from the sampler's filtered
    distribution (sampling.probabilities), with the Gumbel noise of generated positions index, index + 1, ...
    (index >= 0: coupled with the target's draws there), or with a generator of this seed (index -1). Every rank
    draws the same tokens from the same gathered logits."""
    if temperature < 1e-5 or top_k == 1:
        return greedy
    g, at = torch.Generator().manual_seed(seed), [index]

    def sample(logits: torch.Tensor) -> torch.Tensor:
        rows = []
        for row in logits:
            p = probabilities(row, temperature, top_k, top_p, min_p)
            if index >= 0:
                rows.append(torch.tensor([coupled_pick(p, gumbel(seed, at[0], p.shape[0]))]))
                at[0] += 1
            else:
                rows.append(torch.multinomial(p, 1, generator=g))
        return torch.cat(rows).to(logits.device)

    return sample


class Speculation:
    """One rank's side of speculative decoding for its selected sequence. Every consumed position's taps are kept
    (the last W of them) and written into the DSpark windows in one batch just before the next draft: while the
    guard has drafting off, plain steps pay no seeding. A verify's positions count only once accepted, and its
    state mark lets accept() drop the rejected ones exactly."""

    def __init__(self, model, experts):
        self.model, self.experts = model, experts
        self.window = model.cfg.sliding_window
        self.reset()

    def reset(self) -> None:
        self.pending: list[tuple[int, torch.Tensor]] = []  # (first position, taps [1, s, n*d]) not yet seeded
        self.tap_pos = -1  # the last consumed position (drafts start after it)
        self.mark = self.taps = None

    def forward(self, tokens: torch.Tensor, start_pos: int, state, last_only: bool = False, verify: bool = False):
        self.mark = state.mark(start_pos, tokens.shape[1]) if verify else None
        logits, taps = self.model(tokens, start_pos, state, self.experts, last_only=last_only, taps=True)
        if verify:
            self.taps = taps
        else:
            self._consumed(taps, start_pos)
        return logits

    def accept(self, state, n_keep: int) -> None:
        """Keep the first n_keep positions of the last verify (at least its first, the token it continued with)."""
        if self.mark is None:
            raise ValueError("accept() without a verify")
        start = self.mark.start
        state.rollback(self.mark, start + n_keep)
        self._consumed(self.taps[:, :n_keep], start)
        self.mark = self.taps = None

    def draft(self, token: int, pos: int, k: int, state, sample=greedy):
        """Up to k draft tokens after `token` at position pos -> (ids [k], logits [k, V], confidence [k]: each
        draft's probability of being right where the ones before it are, from the confidence head), or None where
        no draft can start (the last consumed position is not pos - 1, or it is position 0: the head drafts after a
        decode)."""
        if not self.pending or self.tap_pos != pos - 1 or pos < 2:
            return None
        first, taps = self.pending[0][0], torch.cat([t for _, t in self.pending], dim=1)
        if taps.shape[1] > 1:  # the last position is seeded by the draft itself
            seed(self.model, self.model.mtp, taps[:, :-1], first, state, self.model.qat)
        self.pending = [(pos - 1, taps[:, -1:])]
        out = self.model.draft(torch.tensor([token], device=taps.device), taps[:, -1:], pos - 1, state, self.experts,
                               sample)  # fmt: skip
        ids, logits, confidence = out
        return ids[0, 1 : k + 1], logits[0, :k], torch.sigmoid(confidence[0, :k].float())

    def _consumed(self, taps: torch.Tensor, start_pos: int) -> None:
        if self.tap_pos != start_pos - 1:  # a new sequence, or one restored from a snapshot: older taps are not its
            self.pending = []
        n = taps.shape[1]
        self.pending.append((start_pos + max(0, n - self.window), taps[:, -self.window :]))
        self.tap_pos = start_pos + n - 1
        while sum(t.shape[1] for _, t in self.pending) - self.pending[0][1].shape[1] >= self.window:
            self.pending.pop(0)  # wholly older than the window
        p0, t0 = self.pending[0]
        keep = self.tap_pos + 1 - self.window  # the window's first position
        if p0 < keep:
            self.pending[0] = (keep, t0[:, keep - p0 :])
