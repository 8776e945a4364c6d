"""The fused fp32 prefill product on packed weights (native.packed_linear, csrc/packed_cpu.c) against the whole
expansion times torch's matmul, for the native build, the AVX2 build forced (covered on a CPU with AVX-512 too), the
portable build (no fused product: the layers expand instead) and no build."""

from pathlib import Path

import numpy as np
import pytest
import torch

from dsflash.formats import bfp, fp8
from dsflash.runtime.cpu import native
from dsflash.runtime.cpu.dense import Bf16Weight, Fp8Weight

CPUINFO = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
HAS_AVX2 = all(f in CPUINFO.split() for f in ("avx2", "fma", "f16c"))
TOKENS = (1, 7, 33, 100)  # ragged: one vector, a part of one, several micro-kernel widths and their tails
SHAPE = (96, 640)  # 3 panels; K 2.5 k-blocks (the last one ragged)


@pytest.fixture(autouse=True, scope="module")
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def builds():
    out = {"native": native.lib(), "generic": native.build(native.GENERIC_FLAGS), "none": False}
    if HAS_AVX2:
        out["avx2"] = native.build(native.AVX2_FLAGS)
    return out


@pytest.fixture(params=["native", "avx2", "generic", "none"])
def kernels(request, builds, monkeypatch):
    if request.param not in builds:
        pytest.skip("this CPU has no AVX2")
    if builds[request.param] is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(native, "_lib", builds[request.param])
    return request.param


@pytest.fixture(scope="module")
def weights():
    """Each format's packed W with its exact fp32 values: (fmt, packed, scale256, block, shape, W)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(SHAPE) * 0.05).astype(np.float32)
    w[5, :16] = 0  # an all-zero face row
    out = []
    for fmt in ("bfp4_b", "bfp8_b"):
        tiles = bfp.pack(w, fmt)
        out.append((fmt, tiles, None, 0, SHAPE, torch.from_numpy(bfp.unpack(tiles, fmt, SHAPE))))
    # FP8: 72 rows (not a multiple of the 32-row panel), scale blocks of 32 over a ragged last k-block
    f = Fp8Weight.quantized(torch.from_numpy(w[:72]), 32)
    exact = fp8.dequant_block(f.q.view(torch.float8_e4m3fn), f.scale, 32)
    out.append(("fp8", f.q, f.scale256, 32, tuple(f.q.shape), exact))
    b = torch.from_numpy(w[:40, :600]).bfloat16()  # bf16 rows: 40 x 600
    out.append(("bf16", b, None, 0, tuple(b.shape), b.float()))
    return out


def fused(fmt, packed, scale, block, shape, x):
    return native.packed_linear(x, packed, fmt, shape, scale, block)


def test_fused_product_is_the_expansion_times_matmul(kernels, weights):
    """fp32-grade against the float64 product of the exact weights, on ragged token counts; None (expand instead)
    exactly where the build has no vector path."""
    ready = kernels in ("native", "avx2")
    assert native.f32_packed_ready() == ready
    gen = torch.Generator().manual_seed(11)  # seeded: a draw is a fixed test
    for fmt, packed, scale, block, shape, W in weights:
        for m in TOKENS:
            x = torch.randn(m, shape[1], generator=gen)
            y = fused(fmt, packed, scale, block, shape, x)
            if not ready:
                assert y is None
                continue
            want = (x.double() @ W.double().T).float()
            torch.testing.assert_close(y, want, atol=2e-6, rtol=1e-5)
            # torch's own sum order is of the same grade (its worst output lands a little past 2e-6 on some draws)
            torch.testing.assert_close(x @ W.T, want, atol=4e-6, rtol=1e-5)


def test_fused_bits_do_not_depend_on_rows_tokens_or_threads(kernels, weights):
    """A TP shard's rows, a chunk's tokens and the thread count leave every output's bits as they are."""
    if kernels not in ("native", "avx2"):
        pytest.skip("no fused product in this build")
    for fmt, packed, scale, block, shape, _ in weights:
        x = torch.randn(100, shape[1])
        full = fused(fmt, packed, scale, block, shape, x)
        for m in TOKENS[:-1]:
            assert torch.equal(fused(fmt, packed, scale, block, shape, x[:m]), full[:m])
        torch.set_num_threads(1)
        try:
            assert torch.equal(fused(fmt, packed, scale, block, shape, x), full)
        finally:
            torch.set_num_threads(2)
        if fmt in native.MBITS:  # tile rows 1-2 of the tiles: a shard of rows 32-95
            tc = shape[1] // 32
            per = packed.nbytes // (shape[0] // 32 * tc)
            shard = packed[tc * per :]
            assert torch.equal(fused(fmt, shard, None, 0, (64, shape[1]), x), full[:, 32:])
        elif fmt == "fp8":
            s = Fp8Weight(packed, torch.empty(0), block, scale256=scale).rows(32, 72)
            assert torch.equal(fused(fmt, s.q, s.scale256, block, (40, shape[1]), x), full[:, 32:])
        else:
            assert torch.equal(fused(fmt, packed[8:], None, 0, (32, shape[1]), x), full[:, 8:])


