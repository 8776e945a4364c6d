"""The fused CPU kernels the engine puts into the model's hooks (runtime/cpu/fused.py) change nothing but rounding."""

import pytest
import torch

from dsflash.model.block import Block
from dsflash.model.engram import Engram
from dsflash.model.layers import RMSNorm
from dsflash.model.moe import Gate, SharedExpert
from dsflash.runtime.cpu import native
from dsflash.runtime.spec import EngineSpec
from dsflash.runtime.tp.launch import start_engine
from dsflash.service.files import open_dir
from dsflash.store.build import build_store
from tests.model.conftest import ROOT

HOOKS = {
    Block: ("fused_mixes", "fused_collapse_norm", "fused_expand"),
    SharedExpert: ("fused",),
    RMSNorm: ("fused",),
    Gate: ("fused",),
    Engram: ("fused",),
}


def _run(runner, ids: list[int], steps: int) -> list[torch.Tensor]:
    runner.reset()
    out = [runner.forward(ids, 0, False)[-1]]
    pos, token = len(ids), int(out[-1].argmax())
    for _ in range(steps):
        out.append(runner.forward([token], pos, False)[-1])
        pos, token = pos + 1, int(out[-1].argmax())
    return out


def test_engine_with_fused_kernels_is_the_engine_without(tmp_path):
    """tiny_a at TP 1: every hook is filled on the CPU (the shared expert's where its weights are FP8, the rotary
    embeddings' too), and a prefill plus greedy decode steps give the logits of the same engine with the hooks
    emptied, to float32 noise."""
    if native.lib() is None:
        pytest.skip("no C compiler: the hooks stay empty")
    files = open_dir(ROOT / "tiny_a" / "model")
    build_store(files.ckpt, tmp_path, tp=1, fmt="bfp4_b", progress=False)
    spec = EngineSpec(expert_slots=8, expert_format="bfp4_b", qat=False, cache_dir=str(tmp_path), threads=2)
    runner = start_engine(files.ckpt, files.token_map, 128, spec)
    try:
        model = runner.rank0.model
        filled = {}
        for m in model.modules():
            for cls, attrs in HOOKS.items():
                if isinstance(m, cls):
                    filled[m] = {a: getattr(m, a) for a in attrs}
        assert all(v is not None for hooks in filled.values() for v in hooks.values())
        ropes = list(model.ropes.values())
        assert all(r.fused is not None for r in ropes)
        assert any(isinstance(m, SharedExpert) for m in filled)
        ids = files.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)[:40]
        fused = _run(runner, ids, 6)
        for m, hooks in filled.items():
            for a in hooks:
                setattr(m, a, None)
        for r in ropes:
            r.fused = None
        plain = _run(runner, ids, 6)
        for f, p in zip(fused, plain, strict=True):
            torch.testing.assert_close(f, p, atol=1e-4, rtol=1e-4)
    finally:
        runner.close()
