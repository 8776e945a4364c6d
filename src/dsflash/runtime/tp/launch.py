"""The one path that builds an engine over a model, in the steps the boot times as its phases: make sure the expert
store exists for this TP degree and format (building it on first use; one made for something else is replaced
only when asked), start every rank with its dense shard, then give every rank its state and slots. `dsflash serve`
(service.boot) calls the steps one phase at a time; gates, `dsflash logits`, tests and benchmarks call
`start_engine`, which runs them all."""

from __future__ import annotations

from dsflash.checkpoint.index import Checkpoint
from dsflash.runtime.spec import EngineSpec, check_tp, resolve
from dsflash.runtime.tp.workers import TPRunner
from dsflash.store.build import build_store


def prepare_store(ckpt: Checkpoint, spec: EngineSpec, progress: bool = False):
    """The store for this TP degree and format, built or finished on first use (beside the model's stores for other
    degrees or formats, which stay). One in its place from another revision of the model or store version is
    replaced only with spec.rebuild_store (V4.1-Flash's takes tens of minutes to build); otherwise StoreMismatch
    says so before anything else runs. -> its manifest."""
    check_tp(ckpt.config, spec.tp)
    return build_store(
        ckpt, spec.cache_dir, tp=spec.tp, fmt=spec.expert_format, progress=progress, rebuild=spec.rebuild_store
    )


def start_dense(ckpt: Checkpoint, token_map, max_len: int, spec: EngineSpec) -> TPRunner:
    """Every rank started, rank 0 with its dense shard loaded (the others load theirs meanwhile)."""
    return TPRunner(str(ckpt.path), max_len, spec, token_map)


def allocate(runner: TPRunner) -> TPRunner:
    """Every rank's decode state, slot pool and graphs over the store; closes the ranks where that fails."""
    try:
        runner.allocate()
    except BaseException:
        runner.close()
        raise
    return runner


def start_ranks(ckpt: Checkpoint, token_map, max_len: int, spec: EngineSpec) -> TPRunner:
    """Every rank with its dense shard, slots and state, over a store that exists (prepare_store)."""
    return allocate(start_dense(ckpt, token_map, max_len, spec))


def start_engine(ckpt: Checkpoint, token_map, max_len: int, spec: EngineSpec, progress: bool = False) -> TPRunner:
    """The engine's runner for `ckpt` as `spec` says (resolved here for this machine and model), store included."""
    spec = resolve(spec, ckpt.config)
    prepare_store(ckpt, spec, progress)
    return start_ranks(ckpt, token_map, max_len, spec)