def test_avx2_and_native_builds_agree_bit_for_bit(builds, weights):
    """One chain of fused multiply-adds per output in k order, whatever the vector width: an AVX-512 build (here
    where the CPU has it) gives the AVX2 build's bits."""
    if "avx2" not in builds or not builds["native"] or not builds["avx2"]:
        pytest.skip("no AVX2 build")
    fmt, packed, scale, block, shape, _ = weights[2]
    x = torch.randn(33, shape[1])
    got = []
    for name in ("native", "avx2"):
        native._lib = builds[name]
        got.append(fused(fmt, packed, scale, block, shape, x))
    native._lib = None
    assert torch.equal(got[0], got[1])


def test_dense_layers_and_experts_take_it_for_many_rows(kernels, weights):
    """The fp32 prefill path of the dense weights and of a routed expert runs the fused product where it exists
    (its bits), and the whole expansion times matmul elsewhere (fp32-close)."""
    from dsflash.model.experts import swiglu
    from dsflash.runtime.experts.device import CpuDevice, PackedMatrix, ShardLayout

    ready = kernels in ("native", "avx2")
    _, packed, scale, block, shape, W = weights[2]
    x = torch.randn(33, shape[1])
    layer = Fp8Weight(packed, torch.empty(0), block, scale256=scale)
    if not ready:  # the fallback expands with the kernels (or fp8.dequant_block without them): needs the scales
        layer = Fp8Weight.exact(W, block)
    y = layer.linear(x)
    torch.testing.assert_close(y, x @ W.T, atol=2e-6, rtol=1e-5)
    if ready:
        assert torch.equal(y, fused("fp8", packed, scale, block, shape, x))
    b = weights[3]
    xb = torch.randn(20, b[4][1])
    yb = Bf16Weight(b[1]).linear(xb)
    torch.testing.assert_close(yb, xb @ b[5].T, atol=2e-6, rtol=1e-5)
    if ready:
        assert torch.equal(yb, fused("bf16", b[1], None, 0, b[4], xb))

    rng = np.random.default_rng(2)
    d, inter, fmt = 128, 64, "bfp8_b"
    mats = [(rng.standard_normal(s) * 0.1).astype(np.float32) for s in ((inter, d), (inter, d), (d, inter))]
    tiles = [bfp.pack(m, fmt) for m in mats]
    sizes = [t.nbytes for t in tiles]
    o1, o3, o2, end = np.cumsum([0, *sizes]).tolist()
    layout = ShardLayout(fmt, PackedMatrix(o1, sizes[0], inter, d), PackedMatrix(o3, sizes[1], inter, d),
                         PackedMatrix(o2, sizes[2], d, inter), end)  # fmt: skip
    dev = CpuDevice()
    slots = dev.allocate(2, end)
    slots[1, :end] = np.concatenate(tiles)
    xs, ws = torch.randn(40, d), torch.rand(40, 1)
    w1, w3, w2 = (torch.from_numpy(bfp.unpack(t, fmt, m.shape)).double() for t, m in zip(tiles, mats, strict=True))
    h = swiglu(xs.double() @ w1.T, xs.double() @ w3.T, 1.0) * ws.double()
    got = dev.expert(slots, 1, layout, xs, ws, 1.0)
    torch.testing.assert_close(got, (h @ w2.T).float(), atol=2e-6, rtol=1e-5)
    if ready:  # a chunk's tokens: the same bits (the BLAS on the expansion promises no such thing)
        assert torch.equal(dev.expert(slots, 1, layout, xs[:17], ws[:17], 1.0), got[:17])
    dev.close()
