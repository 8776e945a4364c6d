"""The CUDA path's kernel and device: the tile decoding byte for byte, the bf16x2 products, and a tiny model run end
to end through CudaWeight and CudaDevice against the reference.

Without a GPU they run on CPU tensors through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET); with
DSFLASH_TEST_GPU=1 on a machine with one, the same tests run compiled on the GPU."""

import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from dsflash.formats import bfp, fp8  # noqa: E402
from dsflash.gates.compare import compare_logits  # noqa: E402
from dsflash.runtime.experts.cached import CachedExperts  # noqa: E402
from dsflash.runtime.reference.loader import build_model, load_reference  # noqa: E402
from dsflash.runtime.tp.rank import to_device  # noqa: E402
from dsflash.service.files import open_dir  # noqa: E402
from dsflash.store.build import build_store  # noqa: E402
from dsflash.store.reader import open_store  # noqa: E402
from tests.model.conftest import ROOT  # noqa: E402


def _interpreter_fixes():
    """Triton 3.6's interpreter under NumPy 2: loop bounds arrive as 1-element arrays, and tl.dot multiplies bf16
    operands as their raw uint16 storage. Both only in the interpreter; compiled kernels never see them."""
    from triton.runtime import interpreter as it

    if getattr(it, "_dsflash_fixed", False):
        return
    patch_tensor = it._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    dot = it.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        import triton.language as tl

        def f32(h):
            if h.dtype == tl.bfloat16:
                return it.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
            return h

        return dot(self, f32(a), f32(b), d, *args)

    it._patch_lang_tensor = patched
    it.InterpreterBuilder.create_dot = create_dot
    it._dsflash_fixed = True


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRETED else "cuda"


@pytest.fixture(scope="module")
def kernels():
    if INTERPRETED:
        _interpreter_fixes()
    elif not torch.cuda.is_available():
        pytest.skip("compiled Triton kernels need a GPU")
    from dsflash.runtime.cuda import device as cuda
    from dsflash.runtime.cuda import triton_linear

    return triton_linear, cuda


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


@pytest.mark.parametrize("fmt", ["bfp8_b", "bfp4_b"])
@pytest.mark.parametrize(("n", "k", "m"), [(64, 96, 1), (32, 32, 3), (96, 128, 20), (64, 64, 70)])
def test_tile_kernel_matches_the_unpacked_matrix(kernels, fmt, n, k, m):
    """Every face, nibble and exponent lands where formats.bfp puts it: products equal x @ unpack(tiles)^T to the
    bf16x2 rounding of x (2^-16 relative), for decode-sized and prefill-sized x, and for x narrower than the padded
    columns."""
    tl_, _ = kernels
    g = torch.Generator().manual_seed(n * 1000 + k + m)
    w = torch.randn(n, k, generator=g) * torch.exp(2 * torch.randn(n, k, generator=g))
    w[0, :16] = 0  # an all-zero face row: exponent 0
    w[1, 3] = -w[1, 3]
    packed = torch.from_numpy(bfp.pack(w, fmt))
    dense = torch.from_numpy(bfp.unpack(packed.numpy(), fmt, (n, k)))
    x = torch.randn(m, k, generator=g)
    for cols in (k, k - 32) if k > 32 else (k,):
        got = tl_.linear(x[:, :cols].to(DEV), packed.to(DEV), fmt, (n, k)).cpu()
        want = _exact(x[:, :cols], dense[:, :cols])
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert ((got.double() - want).abs() / want.abs().max()).max() < 4e-5


