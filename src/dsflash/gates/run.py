"""`dsflash gates`: the engine against DeepSeek's reference on the same mixed text, teacher-forced."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np

from dsflash.gates.compare import compare_logits
from dsflash.gates.reference import reference_forward, runner_forward
from dsflash.gates.suites import DEFAULT_TOKENS, Thresholds, gate_tokens, split
from dsflash.runtime.launch import prepare_store, start_runner
from dsflash.runtime.loader import load_reference
from dsflash.runtime.rank import resolve_device
from dsflash.runtime.scoring import decode_logits, prefill_logits
from dsflash.service.files import ModelFiles
from dsflash.store.layout import resolve_tile_format


@dataclass
class Scores:
    prefill: np.ndarray  # [T, V] one forward over every token
    decode: np.ndarray  # [T - P, V] teacher-forced steps after a P-token prefill
    counters: dict | None = None  # the engine's expert counters


def gate_ids(files: ModelFiles, tokens: int = DEFAULT_TOKENS) -> tuple[list[int], int]:
    ids = gate_tokens(files.tokenizer.encode, files.tokenizer.bos_id, tokens)
    return ids, split(len(ids))[0]


def _score(forward, ids: list[int], prefill: int) -> tuple[np.ndarray, np.ndarray]:
    return prefill_logits(forward, ids), decode_logits(forward, ids, prefill)


def reference_scores(files: ModelFiles, ids: list[int], prefill: int, qat: bool = False) -> Scores:
    ref = load_reference(files.ckpt, files.token_map, qat=qat, dspark=False)
    scores = Scores(*_score(reference_forward(ref, len(ids)), ids, prefill))
    del ref
    gc.collect()  # the reference's fp32 experts go before an engine starts
    return scores


def engine_scores(
    files: ModelFiles,
    ids: list[int],
    prefill: int,
    tp: int = 1,
    expert_slots: int | None = None,
    expert_format: str = "bfp4_b",
    cache_dir: str | None = None,
    qat: bool = False,
    progress: bool = False,
    prefill_matmul: str = "auto",
    device: str = "auto",
    rebuild: bool = False,
    cuda_graph: bool = True,
) -> Scores:
    runner = start_runner(
        files.ckpt,
        files.token_map,
        len(ids),
        tp=tp,
        expert_slots=expert_slots,
        expert_format=expert_format,
        cache_dir=cache_dir,
        qat=qat,
        progress=progress,
        prefill_matmul=prefill_matmul,
        device=device,
        rebuild=rebuild,
        cuda_graph=cuda_graph,
    )
    try:
        pre, dec = _score(runner_forward(runner), ids, prefill)
        counters = {**runner.counters(), "slots": runner.rank0.experts.pool.n_slots}
    finally:
        runner.close()
    return Scores(pre, dec, counters)


def report(want: Scores, got: Scores, thresholds: Thresholds | None = None) -> dict:
    keys = ("decisive_top1", "mean_kl", "n_decisive", "n")
    out = {part: {k: compare_logits(getattr(want, part), getattr(got, part))[k] for k in keys}
           for part in ("prefill", "decode")}  # fmt: skip
    c = got.counters or {}
    lookups = c.get("hits", 0) + c.get("misses", 0)
    out["experts"] = {
        "hit_rate": c["hits"] / lookups if lookups else 0.0,
        "bytes": c.get("bytes_copied", 0),
        "hits": c.get("hits", 0),
        "misses": c.get("misses", 0),
        "slots": c.get("slots", 0),
    }
    failures = (thresholds or Thresholds()).failures(out)
    out["pass"], out["failures"] = not failures, failures
    return out


def run_gates(
    files: ModelFiles,
    tp: int = 1,
    expert_slots: int | None = None,
    tokens: int = DEFAULT_TOKENS,
    expert_format: str = "auto",
    cache_dir: str | None = None,
    qat: bool = False,
    thresholds: Thresholds | None = None,
    progress: bool = False,
    device: str = "auto",
    rebuild: bool = False,
    cuda_graph: bool = True,
) -> dict:
    """Score reference and engine on the same tokens; the report says which thresholds fail (if any)."""
    device = resolve_device(device)  # a device this machine lacks fails now, not after the reference has run
    expert_format = resolve_tile_format(expert_format, files.ckpt.config)
    # the store first: a refused TP degree or a store made for something else fails before the reference runs
    prepare_store(files.ckpt, cache_dir, tp, expert_format, rebuild, progress)
    ids, prefill = gate_ids(files, tokens)
    want = reference_scores(files, ids, prefill, qat)
    got = engine_scores(
        files, ids, prefill, tp, expert_slots, expert_format, cache_dir, qat, progress, device=device,
        cuda_graph=cuda_graph,
    )  # fmt: skip
    out = report(want, got, thresholds)
    out["config"] = {
        "tp": tp,
        "expert_format": expert_format,
        "tokens": len(ids),
        "prefill": prefill,
        "qat": qat,
        "device": device,
    }
    return out
