"""ModelConfig: the HF config.json of DeepSeek-V4 / V4.1, read strictly, plus the per-layer schedule.

Field names are the HF keys (text_config for V4.1, the root for V4), so there is no mapping table
to get wrong. Unknown keys fail unless listed in an IGNORED set: a new key may change the model.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsflash.errors import ConfigError

V4 = "deepseek_v4"
V41 = "deepseek_v41"


@dataclass(frozen=True)
class RopeScaling:
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    rope_type: str = "yarn"


@dataclass(frozen=True)
class QuantConfig:
    quant_method: str = "fp8"
    weight_block_size: tuple[int, ...] = (128, 128)
    scale_fmt: str = "ue8m0"
    activation_scheme: str = "dynamic"
    fmt: str = "e4m3"
    expert_dtype: str = "fp4"


@dataclass(frozen=True)
class VisionConfig:
    """Accepted so that the released config parses; the vision tower itself is not implemented."""

    model_type: str = "deepseek_v41_vision"
    num_hidden_layers: int = 0
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 0
    max_wh_ratio: float | None = None


@dataclass(frozen=True)
class LayerSpec:
    """What one block owns and which earlier block it reads shared state from (architecture §2.5)."""

    layer_id: int
    ratio: int  # compress ratio; 0 = sliding window only
    is_dspark: bool  # a DSpark / MTP stage (layer_id >= num_hidden_layers)
    n_experts: int
    n_active: int
    is_kv_source: bool = False  # owns a Compressor (V4.1: and the index keys)
    is_index_source: bool = False  # runs an indexer query side
    kv_source: int | None = None  # layer whose compressed KV this layer attends to
    topk_source: int | None = None  # layer whose top-k selection this layer uses
    is_candidate_source: bool = False
    uses_candidates: bool = False
    has_engram: bool = False  # Engram is applied to the streams before this block
    is_dspark_tap: bool = False  # its input streams feed the DSpark head
    hash_routed: bool = False  # V4 hash layers (tid2eid)
    v4_overlap: bool = False  # V4 CSA: overlapping compressor + own indexer (ratio 4)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    num_key_value_heads: int = 1
    n_shared_experts: int = 1
    hidden_act: str = "silu"
    swiglu_limit: float = 0.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    gate_temp: float = 1.0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    num_nextn_predict_layers: int = 0
    # V4 only
    num_hash_layers: int = 0
    # V4.1: cross-layer shared compressed KV and the two-level indexer
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    # V4.1 Engram
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_vocab_size: int = 0
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 0
    # DSpark draft head (V4.1, V4-Flash-0731)
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    # root keys
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int | None = None
    image_token_id: int | None = None
    quantization_config: QuantConfig = field(default_factory=QuantConfig)
    vision_config: VisionConfig | None = None

    # ---- derived -------------------------------------------------------------------------
    @property
    def is_v41(self) -> bool:
        return self.model_type == V41

    @property
    def fp8_block(self) -> int:
        return self.quantization_config.weight_block_size[0]

    @property
    def n_dspark(self) -> int:
        """DSpark stages (V4.1) or NextN MTP blocks (V4)."""
        return self.num_nextn_predict_layers

    @property
    def has_dspark(self) -> bool:
        return self.dspark_block_size > 0 and self.num_nextn_predict_layers > 0

    @property
    def engram_n_cols(self) -> int:
        """Rows looked up per position per Engram layer: (max n-gram order - 1) x heads."""
        return max(self.engram_max_ngram_size - 1, 0) * self.engram_n_heads

    def layers(self) -> list[LayerSpec]:
        """Backbone blocks followed by the draft stages."""
        return _schedule(self)

    def layer(self, layer_id: int) -> LayerSpec:
        return self.layers()[layer_id]

    # ---- reading -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        return _parse_root(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Keys we know and deliberately do not use. Anything else unknown is an error.
IGNORED_ROOT = {"architectures", "transformers_version", "dtype", "torch_dtype", "auto_map", "_name_or_path"}
IGNORED_TEXT = {
    "model_type",
    "attention_bias",
    "attention_dropout",
    "initializer_range",
    "use_cache",
    "tie_word_embeddings",
    "dtype",
    "torch_dtype",
}
# root keys that live on ModelConfig directly in both layouts
ROOT_FIELDS = {"bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"}


def _parse_root(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in (V4, V41):
        raise ConfigError(f"model_type {model_type!r} is not a DeepSeek-V4 / V4.1 config ({V4!r} or {V41!r})")
    raw = dict(raw)
    values: dict[str, Any] = {"model_type": model_type}
    raw.pop("model_type")
    quant = raw.pop("quantization_config", None)
    vision = raw.pop("vision_config", None)
    if model_type == V41:
        text = raw.pop("text_config", None)
        if not isinstance(text, dict):
            raise ConfigError("a deepseek_v41 config needs a 'text_config' object")
        for key in list(raw):
            if key in ROOT_FIELDS:
                values[key] = raw.pop(key)
            elif key in IGNORED_ROOT:
                raw.pop(key)
        if raw:
            raise _unknown(sorted(raw)[0], "root")
        body = text
    else:
        body = raw
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    hints = typing.get_type_hints(ModelConfig)
    for key, value in body.items():
        if key in IGNORED_TEXT or key in IGNORED_ROOT:
            _check_ignored(key, value)
            continue
        if key not in fields or key in ("quantization_config", "vision_config", "model_type"):
            raise _unknown(key, "text_config" if model_type == V41 else "root")
        values[key] = _coerce(value, hints[key], key)
    if quant is not None:
        values["quantization_config"] = _parse_section(quant, QuantConfig, "quantization_config")
    if vision is not None:
        values["vision_config"] = _parse_section(vision, VisionConfig, "vision_config")
    missing = [n for n, f in fields.items() if _required(f) and n not in values]
    if missing:
        raise ConfigError(f"missing config key {missing[0]!r}")
    cfg = ModelConfig(**values)
    _validate(cfg)
    return cfg


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _unknown(key: str, where: str) -> ConfigError:
    return ConfigError(f"unknown config key {key!r} in {where} (add it to ModelConfig or the IGNORED lists)")


def _check_ignored(key: str, value: Any) -> None:
    # ignored does not mean any value goes: these would change the model if set otherwise
    if key == "tie_word_embeddings" and value:
        raise ConfigError("tie_word_embeddings=true is not a DeepSeek-V4 layout (head and embed are separate)")
    if key == "attention_bias" and value:
        raise ConfigError("attention_bias=true is not supported (DeepSeek-V4 linears have no bias)")


def _parse_section(raw: Any, cls: type, name: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{name} must be an object")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in raw.items():
        if key == "type" and cls is RopeScaling:  # V4 spells rope_type as type
            key = "rope_type"
        if key not in names:
            raise _unknown(key, name)
        values[key] = _coerce(value, hints[key], f"{name}.{key}")
    return cls(**values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check a JSON value against a field type; ints are accepted for floats, bools never for numbers."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if hint is RopeScaling:
        return _parse_section(value, RopeScaling, key)
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r} must be a list, got {value!r}")
        item = typing.get_args(hint)[0]
        return tuple(_coerce(v, item, key) for v in value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"config key {key!r} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key {key!r} must be a string, got {value!r}")
        return value
    raise ConfigError(f"config key {key!r}: unsupported type {hint}")  # pragma: no cover


def _validate(cfg: ModelConfig) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    n = cfg.num_hidden_layers
    positive = (
        "vocab_size hidden_size moe_intermediate_size num_hidden_layers num_attention_heads head_dim "
        "q_lora_rank o_lora_rank o_groups sliding_window n_routed_experts num_experts_per_tok hc_mult"
    )
    for name in positive.split():
        need(getattr(cfg, name) > 0, f"{name} must be positive, got {getattr(cfg, name)}")
    need(cfg.num_key_value_heads == 1, "num_key_value_heads must be 1 (one shared K=V head)")
    need(cfg.hidden_act == "silu", f"hidden_act {cfg.hidden_act!r} is not supported (silu)")
    need(cfg.n_shared_experts == 1, "n_shared_experts must be 1")
    need(cfg.scoring_func in ("sqrtsoftplus", "softmax", "sigmoid"), f"scoring_func {cfg.scoring_func!r} unknown")
    need(cfg.num_experts_per_tok <= cfg.n_routed_experts, "num_experts_per_tok exceeds n_routed_experts")
    need(cfg.num_attention_heads % cfg.o_groups == 0, "num_attention_heads must be divisible by o_groups")
    need(0 < cfg.qk_rope_head_dim <= cfg.head_dim and cfg.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even")
    need(len(cfg.compress_ratios) >= n, f"compress_ratios has {len(cfg.compress_ratios)} entries for {n} layers")
    need(all(r >= 0 for r in cfg.compress_ratios), "compress_ratios must be >= 0")
    need(len(cfg.quantization_config.weight_block_size) == 2, "weight_block_size must have two entries")
    block = cfg.fp8_block
    need(block > 0, "weight_block_size must be positive")
    if cfg.is_v41:
        need(cfg.head_dim % 32 == 0, "head_dim must be a multiple of 32 (FP8 / FP4 activation blocks)")
        if any(cfg.compress_ratios[:n]):
            need(cfg.index_n_heads > 0 and cfg.index_head_dim % 32 == 0, "index_head_dim must be a multiple of 32")
            need(cfg.qk_rope_head_dim <= cfg.index_head_dim, "qk_rope_head_dim exceeds index_head_dim")
            need(cfg.index_topk > 0, "index_topk must be positive")
        if cfg.num_nextn_predict_layers:
            need(
                len(cfg.compress_ratios) == n + cfg.num_nextn_predict_layers,
                "compress_ratios must list every backbone layer and every DSpark stage",
            )
        for lid in cfg.engram_layer_ids + cfg.dspark_target_layer_ids:
            need(0 <= lid < n, f"layer id {lid} out of range 0..{n - 1}")
        need(
            len(cfg.engram_num_embeddings) == len(cfg.engram_layer_ids),
            "engram_num_embeddings must have one entry per engram layer",
        )
        if cfg.engram_layer_ids:
            need(
                cfg.engram_max_ngram_size >= 2 and cfg.engram_n_heads > 0 and cfg.engram_head_dim > 0,
                "engram needs max_ngram_size >= 2, n_heads > 0 and head_dim > 0",
            )
            need(
                cfg.engram_compressed_vocab_size > 0 and cfg.engram_vocab_size > 1,
                "engram needs engram_vocab_size and engram_compressed_vocab_size",
            )
        if cfg.has_dspark:
            need(len(cfg.dspark_target_layer_ids) > 0, "DSpark needs dspark_target_layer_ids")
            need(cfg.dspark_markov_rank > 0, "DSpark needs dspark_markov_rank")
            need(all(r == 0 for r in cfg.compress_ratios[n:]), "DSpark stages must have compress ratio 0")
    _schedule(cfg)  # raises on inconsistent sharing


def _schedule(cfg: ModelConfig) -> list[LayerSpec]:
    n = cfg.num_hidden_layers
    specs = []
    kv_src = idx_src = None
    for i in range(n + cfg.num_nextn_predict_layers):
        ratio = cfg.compress_ratios[i] if i < len(cfg.compress_ratios) else 0
        dspark = i >= n
        n_exp, n_act = cfg.n_routed_experts, cfg.num_experts_per_tok
        if dspark and cfg.dspark_n_routed_experts:
            n_exp = cfg.dspark_n_routed_experts
            n_act = cfg.dspark_num_experts_per_tok or n_act
        if not cfg.is_v41:
            specs.append(_v4_spec(cfg, i, ratio, dspark, n_exp, n_act))
            continue
        spec = dict(layer_id=i, ratio=ratio, is_dspark=dspark, n_experts=n_exp, n_active=n_act)
        if not dspark and ratio > 0:
            if i in cfg.kv_source_layer_ids:
                if i not in cfg.index_source_layer_ids:
                    raise ConfigError(f"KV-source layer {i} must also be an index source (it owns the index keys)")
                kv_src = (i, ratio)
            if i in cfg.index_source_layer_ids:
                idx_src = (i, ratio)
            if kv_src is None or kv_src[1] != ratio:
                raise ConfigError(f"layer {i} (ratio {ratio}) has no preceding KV-source layer with the same ratio")
            if idx_src is None or idx_src[1] != ratio:
                raise ConfigError(f"layer {i} (ratio {ratio}) has no preceding index-source layer with the same ratio")
            cand = cfg.candidate_source_layer_id
            spec.update(
                is_kv_source=i in cfg.kv_source_layer_ids,
                is_index_source=i in cfg.index_source_layer_ids,
                kv_source=kv_src[0],
                topk_source=idx_src[0],
                is_candidate_source=i == cand,
                uses_candidates=i in cfg.index_source_layer_ids and 0 <= cand < i,
            )
            if spec["uses_candidates"] and cfg.compress_ratios[cand] != ratio:
                raise ConfigError(f"index source {i} uses the candidates of layer {cand}, which has another ratio")
        elif not dspark:
            for name, ids in (
                ("kv_source_layer_ids", cfg.kv_source_layer_ids),
                ("index_source_layer_ids", cfg.index_source_layer_ids),
            ):
                if i in ids:
                    raise ConfigError(f"{name} lists layer {i}, which has compress ratio 0")
        cand = cfg.candidate_source_layer_id
        if cand >= 0 and (cand >= n or cand not in cfg.index_source_layer_ids):
            raise ConfigError(f"candidate_source_layer_id {cand} must be an index-source layer")
        if cand >= 0 and (cfg.candidate_topk_blocks <= 0 or cfg.candidate_block_size <= 0):
            raise ConfigError("candidate_topk_blocks and candidate_block_size must be positive")
        spec.update(
            has_engram=i in cfg.engram_layer_ids and not dspark,
            is_dspark_tap=i in cfg.dspark_target_layer_ids and not dspark,
        )
        specs.append(LayerSpec(**spec))
    return specs


def _v4_spec(cfg: ModelConfig, i: int, ratio: int, dspark: bool, n_exp: int, n_act: int) -> LayerSpec:
    own = ratio > 0 and not dspark
    return LayerSpec(
        layer_id=i,
        ratio=ratio,
        is_dspark=dspark,
        n_experts=n_exp,
        n_active=n_act,
        is_kv_source=own,
        is_index_source=own and ratio == 4,
        kv_source=i if own else None,
        topk_source=i if own and ratio == 4 else None,
        hash_routed=not dspark and i < cfg.num_hash_layers,
        v4_overlap=own and ratio == 4,
    )


def v41_checkpoint_config(text: dict, bos: int, eos: int, block: int = 128) -> dict:
    """An official DeepSeek-V4.1 config.json around its text_config: the architecture, the special ids and the FP8
    (E8M0-scaled blocks of `block` x `block`) / FP4-expert quantization the release declares. For the models dsflash
    writes itself (the embedded and the demo model)."""
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": 2,
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "scale_fmt": "ue8m0",
            "weight_block_size": [block, block],
            "expert_dtype": "fp4",
        },
        "text_config": text,
    }