def test_bf16_kernel_on_row_views(kernels):
    tl_, cuda = kernels
    g = torch.Generator().manual_seed(7)
    w = torch.randn(80, 100, generator=g).bfloat16()
    x = torch.randn(40, 100, generator=g)
    weight = cuda.CudaWeight(w.to(DEV))
    want = _exact(x, w.float())
    got = weight.linear(x.to(DEV)).cpu()
    assert (got.double() - want).abs().max() / want.abs().max() < 4e-5
    assert (weight.rows(8, 40).linear(x.to(DEV)).cpu().double() - want[:, 8:40]).abs().max() / want.abs().max() < 4e-5
    # decode-sized and prefill-sized blocks give a token the same outputs up to the order of fp32 sums
    torch.testing.assert_close(got[2], weight.linear(x[2:3].to(DEV))[0].cpu(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(("n", "k", "m", "block"), [(160, 200, 1, 128), (64, 128, 20, 128), (256, 96, 70, 32)])
def test_fp8_kernel_matches_the_dequantized_matrix(kernels, n, k, m, block):
    """E4M3 bytes decoded bit for bit (normals, subnormals, signs, zeros) times each block's power of two (128: one
    scale per kernel block; 32, the tiny fixtures': several), on ragged shapes (partial scale blocks) and as row
    views (a TP shard of the rows)."""
    tl_, cuda = kernels
    g = torch.Generator().manual_seed(n + k + m)
    w = (
        torch.randn(n, k, generator=g)
        * torch.exp(3 * torch.randn(n // 32 + 1, 1, generator=g)).repeat_interleave(32, 0)[:n]
    )
    w[5, :40] = torch.randn(40, generator=g) * 1e-3  # small values beside large ones: e4m3 subnormals
    w[7] = 0
    q, s = fp8.quant_block(w, block)
    scale = fp8.e8m0_to_float(s)
    dense = fp8.dequant_block(q, scale, block)
    assert (q.view(torch.uint8) & 0x78 == 0).any()  # subnormal codes are exercised
    weight = cuda.CudaFp8Weight(q.view(torch.uint8).to(DEV), scale.float().to(DEV), block)
    x = torch.randn(m, k, generator=g)
    got = weight.linear(x.to(DEV)).cpu()
    want = _exact(x, dense)
    assert got.shape == (m, n) and ((got.double() - want).abs() / want.abs().max()).max() < 4e-5
    part = weight.rows(128, n).linear(x.to(DEV)).cpu() if n > 128 else None
    if part is not None:
        assert ((part.double() - want[:, 128:]).abs() / want.abs().max()).max() < 4e-5


def test_warm_up_runs_every_format_a_rank_uses(kernels):
    tl_, _ = kernels
    for block in (32, 128):  # the tiny fixtures' FP8 blocks and V4.1's
        tl_.warm_up(torch.device(DEV), ("bf16", "fp8", "bfp8_b", "bfp4_b"), block)


def test_kernel_refuses_what_it_cannot_read(kernels):
    tl_, _ = kernels
    tiles = torch.zeros(bfp.packed_size((32, 64), "bfp4_b"), dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="multiples of 32"):
        tl_.linear(torch.zeros(1, 64, device=DEV), tiles, "bfp4_b", (32, 48))
    with pytest.raises(ValueError, match="do not hold"):
        tl_.linear(torch.zeros(1, 64, device=DEV), tiles[:-1], "bfp4_b", (32, 64))
    with pytest.raises(ValueError, match="columns"):
        tl_.linear(torch.zeros(1, 96, device=DEV), tiles, "bfp4_b", (32, 64))
    fp8_bytes = torch.zeros(64, 256, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="fp32 scales \\[1, 2\\] of its 128-blocks"):
        tl_.linear(torch.zeros(1, 256, device=DEV), fp8_bytes, "fp8", scale=torch.ones(1, 1, device=DEV))


def _tiles(fmt: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.from_numpy(bfp.pack(torch.randn(rows, cols, generator=g), fmt))


@pytest.mark.parametrize(("fmt", "dtype"), [("bfp8_b", torch.int64), ("bfp4_b", torch.int32)])
def test_slot_form_reads_the_slot_the_tensor_holds_at_launch(kernels, fmt, dtype):
    """A matrix named by (pool, slot tensor, offset) is the plain kernel on that slot's bytes, bit for bit; writing
    another slot number into the same tensor, as a graph replay would, makes the next launch read that slot."""
    tl_, _ = kernels
    shapes = [(64, 64), (32, 96)]
    sizes = [bfp.packed_size(sh, fmt) for sh in shapes]
    offsets = [0, -(-sizes[0] // 256) * 256]
    pool = torch.zeros(3, offsets[1] + sizes[1] + 48, dtype=torch.uint8)  # a stride that is no power of two
    for slot in range(3):
        for i, (sh, off, nb) in enumerate(zip(shapes, offsets, sizes)):
            pool[slot, off : off + nb] = _tiles(fmt, *sh, seed=10 * slot + i)
    pool = pool.to(DEV)
    table = torch.tensor([0, 2, 1], dtype=dtype, device=DEV)
    slot = table[1:2]  # an entry of a table: its address is not the tensor's first element
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(3, sh[1], generator=g).to(DEV) for sh in shapes]
    seen = []
    for now in (2, 0):
        table[1] = now
        for sh, off, nb, x in zip(shapes, offsets, sizes, xs):
            got = tl_.linear(x, pool, fmt, sh, slot=slot, offset=off)
            assert torch.equal(got, tl_.linear(x, pool[now, off : off + nb], fmt, sh))
            seen.append(got)
    assert not torch.equal(seen[0], seen[2]) and not torch.equal(seen[1], seen[3])


def test_experts_by_table_is_the_sum_of_experts(kernels):
    """CudaDevice.experts_by_table reads its slots from a device table: the same sum, bit for bit, as experts() with
    the slots as Python ints, before and after the table is rewritten in place."""
    from dsflash.runtime.experts.device import PackedMatrix, ShardLayout

    _, cuda = kernels
    fmt, d, inter = "bfp8_b", 64, 32
    shapes = [(inter, d), (inter, d), (d, inter)]
    mats, off = [], 0
    for rows, cols in shapes:
        nb = bfp.packed_size((rows, cols), fmt)
        mats.append(PackedMatrix(off, nb, rows, cols))
        off += nb
    layout = ShardLayout(fmt, *mats, nbytes=off)
    dev = cuda.CudaDevice(DEV)
    slots = dev.allocate(3, layout.nbytes)
    for slot in range(3):
        for i, (m, sh) in enumerate(zip(mats, shapes)):
            slots[slot, m.offset : m.offset + m.nbytes] = _tiles(fmt, *sh, seed=10 * slot + i).to(DEV)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, d, generator=g).to(DEV)
    w = torch.rand(3, 2, generator=g).to(DEV)
    table = torch.tensor([2, 0], device=DEV)
    try:
        for ids in ([2, 0], [1, 2]):
            table.copy_(torch.tensor(ids))
            got = dev.experts_by_table(slots, table, layout, x, w, 1.5)
            assert got.dtype == torch.float32 and got.shape == x.shape
            assert torch.equal(got, dev.experts(slots, ids, layout, x, w, 1.5))
        with pytest.raises(ValueError, match="do not match a slot table"):
            dev.experts_by_table(slots, table[:1], layout, x, w, 1.5)
    finally:
        dev.close()


def test_slot_form_refuses_what_it_cannot_read(kernels):
    tl_, _ = kernels
    nbytes = bfp.packed_size((32, 64), "bfp4_b")
    pool = torch.zeros(2, nbytes + 32, dtype=torch.uint8, device=DEV)
    x, slot = torch.zeros(1, 64, device=DEV), torch.zeros(1, dtype=torch.int32, device=DEV)
    assert tl_.linear(x, pool, "bfp4_b", (32, 64), slot=slot, offset=32).shape == (1, 32)  # the last bytes fit
    with pytest.raises(ValueError, match="pass the end of a"):
        tl_.linear(x, pool, "bfp4_b", (32, 64), slot=slot, offset=48)
    with pytest.raises(ValueError, match="pass the end of a"):
        tl_.linear(x, pool, "bfp4_b", (32, 64), slot=slot, offset=-16)
    with pytest.raises(ValueError, match="int32 or int64"):
        tl_.linear(x, pool, "bfp4_b", (32, 64), slot=slot.float())
    with pytest.raises(ValueError, match="int32 or int64"):
        tl_.linear(x, pool, "bfp4_b", (32, 64), slot=torch.zeros(2, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="int32 or int64"):  # the pool's device, or the kernel reads a host address
        tl_.linear(x, pool, "bfp4_b", (32, 64), slot=torch.zeros(1, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="uint8 \\[n_slots, stride\\]"):
        tl_.linear(x, pool.view(-1), "bfp4_b", (32, 64), slot=slot)
    with pytest.raises(ValueError, match="names bfp tiles, not fp8"):
        tl_.linear(x, pool, "fp8", slot=slot, scale=torch.ones(1, 1, device=DEV))


def test_tiny_model_through_the_cuda_classes(kernels, tmp_path):
    """Dense weights as the checkpoint's FP8 blocks (CudaFp8Weight) and bf16 (CudaWeight), experts streamed through
    CudaDevice slots (2 slots: evictions), on tiny_a: the logits are the reference's to the bf16x2 rounding (bfp8_b
    holds the FP4 experts exactly)."""
    _, cuda = kernels
    files = open_dir(ROOT / "tiny_a" / "model")
    ckpt = files.ckpt
    tokens = torch.tensor([files.tokenizer.encode("def add(a, b):\n    return a + b  # 42")[:10]])
    ref = load_reference(ckpt, files.token_map, qat=False, dspark=False)
    want = ref.model(tokens, 0, ref.model.new_state(16), ref.experts)

    build_store(ckpt, str(tmp_path), tp=1, fmt="bfp8_b", progress=False)
    model = build_model(ckpt, files.token_map, qat=False, dspark=False)
    cuda.pack_dense(model, torch.device(DEV), ckpt)
    packed = [type(m.packed).__name__ for m in model.modules() if hasattr(m, "packed")]
    assert packed.count("CudaFp8Weight") > 20 and "CudaWeight" in packed  # the checkpoint's FP8 and bf16 matrices
    to_device(model, torch.device(DEV))
    store = open_store(ckpt, str(tmp_path), tp=1, fmt="bfp8_b")
    experts = CachedExperts(store, cuda.CudaDevice(DEV), 2, 0, ckpt.config.swiglu_limit)
    state = model.new_state(16, device=DEV)
    got = model(tokens[:, :8].to(DEV), 0, state, experts).cpu()
    got_next = model(tokens[:, 8:9].to(DEV), 8, state, experts).cpu()
    assert compare_logits(want[0, :8].numpy(), got[0].numpy())["max_abs"] < 2e-3
    assert compare_logits(want[0, 8:9].numpy(), got_next[0].numpy())["max_abs"] < 2e-3
    assert experts.pool.evictions > 0


def test_device_loads_split_and_double_buffer(kernels, tmp_path):
    """Misses go through two staging buffers: large ranges split over threads arrive whole, consecutive loads into
    different slots do not overwrite each other, and a range past the store's end fails loudly."""
    _, cuda = kernels
    torch.set_num_threads(2)
    data = np.random.default_rng(0).integers(0, 256, 6 << 20, dtype=np.uint8)
    path = tmp_path / "store.bin"
    data.tofile(path)
    dev = cuda.CudaDevice(DEV)
    slots = dev.allocate(3, 3 << 20)
    assert slots.shape[1] % cuda.SLOT_ALIGN == 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for slot in range(3):
            dev.load(slots, slot, fd, slot << 20, 3 << 20)
        dev.synchronize()
        for slot in range(3):
            assert np.array_equal(slots[slot, : 3 << 20].cpu().numpy(), data[slot << 20 : (slot + 3) << 20])
        with pytest.raises(OSError, match="ended early"):
            dev.load(slots, 0, fd, 4 << 20, 3 << 20)
    finally:
        os.close(fd)
        dev.close()


def test_sinkhorn_kernel_is_the_models(kernels):
    from dsflash.model.mhc import sinkhorn
    from dsflash.runtime.cuda import triton_mhc

    g = torch.Generator().manual_seed(5)
    c = torch.randn(2, 9, 4, 4, generator=g) * 4
    torch.testing.assert_close(
        triton_mhc.sinkhorn(c.to(DEV), 20, 1e-6).cpu(), sinkhorn(c, 20, 1e-6), rtol=2e-6, atol=1e-7
    )
    assert triton_mhc.sinkhorn(torch.zeros(1, 3, 3, device=DEV), 20, 1e-6) is None  # not a power of two: torch's
