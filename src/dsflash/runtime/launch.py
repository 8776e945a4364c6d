"""Start the engine's ranks over a model: make sure the expert store exists for this TP degree and format
(building it on first use; one made for something else is replaced only when asked), then spawn and load every
rank."""

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
    rebuild: bool = False,
    cuda_graph: bool = True,
) -> TPRunner:
    prepare_store(ckpt, cache_dir, tp, expert_format, rebuild, progress)
    resolve_device(device)
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
        rebuild_store=rebuild,
        cuda_graph=cuda_graph,
    )
    return TPRunner(opts, tp, token_map, ckpt.config.vocab_size)


def prepare_store(ckpt: Checkpoint, cache_dir: str | None, tp: int, fmt: str, rebuild: bool, progress: bool = False):
    """The store for this TP degree and format, built or finished on first use (beside the model's stores for other
    degrees or formats, which stay). One in its place from another revision of the model or store version is
    replaced only with rebuild=True (V4.1-Flash's takes tens of minutes to build); otherwise StoreMismatch says so
    before anything else runs."""
    check_tp(ckpt.config, tp)
    return build_store(ckpt, cache_dir, tp=tp, fmt=fmt, progress=progress, rebuild=rebuild)
