"""The engine's resources: memory stays within dense + slots + caches, dead ranks fail fast, stop frees ranks."""

import json
import multiprocessing as mp
import os
import signal
import time
from dataclasses import replace

import pytest
import torch

from dsflash.checkpoint.writer import write_checkpoint
from dsflash.errors import EngineDead
from dsflash.runtime.scheduler.engine import Engine
from dsflash.runtime.scheduler.queue import GenerationRequest
from dsflash.runtime.scheduler.sampler import SamplingParams
from dsflash.runtime.spec import EngineSpec
from dsflash.runtime.tp.launch import start_engine
from dsflash.service.files import open_dir
from dsflash.store.build import build_store
from tests.model.conftest import ROOT


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """tiny_a's schedule with wider experts: a store of ~230 MB against a pool of 16 slots (~14 MB)."""
    raw = json.loads((ROOT / "tiny_a" / "model" / "config.json").read_text())
    raw["text_config"].update(hidden_size=512, moe_intermediate_size=1024, n_routed_experts=64, num_hidden_layers=4,
                              compress_ratios=[0, 0, 2, 1, 0, 0], kv_source_layer_ids=[2, 3],
                              index_source_layer_ids=[2, 3], candidate_source_layer_id=3, engram_layer_ids=[1],
                              engram_num_embeddings=[660], dspark_target_layer_ids=[1, 2, 3])  # fmt: skip
    out = tmp_path_factory.mktemp("wide")
    write_checkpoint(raw, out / "model", seed=3, tokenizer_dir=ROOT / "tiny_a" / "model")
    return open_dir(out / "model"), str(out / "stores")


def _engine_memory(model_dir: str, cache: str) -> dict:
    """Run in a fresh process, as a rank is: the resident set of that process alone, not of the test runner (whose
    earlier tests and kernel compilations would count against the engine)."""
    files = open_dir(model_dir)
    spec = EngineSpec(expert_slots=16, expert_format="bfp4_b", cache_dir=cache, qat=False, threads=1)
    runner = start_engine(files.ckpt, files.token_map, 512, spec)
    try:
        exp = runner.rank0.experts
        prompt = list(range(3, 259))
        runner.reset()
        runner.forward(prompt[:16], 0, False)  # warm up allocators and kernels
        before = _rss()
        runner.reset()
        runner.forward(prompt, 0, False)  # a 256-token prefill routes to nearly every expert of every layer
        for pos in range(256, 264):  # and decode steps, whose misses go through the same slots
            runner.forward([7], pos, False)
        dense = sum(p.numel() * p.element_size() for p in runner.rank0.model.parameters())
        caches = sum(t.numel() * t.element_size() for st in runner.rank0.state.layers
                     for t in vars(st).values() if isinstance(t, torch.Tensor))  # fmt: skip
        return {"grown": _rss() - before, "rss": _rss(), "copied": exp.bytes_copied, "slots": exp.slots.nbytes,
                "dense": dense + runner.rank0.dense_bytes, "caches": caches}  # fmt: skip
    finally:
        runner.close()


def test_resident_memory_stays_within_dense_slots_and_caches(wide):
    files, cache = wide
    store_bytes = build_store(files.ckpt, cache, tp=1, fmt="bfp4_b", progress=False).total_bytes()
    with mp.get_context("spawn").Pool(1) as pool:
        m = pool.apply(_engine_memory, (str(files.path), cache))
    assert store_bytes > 10 * m["slots"]
    assert m["copied"] > store_bytes / 2  # most of the store went through the slots ...
    assert m["grown"] < store_bytes / 3, m  # ... without staying in the process
    assert m["rss"] < m["dense"] + m["slots"] + m["caches"] + (1 << 30), m


