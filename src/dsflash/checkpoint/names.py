"""The one declarative table of checkpoint tensors (architecture §3.3/§3.4) and the inventory it generates.

Parameter names are checkpoint names. Each row is one tensor pattern: its name template, storage format,
logical shape from the config, where it exists, its tensor-parallel shard rule and its init role (used by the
random-checkpoint writer). A quantized row stands for `X.weight` plus its sibling `X.scale`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from dsflash.config import LayerSpec, ModelConfig

INDEX = "model.safetensors.index.json"  # file names of a model directory (HF conventions)
SINGLE = "model.safetensors"

# storage formats of a row -> dtype of the stored weight
FORMAT_DTYPE = {
    "bf16": "BF16",
    "f32": "F32",
    "i64": "I64",
    "fp8": "F8_E4M3",  # + E8M0 scale [ceil(O/B), ceil(I/B)], B = weight_block_size
    "fp4": "I8",  # E2M1 pairs [O, I/2] + E8M0 scale [O, I/32]
    "fp8_rows": "F8_E4M3",  # Engram table: + E8M0 scale [R, D/32], one scale per row and 32 columns
}
DTYPE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I64": 8}
# tensor-parallel rule of a row; the scale of a quantized weight follows its weight on the block grid
SHARD_RULES = (
    "column",  # split dim 0 (output features / heads)
    "row",  # split dim 1 (input features)
    "vocab",  # split dim 0 over the vocabulary
    "replicated",
    "expert_w13",  # routed expert w1/w3: split the intermediate rows
    "expert_w2",  # routed expert w2: split the intermediate columns
    "grouped_wo_a",  # attn.wo_a: split whole output groups
    "engram_table",  # Engram rows: ceil(rows / world) per rank, masked lookups
    "skip_vision",  # vision tower: in the checkpoint, not loaded
)
FP4_GROUP = 32
ROWS_GROUP = 32  # Engram table scale group along the row

Shape = tuple[int, ...]
ShapeRule = Callable[[ModelConfig, LayerSpec], Shape]
Where = Callable[[ModelConfig, LayerSpec], bool]


@dataclass(frozen=True)
class Row:
    """One tensor pattern. `name` uses {p} (block prefix), {e} (expert) or {b} (vision block)."""

    name: str
    fmt: str
    shape: ShapeRule  # logical shape (FP4: unpacked)
    scope: str  # global | block | expert | vision | vision_block
    where: Where
    shard: str
    init: str  # role for the writer: embed, norm, lin:<gain key>, hc_fn, ..., zeros


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor. Equality is (name, dtype, shape); the rest says where it came from."""

    name: str
    dtype: str
    shape: Shape
    row: Row | None = field(default=None, compare=False, repr=False)
    logical: Shape = field(default=(), compare=False, repr=False)  # the parameter's shape (FP4 unpacked)
    is_scale: bool = field(default=False, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]

    @property
    def params(self) -> int:
        """Logical parameters: FP4 counts 2 per byte; scales and hash tables are not parameters."""
        if self.is_scale or self.dtype == "I64":
            return 0
        return math.prod(self.logical or self.shape)


# ---- shape helpers (c = config, l = layer spec) ---------------------------------------------------------------
def _d(c: ModelConfig) -> int:
    return c.hidden_size


def _hc_mix(c: ModelConfig) -> int:
    return (2 + c.hc_mult) * c.hc_mult


def _coff(l: LayerSpec) -> int:
    return 2 if l.v4_overlap else 1  # V4 CSA compressor keeps two overlapping windows


def _engram_rows(c: ModelConfig, l: LayerSpec) -> int:
    return c.engram_num_embeddings[c.engram_layer_ids.index(l.layer_id)]


def _vision(c: ModelConfig):
    assert c.vision_config is not None
    return c.vision_config


# ---- where helpers -----------------------------------------------------------------------------------------------
def _all(c, l):
    return True


def _v4(c, l):
    return not c.is_v41


def _v41(c, l):
    return c.is_v41


def _v4_compressor(c, l):
    return not c.is_v41 and l.is_kv_source


def _v4_indexer(c, l):
    return not c.is_v41 and l.v4_overlap


