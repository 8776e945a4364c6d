"""The demo model's config and a training view of the V4.1 model code (model/), teacher-forced over sequences.

Training runs model/'s own forward on a fresh decode state per batch (start_pos 0, whole sequences) with three
substitutions of the same math, each undone on exit:
- sparse attention as one masked dense product (the gathered rows of the serving kernel cost far more memory);
- the activation fake-quant points (FP8 window KV, FP4 compressed KV and indexer) pass gradients straight through;
- weights are used as the checkpoint will store them (FP8 blocks, FP4 experts, bf16, FP8 Engram rows), also with
  straight-through gradients, so what is trained is what is served.
Two of mHC's pieces take the blocks' hooks for a fused kernel of the same math: Sinkhorn with a hand-written backward
(its forward is mhc.sinkhorn's ops, bit for bit) and the stream mix as one einsum (equal to float rounding).
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsflash.checkpoint.names import block_prefix, expected_inventory
from dsflash.checkpoint.writer import quant_fp4, quant_rows, tensor_values
from dsflash.config import ModelConfig, v41_checkpoint_config
from dsflash.formats import fp4, fp8
from dsflash.model import attention, dspark, mhc
from dsflash.model.attention import Step
from dsflash.model.experts import ResidentExperts
from dsflash.model.state import DecodeState
from dsflash.model.transformer import Transformer


def demo_config(vocab_size: int, compressed_vocab: int, noise_id: int, bos: int = 0, eos: int = 1) -> dict:
    """HF config.json of the demo model: every V4.1 block kind at widths that train on two CPU cores."""
    text = {
        "model_type": "deepseek_v41_text",
        "vocab_size": vocab_size,
        "hidden_size": 96,
        "num_hidden_layers": 8,
        "num_nextn_predict_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 32,
        "q_lora_rank": 64,
        "o_lora_rank": 64,
        "o_groups": 2,
        # a tools prompt is up to ~900 tokens of the small vocabulary: the called tool's schema stays in the window
        "sliding_window": 1024,
        "rms_norm_eps": 1e-20,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "max_position_embeddings": 65536,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        # as the random embedded model: 0-1 SWA (Engram before 1); 2 ratio-2 KV+index source; 3 its consumer
        # (Engram before it); 4 ratio-1 KV+index+candidate source; 5 consumer; 6 index source over 4's
        # candidates; 7 consumer; 8-9 DSpark
        "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0, 0],
        "kv_source_layer_ids": [2, 4],
        "index_source_layer_ids": [2, 4, 6],
        "candidate_source_layer_id": 4,
        "candidate_topk_blocks": 16,
        "candidate_block_size": 8,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 96,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "engram_layer_ids": [1, 3],
        "engram_num_embeddings": [1060, 1134],  # the primes engram_vocab_size implies
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_vocab_size": 256,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": compressed_vocab,
        "dspark_block_size": 3,
        "dspark_noise_token_id": noise_id,
        "dspark_target_layer_ids": [5, 6, 7],
        "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
    }
    return v41_checkpoint_config(text, bos, eos, block=32)


def _ste(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """q's value, x's gradient."""
    return x + (q - x).detach()


def stored(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """x as the checkpoint holds it (the loader's dequantized value), with x's gradient."""
    with torch.no_grad():
        w = x.detach()
        if fmt == "fp8":
            q = fp8.dequant_block(*fp8.quant_block(w, block), block)
        elif fmt == "fp4":
            q = fp4.dequant(*quant_fp4(w))
        elif fmt == "fp8_rows":
            table, scale = quant_rows(w)
            q = fp8.dequant_rows(table, scale, torch.arange(w.shape[0]), block)
        elif fmt == "bf16":
            q = w.to(torch.bfloat16).float()
        else:
            return x
    return _ste(x, q)


class TrainTable(nn.Module):
    """Engram's FP8 table as a trainable fp32 tensor; looked-up rows as serving sees them (FP8 rows, then bf16)."""

    def __init__(self, weight: torch.Tensor, block: int):
        super().__init__()
        self.table = nn.Parameter(weight.clone())
        self.block = block

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return stored(self.table, "fp8_rows", self.block)[ids].to(torch.bfloat16)


class _Sinkhorn(torch.autograd.Function):
    """mhc.sinkhorn's forward, op for op; the backward through its normalisations written out (y = c / (sum c + eps)
    has dc = (dy - sum(dy * y)) / (sum c + eps)), ~4 ops a normalisation instead of autograd's graph of ~10."""

    @staticmethod
    def forward(ctx, c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        e = torch.exp(c - c.amax(dim=-1, keepdim=True))
        soft = e / e.sum(dim=-1, keepdim=True)
        c = soft + eps
        outs, dens = [], []
        for k in range(2 * iters - 1):  # columns first, then rows, as mhc.sinkhorn
            den = c.sum(dim=-1 - (k % 2 == 0), keepdim=True) + eps
            c = c / den
            outs.append(c)
            dens.append(den)
        ctx.save_for_backward(soft, *outs, *dens)
        return c

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        soft, *saved = ctx.saved_tensors
        n = len(saved) // 2
        for k in reversed(range(n)):
            g = (g - (g * saved[k]).sum(dim=-1 - (k % 2 == 0), keepdim=True)) / saved[n + k]
        return soft * (g - (g * soft).sum(dim=-1, keepdim=True)), None, None


def sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """mhc.sinkhorn (bit-identical forward) with a cheaper backward."""
    return _Sinkhorn.apply(c, iters, eps)


def expand(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mhc.expand with the stream mix as one batched product (equal to float rounding)."""
    mixed = torch.einsum("bsjk,bsjd->bskd", comb, residual.float())
    return (post.unsqueeze(-1) * f.unsqueeze(-2) + mixed).type_as(f)


class Trainable:
    """The demo model's weights as fp32 leaves, by checkpoint name, and the forward that trains them."""

    def __init__(self, cfg: ModelConfig, token_map: list[int], seed: int):
        self.cfg = cfg
        self.specs = {s.name: s for s in expected_inventory(cfg) if not s.is_scale}
        self.model = Transformer(cfg, token_map=token_map, dspark=True)
        for name, p in self.model.named_parameters():
            p.data = tensor_values(cfg, name, seed)
            p.requires_grad_(True)
        self.tables = {}
        for lid in cfg.engram_layer_ids:
            name = f"layers.{lid}.engram.embed.weight"
            table = TrainTable(tensor_values(cfg, name, seed), cfg.fp8_block)
            self.model.layers[lid].engram.embed = table
            self.tables[name] = table.table
        self.experts = {}  # (layer id, expert) -> checkpoint names of (w1, w3, w2)
        self.leaves = {}
        for spec in cfg.layers():
            for e in range(spec.n_experts):
                names = tuple(f"{block_prefix(cfg, spec)}.ffn.experts.{e}.{w}.weight" for w in ("w1", "w3", "w2"))
                self.experts[(spec.layer_id, e)] = names
                self.leaves |= {n: tensor_values(cfg, n, seed).requires_grad_(True) for n in names}
        for m in self.model.modules():
            if hasattr(m, "fused_expand"):  # every Block, DSpark's stages too
                m.sinkhorn, m.fused_expand = sinkhorn, expand
        self.dense = {n: p for n, p in self.model.named_parameters() if n in self.specs}
        self.trained = dict(self.dense)
        self.trained |= self.tables | self.leaves

    def parameters(self, draft: bool | None = None) -> list[torch.Tensor]:
        """Every trained tensor; draft True: only the DSpark stages' (their loss reaches nothing else), False:
        only the backbone's."""
        if draft is None:
            return list(self.trained.values())
        return [t for n, t in self.trained.items() if n.startswith("mtp.") == draft]

    def values(self) -> dict[str, torch.Tensor]:
        """Every trained tensor by checkpoint name (fp32), for writer.write_checkpoint(values=...)."""
        return {n: t.detach().clone() for n, t in self.trained.items()}

    def weights(self) -> tuple[dict[str, torch.Tensor], ResidentExperts]:
        """The weights as the checkpoint stores them (with the leaves' gradients): one call serves every forward of
        an optimizer step."""
        cfg, block = self.cfg, self.cfg.fp8_block
        params = {n: stored(p, self.specs[n].row.fmt, block) for n, p in self.dense.items()}
        # the experts' matrices quantized stacked, a call per shape instead of one per matrix (the math is per
        # group of 32 along a row: the same values); the backbone's apart from the DSpark stages', so that the draft
        # loss reaches no backbone leaf through a stack
        fp4_of = {}
        for group in {(t.shape, n.startswith("mtp.")) for n, t in self.leaves.items()}:
            names = [n for n, t in self.leaves.items() if (t.shape, n.startswith("mtp.")) == group]
            fp4_of |= zip(names, stored(torch.stack([self.leaves[n] for n in names]), "fp4", block).unbind())
        routed = {key: tuple(fp4_of[n] for n in names) for key, names in self.experts.items()}
        return params, ResidentExperts(routed, cfg.swiglu_limit)

    def forward(self, tokens: torch.Tensor, drafts: Drafts | None = None, weights=None):
        """tokens [b, s] from position 0 -> logits [b, s, V], with gradients; with `drafts`, also the DSpark
        stages' logits [Q, V] and confidence [Q] at its queries, from the backbone's taps (detached: the draft loss
        trains the stages alone, and the shared embedding and head stay the backbone's). weights: self.weights()
        of the current values (computed here when not given)."""
        cfg = self.cfg
        params, experts = weights or self.weights()
        state = DecodeState.allocate(cfg, tokens.shape[1], tokens.shape[0])
        model = self.model
        model.forward = types.MethodType(Transformer.forward.__wrapped__, model)  # without inference_mode
        try:
            with training_math():
                logits, taps = torch.func.functional_call(model, params, (tokens, 0, state, experts), {"taps": True},
                                                          strict=False)  # fmt: skip
                if drafts is None:
                    return logits
                model.forward = types.MethodType(_draft_forward, model)
                shared = {n: params[n].detach() for n in ("embed.weight", "head.weight")}
                out = torch.func.functional_call(model, params | shared, (taps.detach(), drafts, experts),
                                                 strict=False)  # fmt: skip
                return logits, *out
        finally:
            del model.forward


@dataclass
class Drafts:
    """Where a batch trains the DSpark head: for each anchor (row r, position p) the block the head drafts after
    the backbone consumed p, teacher-forced. Its beta queries sit at p+1.. (token x[p+1], then noise), attend to
    the backbone's window up to p and to the whole block, and draft x[p+2+i], the Markov bias taken from x[p+1+i]
    (dspark.draft's math over every anchor of the batch at once, the batch flattened into one row)."""

    ids: torch.Tensor  # [Q] the draft block's input tokens
    positions: torch.Tensor  # [Q]
    main_positions: torch.Tensor  # [b * s] the backbone's positions, row after row
    idx: torch.Tensor  # [1, Q, W + beta] rows of [backbone window keys ; draft keys] each query sees (-1: none)
    prev: torch.Tensor  # [Q] the token before each drafted one (the Markov head's input)
    labels: torch.Tensor  # [Q]
    valid: torch.Tensor  # [Q] bool: a label inside the row that the loss counts

    @classmethod
    def build(cls, tokens: torch.Tensor, anchors: list[tuple[int, int]], cfg: ModelConfig, wanted=None) -> Drafts:
        """anchors (row, p) with 1 <= p; wanted [b, s] bool: which labels count (default all in the row)."""
        b, s = tokens.shape
        beta, W = cfg.dspark_block_size, cfg.sliding_window
        rows = torch.tensor([r for r, _ in anchors])
        p = torch.tensor([q for _, q in anchors])
        j = torch.arange(beta)
        at = p.unsqueeze(1) + 1 + j  # [A, beta] each query's position
        ids = torch.full_like(at, cfg.dspark_noise_token_id)
        ids[:, 0] = tokens[rows, (p + 1).clamp_max(s - 1)]
        back = p.unsqueeze(1) - W + 1 + torch.arange(W)
        main = torch.where(back >= 0, rows.unsqueeze(1) * s + back, -1)
        own = b * s + torch.arange(len(anchors)).unsqueeze(1) * beta + j
        idx = torch.cat([main, own], dim=1).repeat_interleave(beta, dim=0)
        label_at = at + 1
        inside = label_at < s
        flat_rows = rows.unsqueeze(1).expand_as(at)
        labels = tokens[flat_rows, label_at.clamp_max(s - 1)]
        valid = inside & (wanted[flat_rows, label_at.clamp_max(s - 1)] if wanted is not None else True)
        return cls(
            ids.flatten(),
            at.flatten(),
            torch.arange(s).repeat(b),
            idx.unsqueeze(0),
            tokens[flat_rows, at.clamp_max(s - 1)].flatten(),
            labels.flatten(),
            valid.flatten(),
        )


def _draft_forward(model: Transformer, taps: torch.Tensor, drafts: Drafts, experts):
    """The DSpark stages over every anchor of the batch -> (logits [Q, V] with the Markov bias, confidence [Q])."""
    cfg, stages = model.cfg, model.mtp
    first, last = stages[0], stages[-1]
    main_x = first.main_norm(first.main_proj(taps.reshape(1, -1, taps.shape[-1])))
    x = model.embed(drafts.ids.unsqueeze(0)).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)
    pre_mix = mhc.identity_pre(x)
    step = Step(0, x.shape[1], None, model.qat, drafts.positions)
    for stage in stages:
        stage.attn.forward = types.MethodType(_draft_attention, stage.attn)
        try:
            x, pre_mix = stage(x, pre_mix, step, experts, main_x, drafts)
        finally:
            del stage.attn.forward
    y = mhc.collapse(x, pre_mix)
    logits = model.head(last.norm(y))
    bias, emb = last.markov_head(drafts.prev.unsqueeze(0))
    return (logits + bias)[0], last.confidence_head(y, emb)[0]


def _draft_attention(self, x: torch.Tensor, step: Step, main_x: torch.Tensor, drafts: Drafts) -> torch.Tensor:
    """DSparkAttention.forward for the flattened anchors: the window keys of the backbone's positions (seed's
    math), then the draft keys; each query's rows from drafts.idx."""
    main_kv = self.window_kv(main_x, self.rope.cis(drafts.main_positions), step.qat)
    cis = self.rope.cis(drafts.positions)
    q = self.rope.rotate(self.wq_b(self.q_norm(self.wq_a(x))).unflatten(-1, (self.n_local, self.head_dim)), cis)
    kv = torch.cat([main_kv, self.window_kv(x, cis, step.qat)], dim=1)
    o = dense_attention(q, kv, self.attn_sink, drafts.idx, self.scale)
    return self.output(self.rope.rotate(o, cis, inverse=True))


def dense_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float):
    """attention.sparse_attention's math as one fused masked product: softmax over the selected rows, sink in the
    denominator only. q [b, s, h, d], kv [b, n, d], idx [b, s, k] (-1 = none).

    The sink is one more key, always selected, that adds nothing to the output: keys and values get one more
    dimension, 0 on every row but the sink's key (1, its value is all zero), and each head's query carries its
    sink logit / scale there. Boolean mask and equal widths let scaled_dot_product_attention take its fused
    (flash) CPU kernel, forward and backward, without a [b, h, s, n] probability tensor."""
    b, s, h, d = q.shape
    n = kv.shape[1]
    hits = torch.zeros(b, s, n + 1, dtype=torch.bool, device=q.device)
    hits.scatter_(-1, torch.where(idx >= 0, idx.long() + 1, 0), True)
    hits[..., 0] = True
    rows = F.pad(kv.float(), (0, 1))  # [b, n, d + 1], the extra dimension 0
    values = torch.cat([rows.new_zeros(b, 1, d + 1), rows], 1)
    keys = torch.cat([F.pad(rows.new_ones(b, 1, 1), (d, 0)), rows], 1)
    qs = torch.cat([q.float(), (sink.float() / scale).view(1, 1, h, 1).expand(b, s, h, 1)], -1)
    o = F.scaled_dot_product_attention(qs.transpose(1, 2), keys.unsqueeze(1).expand(b, h, n + 1, d + 1),
                                       values.unsqueeze(1).expand(b, h, n + 1, d + 1), attn_mask=hits.unsqueeze(1),
                                       scale=scale)  # fmt: skip
    return o[..., :d].transpose(1, 2).to(q.dtype)


def _ste_qdq(qdq):
    def wrapped(x, *args, **kwargs):
        return _ste(x, qdq(x.detach(), *args, **kwargs))

    return wrapped


@contextlib.contextmanager
def training_math():
    """The substitutions of the module docstring, for the duration of one forward."""
    saved = [(attention, "sparse_attention"), (dspark, "sparse_attention"), (fp8, "qdq"), (fp4, "qdq")]
    old = [getattr(m, n) for m, n in saved]
    attention.sparse_attention = dspark.sparse_attention = dense_attention
    fp8.qdq, fp4.qdq = _ste_qdq(old[2]), _ste_qdq(old[3])
    try:
        yield
    finally:
        for (m, n), v in zip(saved, old):
            setattr(m, n, v)
