"""The engine on CUDA (Triton kernels, GPU slots, TP ranks on GPUs) against the CPU engine and the reference.

Runs where torch sees a GPU and the tests were asked to use it (DSFLASH_TEST_GPU=1; otherwise tests/conftest.py
puts Triton in its interpreter). Several ranks on one GPU run over gloo with host-staged collectives; with a GPU
per rank the same tests run over NCCL."""

import os

import pytest
import torch

from dsflash.gates.compare import compare_logits
from dsflash.gates.run import engine_scores, report
from dsflash.runtime.spec import EngineSpec
from dsflash.service.files import open_dir
from tests.model.conftest import ROOT
from tests.runtime.conftest import bfp8_at_every_tp, gate_spec

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(
        not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
        reason="needs a CUDA GPU and DSFLASH_TEST_GPU=1",
    ),
]


def test_cuda_engine_is_the_reference_with_bfp8_at_every_tp(setup, cache):
    want = setup[3]
    for tp, got in bfp8_at_every_tp(setup, cache, device="cuda"):
        r = report(want, got)
        assert r["pass"], (tp, r)
        assert r["experts"]["misses"] > 0
        for part in ("prefill", "decode"):
            assert compare_logits(getattr(want, part), getattr(got, part))["max_abs"] < 2e-3, (tp, part)


def test_cuda_engine_equals_the_cpu_engine_with_bfp4(setup, cache):
    files, ids, prefill, _ = setup
    kw = dict(tp=1, expert_slots=3, expert_format="bfp4_b", cache_dir=cache, rebuild=True)
    gpu = engine_scores(files, ids, prefill, gate_spec(device="cuda", **kw))
    cpu = engine_scores(files, ids, prefill, gate_spec(device="cpu", prefill_matmul="fp32", **kw))
    for part in ("prefill", "decode"):
        assert compare_logits(getattr(cpu, part), getattr(gpu, part))["max_abs"] < 2e-3, part


def test_slots_live_on_the_gpu(cache):
    """The slot pool is GPU memory sized slots x shard bytes, allocated once; host memory holds no expert."""
    from dsflash.runtime.tp.launch import start_engine

    files = open_dir(ROOT / "tiny_a" / "model")
    spec = EngineSpec(expert_slots=5, expert_format="bfp4_b", cache_dir=cache, device="cuda", rebuild_store=True)
    runner = start_engine(files.ckpt, files.token_map, 64, spec)
    try:
        experts = runner.rank0.experts
        assert experts.slots.is_cuda and experts.slots.shape[0] == 5
        assert experts.slots.shape[1] >= experts.layout.nbytes
        runner.reset()
        logits = runner.forward(list(range(3, 40)), 0, False)
        assert logits.device.type == "cpu" and torch.isfinite(logits).all()
        assert runner.counters().misses > 0
    finally:
        runner.close()


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_graph_decode_is_the_eager_decode(cache, name):
    """The decode step replayed as CUDA graphs (split at every MoE layer's slot lookup and every Engram lookup,
    runtime/cuda/graph.py) gives the eager step's logits, with few enough slots that the stages between the graphs
    copy misses in; a second sequence after a reset replays to the same bits."""
    from dsflash.runtime.tp.launch import start_engine

    files = open_dir(ROOT / name / "model")
    cfg = files.ckpt.config
    ids, prefill = list(range(3, 67)), 20
    out = {}
    for graphs in (True, False):
        spec = EngineSpec(expert_slots=4, expert_format="bfp4_b", cache_dir=cache, device="cuda", rebuild_store=graphs,
                          cuda_graph=graphs)  # fmt: skip
        runner = start_engine(files.ckpt, files.token_map, 96, spec)
        try:
            g = runner.rank0.graph
            assert (g is not None) == graphs
            if graphs:
                moe = sum(1 for s in cfg.layers() if not s.is_dspark)
                assert g.graphs == 1 + moe + len(cfg.engram_layer_ids)
            runs = []
            for _ in range(2 if graphs else 1):
                runner.reset()
                rows = [runner.forward(ids[:prefill], 0, False)[-1]]
                rows += [runner.forward([t], p, False)[-1] for p, t in enumerate(ids) if p >= prefill]
                runs.append(torch.stack(rows))
            if graphs:
                assert runner.counters().misses > 0
                assert torch.equal(runs[0], runs[1])
            out[graphs] = runs[0]
        finally:
            runner.close()
    assert compare_logits(out[False].numpy(), out[True].numpy())["max_abs"] < 1e-3


def test_fewer_slots_than_a_token_activates_decode_without_graphs(cache):
    """A captured step needs a token's experts resident together: below that many slots the rank decodes eagerly
    (in waves) instead of failing its first step."""
    from dsflash.runtime.tp.launch import start_engine

    files = open_dir(ROOT / "tiny_a" / "model")
    spec = EngineSpec(expert_slots=1, expert_format="bfp4_b", cache_dir=cache, device="cuda", rebuild_store=True)
    runner = start_engine(files.ckpt, files.token_map, 64, spec)
    try:
        assert runner.rank0.graph is None
        runner.reset()
        runner.forward(list(range(3, 20)), 0, False)
        assert torch.isfinite(runner.forward([7], 17, False)).all()
    finally:
        runner.close()
