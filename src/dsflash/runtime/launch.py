"""Start the engine's ranks over a model: make sure the expert store exists for this TP degree and format
(building it on first use, rebuilding one made for something else), then spawn and load every rank."""

from __future__ import annotations

from dsflash.checkpoint.index import Checkpoint
from dsflash.runtime.rank import EngineOptions, resolve_device
from dsflash.runtime.workers import TPRunner, check_tp
from dsflash.store.build import build_store


def start_runner(
    ckpt: Checkpoint,
    token_map,
    max_len: int,
    tp: int = 1,
    expert_slots: int | None = None,
    expert_format: str = "bfp4_b",
    cache_dir: str | None = None,
    qat: bool = True,
    dense_format: str = "fp8",
    threads: int | None = None,
    progress: bool = False,
    prefill_matmul: str = "auto",
    device: str = "auto",
) -> TPRunner:
    check_tp(ckpt.config, tp)
    resolve_device(device)
    build_store(ckpt, cache_dir, tp=tp, fmt=expert_format, progress=progress, rebuild=True)
    opts = EngineOptions(
        str(ckpt.path),
        max_len,
        expert_slots=expert_slots,
        expert_format=expert_format,
        dense_format=dense_format,
        cache_dir=cache_dir,
        qat=qat,
        threads=threads,
        prefill_matmul=prefill_matmul,
        device=device,
    )
    return TPRunner(opts, tp, token_map, ckpt.config.vocab_size)