def _v41_kv_source(c, l):
    return c.is_v41 and l.is_kv_source


def _v41_index_source(c, l):
    return c.is_v41 and l.is_index_source


def _nextn(c, l):
    return not c.is_v41 and l.is_dspark and not c.has_dspark


def _dspark_first(c, l):
    return c.has_dspark and l.layer_id == c.num_hidden_layers


def _dspark_last(c, l):
    return c.has_dspark and l.layer_id == c.num_hidden_layers + c.n_dspark - 1


def _has_vision(c, l):
    return c.vision_config is not None


# fmt: off
TABLE: tuple[Row, ...] = (
    # ---- global --------------------------------------------------------------------------------------------------
    Row("embed.weight", "bf16", lambda c, l: (c.vocab_size, _d(c)), "global", _all, "vocab", "embed"),
    Row("head.weight", "bf16", lambda c, l: (c.vocab_size, _d(c)), "global", _all, "vocab", "lin:head"),
    Row("norm.weight", "bf16", lambda c, l: (_d(c),), "global", _all, "replicated", "norm"),
    Row("hc_head_fn", "f32", lambda c, l: (c.hc_mult, c.hc_mult * _d(c)), "global", _v4, "replicated", "hc_fn"),
    Row("hc_head_base", "f32", lambda c, l: (c.hc_mult,), "global", _v4, "replicated", "hc_base"),
    Row("hc_head_scale", "f32", lambda c, l: (1,), "global", _v4, "replicated", "hc_scale"),
    # ---- every block (backbone layers and MTP / DSpark stages) ---------------------------------------------------
    Row("{p}.hc_attn_fn", "f32", lambda c, l: (_hc_mix(c), c.hc_mult * _d(c)), "block", _all, "replicated", "hc_fn"),
    Row("{p}.hc_attn_base", "f32", lambda c, l: (_hc_mix(c),), "block", _all, "replicated", "hc_base"),
    Row("{p}.hc_attn_scale", "f32", lambda c, l: (3,), "block", _all, "replicated", "hc_scale"),
    Row("{p}.hc_ffn_fn", "f32", lambda c, l: (_hc_mix(c), c.hc_mult * _d(c)), "block", _all, "replicated", "hc_fn"),
    Row("{p}.hc_ffn_base", "f32", lambda c, l: (_hc_mix(c),), "block", _all, "replicated", "hc_base"),
    Row("{p}.hc_ffn_scale", "f32", lambda c, l: (3,), "block", _all, "replicated", "hc_scale"),
    Row("{p}.attn_norm.weight", "bf16", lambda c, l: (_d(c),), "block", _all, "replicated", "norm"),
    Row("{p}.ffn_norm.weight", "bf16", lambda c, l: (_d(c),), "block", _all, "replicated", "norm"),
    # attention
    Row("{p}.attn.attn_sink", "f32", lambda c, l: (c.num_attention_heads,), "block", _all, "column", "sink"),
    Row("{p}.attn.wq_a.weight", "fp8", lambda c, l: (c.q_lora_rank, _d(c)), "block", _all, "replicated",
        "lin:wq_a"),
    Row("{p}.attn.q_norm.weight", "bf16", lambda c, l: (c.q_lora_rank,), "block", _all, "replicated", "norm"),
    Row("{p}.attn.wq_b.weight", "fp8", lambda c, l: (c.num_attention_heads * c.head_dim, c.q_lora_rank), "block",
        _all, "column", "lin:wq_b"),
    Row("{p}.attn.wkv.weight", "fp8", lambda c, l: (c.head_dim, _d(c)), "block", _all, "replicated", "lin:wkv"),
    Row("{p}.attn.kv_norm.weight", "bf16", lambda c, l: (c.head_dim,), "block", _all, "replicated", "norm"),
    Row("{p}.attn.wo_a.weight", "fp8",
        lambda c, l: (c.o_groups * c.o_lora_rank, c.num_attention_heads * c.head_dim // c.o_groups), "block", _all,
        "grouped_wo_a", "lin:wo_a"),
    Row("{p}.attn.wo_b.weight", "fp8", lambda c, l: (_d(c), c.o_groups * c.o_lora_rank), "block", _all, "row",
        "lin:wo_b"),
    # V4 compressor (every compressed layer owns one; ratio 4 overlaps two windows) and the ratio-4 indexer
    Row("{p}.attn.compressor.ape", "f32", lambda c, l: (l.ratio, _coff(l) * c.head_dim), "block", _v4_compressor,
        "replicated", "ape"),
    Row("{p}.attn.compressor.wkv.weight", "bf16", lambda c, l: (_coff(l) * c.head_dim, _d(c)), "block",
        _v4_compressor, "replicated", "lin:wkv"),
    Row("{p}.attn.compressor.wgate.weight", "bf16", lambda c, l: (_coff(l) * c.head_dim, _d(c)), "block",
        _v4_compressor, "replicated", "lin:wgate"),
    Row("{p}.attn.compressor.norm.weight", "bf16", lambda c, l: (c.head_dim,), "block", _v4_compressor,
        "replicated", "norm"),
    Row("{p}.attn.indexer.wq_b.weight", "fp8", lambda c, l: (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
        "block", _v4_indexer, "replicated", "lin:wq_b"),
    Row("{p}.attn.indexer.weights_proj.weight", "bf16", lambda c, l: (c.index_n_heads, _d(c)), "block",
        _v4_indexer, "replicated", "lin:weights_proj"),
    Row("{p}.attn.indexer.compressor.ape", "f32", lambda c, l: (l.ratio, 2 * c.index_head_dim), "block",
        _v4_indexer, "replicated", "ape"),
    Row("{p}.attn.indexer.compressor.wkv.weight", "bf16", lambda c, l: (2 * c.index_head_dim, _d(c)), "block",
        _v4_indexer, "replicated", "lin:wkv"),
    Row("{p}.attn.indexer.compressor.wgate.weight", "bf16", lambda c, l: (2 * c.index_head_dim, _d(c)), "block",
        _v4_indexer, "replicated", "lin:wgate"),
    Row("{p}.attn.indexer.compressor.norm.weight", "bf16", lambda c, l: (c.index_head_dim,), "block",
        _v4_indexer, "replicated", "norm"),
    # V4.1 shared compressed KV: only KV sources own a compressor (no gate at ratio 1) and the index keys
    Row("{p}.attn.compressor.wkv.weight", "bf16", lambda c, l: (c.head_dim, _d(c)), "block", _v41_kv_source,
        "replicated", "lin:wkv"),
    Row("{p}.attn.compressor.wgate.weight", "bf16", lambda c, l: (c.head_dim, _d(c)), "block",
        lambda c, l: _v41_kv_source(c, l) and l.ratio > 1, "replicated", "lin:wgate"),
    Row("{p}.attn.compressor.norm.weight", "bf16", lambda c, l: (c.head_dim,), "block", _v41_kv_source,
        "replicated", "norm"),
    Row("{p}.attn.indexer.wk.weight", "bf16", lambda c, l: (c.index_head_dim, c.head_dim), "block", _v41_kv_source,
        "replicated", "lin:wk"),
    Row("{p}.attn.indexer.k_norm.weight", "bf16", lambda c, l: (c.index_head_dim,), "block", _v41_kv_source,
        "replicated", "norm"),
    Row("{p}.attn.indexer.wq_b.weight", "fp8", lambda c, l: (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
        "block", _v41_index_source, "replicated", "lin:wq_b"),
    Row("{p}.attn.indexer.weights_proj.weight", "bf16", lambda c, l: (c.index_n_heads, _d(c)), "block",
        _v41_index_source, "replicated", "lin:weights_proj"),
    # V4.1 Engram (applied before the block)
    Row("{p}.engram.embed.weight", "fp8_rows", lambda c, l: (_engram_rows(c, l), c.engram_head_dim), "block",
        lambda c, l: l.has_engram, "engram_table", "engram_table"),
    Row("{p}.engram.wkv.weight", "fp8",
        lambda c, l: (_d(c) * (c.hc_mult + 1), c.engram_n_cols * c.engram_head_dim), "block",
        lambda c, l: l.has_engram, "replicated", "lin:engram_wkv"),
    Row("{p}.engram.q_weight", "bf16", lambda c, l: (c.hc_mult, _d(c)), "block", lambda c, l: l.has_engram,
        "replicated", "engram_qk"),
    Row("{p}.engram.k_weight", "bf16", lambda c, l: (c.hc_mult, _d(c)), "block", lambda c, l: l.has_engram,
        "replicated", "engram_qk"),
    # MoE
    Row("{p}.ffn.gate.weight", "bf16", lambda c, l: (l.n_experts, _d(c)), "block", _all, "replicated", "lin:gate"),
    Row("{p}.ffn.gate.bias", "f32", lambda c, l: (l.n_experts,), "block", lambda c, l: not l.hash_routed,
        "replicated", "gate_bias"),
    Row("{p}.ffn.gate.bias_vl", "f32", lambda c, l: (l.n_experts,), "block",
        lambda c, l: c.is_v41 and c.vision_config is not None, "replicated", "gate_bias"),
    Row("{p}.ffn.gate.tid2eid", "i64", lambda c, l: (c.vocab_size, l.n_active), "block",
        lambda c, l: l.hash_routed, "replicated", "tid2eid"),
    Row("{p}.ffn.experts.{e}.w1.weight", "fp4", lambda c, l: (c.moe_intermediate_size, _d(c)), "expert", _all,
        "expert_w13", "lin:w1"),
    Row("{p}.ffn.experts.{e}.w2.weight", "fp4", lambda c, l: (_d(c), c.moe_intermediate_size), "expert", _all,
        "expert_w2", "lin:w2"),
    Row("{p}.ffn.experts.{e}.w3.weight", "fp4", lambda c, l: (c.moe_intermediate_size, _d(c)), "expert", _all,
        "expert_w13", "lin:w3"),
    Row("{p}.ffn.shared_experts.w1.weight", "fp8",
        lambda c, l: (c.moe_intermediate_size * c.n_shared_experts, _d(c)), "block", _all, "column", "lin:w1"),
    Row("{p}.ffn.shared_experts.w2.weight", "fp8",
        lambda c, l: (_d(c), c.moe_intermediate_size * c.n_shared_experts), "block", _all, "row", "lin:w2"),
    Row("{p}.ffn.shared_experts.w3.weight", "fp8",
        lambda c, l: (c.moe_intermediate_size * c.n_shared_experts, _d(c)), "block", _all, "column", "lin:w3"),
    # V4 NextN MTP block
    Row("{p}.e_proj.weight", "fp8", lambda c, l: (_d(c), _d(c)), "block", _nextn, "replicated", "lin:e_proj"),
    Row("{p}.h_proj.weight", "fp8", lambda c, l: (_d(c), _d(c)), "block", _nextn, "replicated", "lin:h_proj"),
    Row("{p}.enorm.weight", "bf16", lambda c, l: (_d(c),), "block", _nextn, "replicated", "norm"),
    Row("{p}.hnorm.weight", "bf16", lambda c, l: (_d(c),), "block", _nextn, "replicated", "norm"),
    Row("{p}.norm.weight", "bf16", lambda c, l: (_d(c),), "block", _nextn, "replicated", "norm"),
    Row("{p}.hc_head_fn", "f32", lambda c, l: (c.hc_mult, c.hc_mult * _d(c)), "block", _nextn, "replicated",
        "hc_fn"),
    Row("{p}.hc_head_base", "f32", lambda c, l: (c.hc_mult,), "block", _nextn, "replicated", "hc_base"),
    Row("{p}.hc_head_scale", "f32", lambda c, l: (1,), "block", _nextn, "replicated", "hc_scale"),
    # DSpark draft head (V4.1; V4-Flash-0731 with V4-style hc_head and markov_w1/w2 names)
    Row("{p}.main_proj.weight", "fp8", lambda c, l: (_d(c), len(c.dspark_target_layer_ids) * _d(c)), "block",
        _dspark_first, "replicated", "lin:main_proj"),
    Row("{p}.main_norm.weight", "bf16", lambda c, l: (_d(c),), "block", _dspark_first, "replicated", "norm"),
    Row("{p}.norm.weight", "bf16", lambda c, l: (_d(c),), "block", _dspark_last, "replicated", "norm"),
    Row("{p}.hc_head_fn", "f32", lambda c, l: (c.hc_mult, c.hc_mult * _d(c)), "block",
        lambda c, l: _dspark_last(c, l) and not c.is_v41, "replicated", "hc_fn"),
    Row("{p}.hc_head_base", "f32", lambda c, l: (c.hc_mult,), "block",
        lambda c, l: _dspark_last(c, l) and not c.is_v41, "replicated", "hc_base"),
    Row("{p}.hc_head_scale", "f32", lambda c, l: (1,), "block", lambda c, l: _dspark_last(c, l) and not c.is_v41,
        "replicated", "hc_scale"),
    Row("{p}.markov_head.embed.weight", "bf16", lambda c, l: (c.vocab_size, c.dspark_markov_rank), "block",
        lambda c, l: _dspark_last(c, l) and c.is_v41, "vocab", "markov"),
    Row("{p}.markov_head.head.weight", "bf16", lambda c, l: (c.vocab_size, c.dspark_markov_rank), "block",
        lambda c, l: _dspark_last(c, l) and c.is_v41, "vocab", "markov"),
    Row("{p}.markov_head.markov_w1.weight", "bf16", lambda c, l: (c.vocab_size, c.dspark_markov_rank), "block",
        lambda c, l: _dspark_last(c, l) and not c.is_v41, "vocab", "markov"),
    Row("{p}.markov_head.markov_w2.weight", "bf16", lambda c, l: (c.vocab_size, c.dspark_markov_rank), "block",
        lambda c, l: _dspark_last(c, l) and not c.is_v41, "vocab", "markov"),
    Row("{p}.confidence_head.proj.weight", "bf16", lambda c, l: (1, _d(c) + c.dspark_markov_rank), "block",
        _dspark_last, "replicated", "lin:proj"),
    # ---- vision tower + aligner (V4.1 with vision_config; never loaded) ------------------------------------------
    Row("image_start", "bf16", lambda c, l: (_d(c),), "vision", _has_vision, "skip_vision", "embed"),
    Row("image_end", "bf16", lambda c, l: (_d(c),), "vision", _has_vision, "skip_vision", "embed"),
    Row("image_newline", "bf16", lambda c, l: (_d(c),), "vision", _has_vision, "skip_vision", "embed"),
    Row("aligner.w1.weight", "bf16",
        lambda c, l: (_d(c), _vision(c).hidden_size * _vision(c).downsample_ratio**2), "vision", _has_vision,
        "skip_vision", "lin:vision"),
    Row("aligner.w1.bias", "bf16", lambda c, l: (_d(c),), "vision", _has_vision, "skip_vision", "zeros"),
    Row("aligner.w2.weight", "bf16", lambda c, l: (_d(c), _d(c)), "vision", _has_vision, "skip_vision",
        "lin:vision"),
    Row("aligner.w2.bias", "bf16", lambda c, l: (_d(c),), "vision", _has_vision, "skip_vision", "zeros"),
    Row("vision.patch_embed.proj.weight", "bf16",
        lambda c, l: (_vision(c).hidden_size, 3 * _vision(c).patch_size**2), "vision", _has_vision, "skip_vision",
        "lin:vision"),
    Row("vision.patch_embed.proj.bias", "bf16", lambda c, l: (_vision(c).hidden_size,), "vision", _has_vision,
        "skip_vision", "zeros"),
    Row("vision.norm.weight", "bf16", lambda c, l: (_vision(c).hidden_size,), "vision", _has_vision, "skip_vision",
        "norm"),
    Row("vision.blocks.{b}.attn.wqkv.weight", "bf16", lambda c, l: (3 * _vision(c).hidden_size,
        _vision(c).hidden_size), "vision_block", _has_vision, "skip_vision", "lin:vision"),
    Row("vision.blocks.{b}.attn.wqkv.bias", "bf16", lambda c, l: (3 * _vision(c).hidden_size,), "vision_block",
        _has_vision, "skip_vision", "zeros"),
    Row("vision.blocks.{b}.attn.wo.weight", "bf16", lambda c, l: (_vision(c).hidden_size, _vision(c).hidden_size),
        "vision_block", _has_vision, "skip_vision", "lin:vision"),
    Row("vision.blocks.{b}.attn.wo.bias", "bf16", lambda c, l: (_vision(c).hidden_size,), "vision_block",
        _has_vision, "skip_vision", "zeros"),
    Row("vision.blocks.{b}.mlp.w1.weight", "bf16",  # fused SwiGLU gate and up
        lambda c, l: (2 * _vision(c).intermediate_size, _vision(c).hidden_size), "vision_block", _has_vision,
        "skip_vision", "lin:vision"),
    Row("vision.blocks.{b}.mlp.w2.weight", "bf16",
        lambda c, l: (_vision(c).hidden_size, _vision(c).intermediate_size), "vision_block", _has_vision,
        "skip_vision", "lin:vision"),
    Row("vision.blocks.{b}.norm1.weight", "bf16", lambda c, l: (_vision(c).hidden_size,), "vision_block",
        _has_vision, "skip_vision", "norm"),
    Row("vision.blocks.{b}.norm2.weight", "bf16", lambda c, l: (_vision(c).hidden_size,), "vision_block",
        _has_vision, "skip_vision", "norm"),
)
# fmt: on


def block_prefix(cfg: ModelConfig, layer: LayerSpec) -> str:
    """`layers.{i}` for backbone blocks, `mtp.{k}` for NextN / DSpark stages."""
    if layer.is_dspark:
        return f"mtp.{layer.layer_id - cfg.num_hidden_layers}"
    return f"layers.{layer.layer_id}"


def expand(row: Row, name: str, logical: Shape, cfg: ModelConfig) -> list[TensorSpec]:
    """One row instance -> its stored tensors (weight, and the scale of a quantized format)."""
    dtype = FORMAT_DTYPE[row.fmt]
    if row.fmt in ("bf16", "f32", "i64"):
        return [TensorSpec(name, dtype, logical, row, logical)]
    out, inp = logical
    scale_name = name.removesuffix(".weight") + ".scale"
    if row.fmt == "fp8":
        b = cfg.fp8_block
        stored, scale = logical, (-(-out // b), -(-inp // b))
    elif row.fmt == "fp4":
        stored, scale = (out, inp // 2), (out, inp // FP4_GROUP)
    else:  # fp8_rows
        stored, scale = logical, (out, inp // ROWS_GROUP)
    return [
        TensorSpec(name, dtype, stored, row, logical),
        TensorSpec(scale_name, "F8_E8M0", scale, row, scale, is_scale=True),
    ]


def expected_inventory(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor the official checkpoint of this config holds, from the config alone."""
    specs: list[TensorSpec] = []
    layers = cfg.layers()
    first = layers[0]  # placeholder layer for the global rules (they ignore it)
    for row in TABLE:
        if row.scope in ("global", "vision") and row.where(cfg, first):
            specs += expand(row, row.name, row.shape(cfg, first), cfg)
        elif row.scope == "vision_block" and row.where(cfg, first):
            for b in range(_vision(cfg).num_hidden_layers):
                specs += expand(row, row.name.format(b=b), row.shape(cfg, first), cfg)
    for layer in layers:
        p = block_prefix(cfg, layer)
        for row in TABLE:
            if row.scope == "block" and row.where(cfg, layer):
                specs += expand(row, row.name.format(p=p), row.shape(cfg, layer), cfg)
            elif row.scope == "expert" and row.where(cfg, layer):
                shape = row.shape(cfg, layer)
                for e in range(layer.n_experts):
                    specs += expand(row, row.name.format(p=p, e=e), shape, cfg)
    return specs


def summary(inventory: list[TensorSpec]) -> dict:
    """{"tensors", "bytes", "params", "by_dtype": {dtype: count}} of an inventory."""
    return {
        "tensors": len(inventory),
        "bytes": sum(s.nbytes for s in inventory),
        "params": sum(s.params for s in inventory),
        "by_dtype": dict(sorted(Counter(s.dtype for s in inventory).items())),
    }


def inventory_by_name(cfg: ModelConfig) -> dict[str, TensorSpec]:
    return {s.name: s for s in expected_inventory(cfg)}
