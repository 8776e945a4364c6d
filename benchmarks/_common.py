"""What the benchmarks share: the checkpoints they run on (the tiny fixture, generated ones with the real V4.1
widths) and the memcpy baseline."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from dsflash.checkpoint.writer import write_checkpoint
from dsflash.config import ModelConfig
from dsflash.model.engram import engram_primes

ROOT = Path(__file__).resolve().parents[1]
REAL_CONFIG = ROOT / "tests" / "data" / "configs" / "deepseek-v4.1-flash.config.json"
TINY = ROOT / "tests" / "data" / "dsv41_tiny" / "tiny_a" / "model"
CACHE = Path(os.environ.get("DSFLASH_BENCH_CACHE", "/tmp/dsflash-bench"))


def real_width_config(layers: int, experts: int) -> dict:
    """The released V4.1 config cut to `layers` blocks and `experts` routed experts, every block kind kept:
    SWA, Engram, a ratio-2 KV/index source, a ratio-1 candidate source (layers >= 4 adds consumers)."""
    raw = json.loads(REAL_CONFIG.read_text())
    raw.pop("vision_config", None)
    raw.pop("image_token_id", None)
    t = raw["text_config"]
    if layers >= 4:
        n2 = (layers - 2) // 2
        ratios = [0, 0] + [2] * n2 + [1] * (layers - 2 - n2)
    else:  # too few blocks for a window-only head: keep one ratio-2 and one ratio-1 source
        ratios = [0] * (layers - 2) + [2, 1]
    ratio2, ratio1 = ratios.index(2), ratios.index(1)
    t.update(
        num_hidden_layers=layers,
        n_routed_experts=experts,
        compress_ratios=ratios,
        kv_source_layer_ids=[ratio2, ratio1],
        index_source_layer_ids=[ratio2, ratio1],
        candidate_source_layer_id=ratio1,
        engram_layer_ids=(engram := sorted({1, layers - 1})),
        engram_num_embeddings=[0] * len(engram),  # placeholder: set from the primes below
        engram_vocab_size=1000,  # small tables: the benchmark is about the backbone, not 200 GB of Engram rows
        num_nextn_predict_layers=0,
        dspark_block_size=0,
        dspark_target_layer_ids=[],
    )
    cfg = ModelConfig.from_dict(raw)
    t["engram_num_embeddings"] = [sum(map(sum, layer)) for layer in engram_primes(cfg)]
    return raw


def generated(name: str, config: dict, seed: int = 0) -> Path:
    """Write (once) a random official-format checkpoint for `config` under the benchmark cache."""
    out = CACHE / name
    stamp = out / ".done"
    if stamp.exists() and json.loads(stamp.read_text()) == config:
        return out
    shutil.rmtree(out, ignore_errors=True)
    write_checkpoint(config, out, seed=seed, shards=2)
    stamp.write_text(json.dumps(config))
    return out


def memcpy_gbps(nbytes: int = 1 << 30, reps: int = 3, device: str = "cpu", pinned_src: bool = False) -> float:
    """Best of a few copies of a buffer larger than any cache (bytes copied per second): on torch's threads, within
    a GPU's memory (device cuda), or host to GPU from pinned memory (device cuda, pinned_src)."""
    on_gpu = device != "cpu"
    src = torch.ones(nbytes, dtype=torch.uint8, device="cpu" if pinned_src else device, pin_memory=pinned_src)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        if on_gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=pinned_src)
        if on_gpu:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9
