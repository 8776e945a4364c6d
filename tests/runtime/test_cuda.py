"""The engine on CUDA (Triton kernels, GPU slots, TP ranks on GPUs) against the CPU engine and the reference.

Runs where torch sees a GPU and the tests were asked to use it (DSFLASH_TEST_GPU=1; otherwise tests/conftest.py
puts Triton in its interpreter). Several ranks on one GPU run over gloo with host-staged collectives; with a GPU
per rank the same tests run over NCCL."""

import os

import pytest
import torch

from dsflash.gates.compare import compare_logits
from dsflash.gates.run import engine_scores, report
from dsflash.service.files import open_dir
from tests.model.conftest import ROOT
from tests.runtime.conftest import bfp8_at_every_tp

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
    gpu = engine_scores(files, ids, prefill, device="cuda", **kw)
    cpu = engine_scores(files, ids, prefill, device="cpu", prefill_matmul="fp32", **kw)
    for part in ("prefill", "decode"):
        assert compare_logits(getattr(cpu, part), getattr(gpu, part))["max_abs"] < 2e-3, part


def test_slots_live_on_the_gpu(cache):
    """The slot pool is GPU memory sized slots x shard bytes, allocated once; host memory holds no expert."""
    from dsflash.runtime.launch import start_runner

    files = open_dir(ROOT / "tiny_a" / "model")
    runner = start_runner(files.ckpt, files.token_map, 64, expert_slots=5, cache_dir=cache, device="cuda", rebuild=True)
    try:
        experts = runner.rank0.experts
        assert experts.slots.is_cuda and experts.slots.shape[0] == 5
        assert experts.slots.shape[1] >= experts.layout.nbytes
        runner.reset()
        logits = runner.forward(list(range(3, 40)), 0, False)
        assert logits.device.type == "cpu" and torch.isfinite(logits).all()
        assert runner.counters()["misses"] > 0
    finally:
        runner.close()