def test_slots_fit_the_memory_left(wide, monkeypatch):
    """The default pool shrinks to the memory left for it; an explicit count that does not fit is refused with one
    that would, before anything is allocated (not killed for memory half-way through a boot)."""
    from dsflash.errors import ConfigError
    from dsflash.runtime.experts.device import CpuDevice

    files, cache = wide
    store = build_store(files.ckpt, cache, tp=1, fmt="bfp4_b", progress=False)
    stride = store.geometry.stride
    monkeypatch.setattr(CpuDevice, "slot_budget", lambda self: 10 * stride + stride // 2)
    # (prefix reuse off: its host memory would come out of this budget too, test_prefix_memory.py)
    spec = EngineSpec(expert_format="bfp4_b", cache_dir=cache, qat=False, threads=1, prefix_cache=False)
    runner = start_engine(files.ckpt, files.token_map, 64, spec)
    try:
        assert runner.rank0.experts.pool.n_slots == 10  # not 4500, nor every expert of the model
        runner.reset()
        assert runner.forward(list(range(3, 40)), 0, False).shape[-1] == files.ckpt.config.vocab_size
    finally:
        runner.close()
    with pytest.raises(ConfigError, match=r"16 expert slots of [\d.]+ MB need .* use --expert-slots 10 or fewer"):
        start_engine(files.ckpt, files.token_map, 64, replace(spec, expert_slots=16))
    monkeypatch.setattr(CpuDevice, "slot_budget", lambda self: stride - 1)
    with pytest.raises(ConfigError, match="free some memory first"):
        start_engine(files.ckpt, files.token_map, 64, spec)


@pytest.fixture()
def tp2(tmp_path):
    files = open_dir(ROOT / "tiny_a" / "model")
    build_store(files.ckpt, str(tmp_path), tp=2, fmt="bfp4_b", progress=False)
    spec = EngineSpec(tp=2, expert_slots=8, expert_format="bfp4_b", cache_dir=str(tmp_path), threads=1)
    return start_engine(files.ckpt, files.token_map, 256, spec)


def test_a_dead_rank_fails_the_engine_fast_and_clearly(tp2):
    engine = Engine(tp2, eos_ids={1}).start()
    try:
        list(engine.submit(GenerationRequest((5, 6, 7), SamplingParams(temperature=0, max_tokens=2))))
        os.kill(tp2.procs[0].pid, signal.SIGKILL)
        tp2.procs[0].join(5)
        t0 = time.monotonic()
        with pytest.raises(EngineDead, match="rank 1"):
            list(engine.submit(GenerationRequest((5, 6, 7), SamplingParams(temperature=0, max_tokens=2))))
        assert time.monotonic() - t0 < 30
        with pytest.raises(EngineDead):  # later requests fail at once (at submit, or at the first event if racing)
            list(engine.submit(GenerationRequest((5,), SamplingParams(max_tokens=1))))
        time.sleep(0.2)
        with pytest.raises(EngineDead, match="rank 1"):
            engine.submit(GenerationRequest((5,), SamplingParams(max_tokens=1)))
    finally:
        engine.close()
        tp2.close()


def test_an_idle_engine_outlives_the_collective_timeout(tmp_path, monkeypatch):
    """The followers wait for the next step in a collective with the group's timeout; the engine's keep-alive
    steps let a server idle longer than that serve its next request (without them it fails: RankFailed)."""
    monkeypatch.setenv("DSFLASH_COLLECTIVE_TIMEOUT_S", "10")  # read by every rank as it joins (spawned: inherited)
    files = open_dir(ROOT / "tiny_a" / "model")
    build_store(files.ckpt, str(tmp_path), tp=2, fmt="bfp4_b", progress=False)
    spec = EngineSpec(tp=2, expert_slots=8, expert_format="bfp4_b", cache_dir=str(tmp_path), threads=1)
    runner = start_engine(files.ckpt, files.token_map, 256, spec)
    engine = Engine(runner, eos_ids=set()).start()
    try:
        request = GenerationRequest((5, 6, 7), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        first = [e.token for e in engine.submit(request)]
        time.sleep(14)
        assert [e.token for e in engine.submit(request)] == first
        assert all(p.is_alive() for p in runner.procs)
    finally:
        engine.close()
        runner.close()


def test_stop_frees_every_rank(tp2):
    procs = list(tp2.procs)
    tp2.reset()
    tp2.forward([5, 6, 7], 0, False)
    tp2.close()
    assert all(not p.is_alive() for p in procs)
