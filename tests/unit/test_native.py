"""The engine's native CPU kernels against plain torch, for the native build (AVX-512 or AVX2 on this CPU), the AVX2
build forced (covered on a CPU with AVX-512 too), the portable build and no build."""

from pathlib import Path

import numpy as np
import pytest
import torch

from dsflash.formats import bfp, fp8
from dsflash.model.block import Head
from dsflash.model.parallel import TP
from dsflash.runtime.cpu import native
from dsflash.runtime.cpu.dense import HEAD_EXACT, Bf16Weight, Fp8Weight, ScreenedHead, decode_bytes

CPUINFO = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
AVX512 = "avx512f" in CPUINFO
HAS_AVX2 = all(f in CPUINFO.split() for f in ("avx2", "fma", "f16c"))


@pytest.fixture(autouse=True, scope="module")
def two_threads():
    """The kernels' OpenMP loops split rows over torch's threads: check them split (`make test` runs one thread a
    worker)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["native", "avx2", "generic", "none"])
def kernels(request, monkeypatch):
    if request.param == "native":
        lib = native.lib()
    elif request.param == "avx2":
        if not HAS_AVX2:
            pytest.skip("this CPU has no AVX2")
        lib = native.build(native.AVX2_FLAGS)
    elif request.param == "generic":
        lib = native.build(native.GENERIC_FLAGS)
    else:
        lib = False  # no compiler: torch fallbacks
    if lib is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(native, "_lib", lib)
    return request.param


@pytest.mark.parametrize("fmt", ["bfp4_b", "bfp8_b"])
def test_bfp_gemv_and_expansion(kernels, fmt):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((96, 160)) * 0.05).astype(np.float32)
    w[3, :16] = 0  # an all-zero face row (exponent 0)
    tiles = bfp.pack(w, fmt)
    want = torch.from_numpy(bfp.unpack(tiles, fmt, w.shape))
    for n in (1, 3, 6):
        x = torch.randn(n, 160)
        torch.testing.assert_close(native.gemv(tiles, (96, 160), fmt, x), x @ want.T, atol=1e-5, rtol=1e-5)
    assert torch.equal(native.dequant_f32(tiles, (96, 160), fmt), want)
    assert torch.equal(native.dequant_bf16(tiles, (96, 160), fmt).float(), want)
    # a batched decode step's rows (groups of 4, 3, 2 and 1) each have the bits of that vector alone, every build
    x = torch.randn(9, 160)
    for n in (2, 3, 4, 5, 7, 9):
        got = native.gemv(tiles, (96, 160), fmt, x[:n])
        alone = torch.cat([native.gemv(tiles, (96, 160), fmt, x[i : i + 1]) for i in range(n)])
        if kernels == "none":  # torch's products: fp32 noise
            torch.testing.assert_close(got, alone, atol=1e-6, rtol=1e-5)
        else:
            assert torch.equal(got, alone), n


def test_fp8_and_bf16_dense(kernels):
    w = torch.randn(72, 192) * 0.03
    q, s = fp8.quant_block(w, 32)
    exact = fp8.dequant_block(q, s, 32)
    W = Fp8Weight.exact(exact, 32)
    B = Bf16Weight(exact)
    for n in (1, 2, 3, 20):  # GEMV for few rows, expansion + BLAS for many
        x = torch.randn(n, 192)
        torch.testing.assert_close(W.linear(x), x @ exact.T, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(B.linear(x), x @ exact.T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(W.rows(32, 64).linear(torch.ones(1, 192)), exact[32:64].sum(1)[None], atol=1e-5,
                               rtol=1e-5)  # fmt: skip
    assert Fp8Weight.exact(w, 32) is None  # not FP8 values: refused rather than rounded silently
    # row ranges (TP shards, a grouped projection's groups, taken every step) are views, never copies
    assert W.rows(32, 64).q.untyped_storage().data_ptr() == W.q.untyped_storage().data_ptr()
    assert B.rows(32, 64).w.untyped_storage().data_ptr() == B.w.untyped_storage().data_ptr()


def test_fp8_gemv_decodes_every_e4m3_byte_exactly(kernels):
    """Each of the 254 finite E4M3 codes (signs, subnormals, zeros) read back through the GEMV with one-hot x."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0  # the two NaN codes
    w = codes.view(8, 32)
    want = w.view(torch.float8_e4m3fn).float()
    scale256 = torch.full((1, 1), 256.0)  # one 32 x 32 block at scale 1, times the kernels' 2^8
    if kernels == "none":  # no kernels: dense.Fp8Weight multiplies the torch expansion instead
        assert native.fp8_gemv(w, scale256, 32, torch.ones(1, 32)) is None
        return
    got = torch.stack([native.fp8_gemv(w, scale256, 32, torch.eye(32)[j : j + 1])[0] for j in range(32)], dim=1)
    assert torch.equal(got, want)


def test_decode_gemv_rows_do_not_depend_on_their_neighbours(kernels):
    """A tensor-parallel shard computes its rows exactly as the whole matrix does: the decode kernels take rows in
    groups, and a row in a group and the same row alone (a tail, or another shard) must give the same bits."""
    w = torch.randn(70, 256) * 0.03  # 70 rows: groups of 4 and a tail of 2; 32-row scale blocks
    q, s = fp8.quant_block(w, 32)
    exact = fp8.dequant_block(q, s, 32)
    x = torch.randn(1, 256)
    whole = Fp8Weight.exact(exact, 32), Bf16Weight(exact)
    # rows 66..69 on their own are one group; in the whole matrix they straddle a group and the tail
    parts = Fp8Weight(q[66:70].view(torch.uint8), s[2:3].float(), 32), Bf16Weight(exact[66:70])
    for W, part in zip(whole, parts, strict=True):
        y = W.linear(x)
        torch.testing.assert_close(y, x @ exact.T, atol=1e-5, rtol=1e-5)
        if kernels == "none":  # the torch fallback's BLAS promises no such thing: fp32 noise only
            torch.testing.assert_close(part.linear(x), y[:, 66:70], atol=1e-6, rtol=1e-6)
        else:
            assert torch.equal(part.linear(x), y[:, 66:70])
    tiles = bfp.pack(exact[:64].numpy(), "bfp4_b")
    half = bfp.pack(exact[32:64].numpy(), "bfp4_b")
    assert torch.equal(native.gemv(tiles, (64, 256), "bfp4_b", x)[:, 32:], native.gemv(half, (32, 256), "bfp4_b", x))


def test_a_batched_fp8_gemv_row_is_that_vector_alone(kernels):
    """A batched decode step's dense products (2-11 vectors: one and two passes of the vector builds' 8; 2-4 of
    them take rows two or four at a time on AVX-512) give each vector the bits of its one-vector call there (AVX2
    and AVX-512), so a batch changes no stream's dense math; the portable build differs by fp32 noise."""
    w = torch.randn(102, 256) * 0.03  # 32-row scale blocks and a ragged last one of 6 rows, split over 2 threads
    q, s = fp8.quant_block(w, 32)
    W = Fp8Weight(q.view(torch.uint8), s.float() * 1.37, 32)  # scales off powers of two: x * s rounds
    if kernels == "none":
        return  # no GEMV: the torch fallback multiplies the expansion (test_fp8_and_bf16_dense)
    bitwise = kernels == "avx2" or (kernels == "native" and (HAS_AVX2 or AVX512))
    for n in (2, 3, 4, 8, 11):
        x = torch.randn(n, 256)
        got = native.fp8_gemv(W.q, W.scale256, 32, x)
        alone = torch.cat([native.fp8_gemv(W.q, W.scale256, 32, x[i : i + 1]) for i in range(n)])
        if bitwise:
            assert torch.equal(got, alone), n
        else:
            torch.testing.assert_close(got, alone, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["bfp4_b", "bfp8_b"])
def test_decode_experts_in_one_call_are_their_sum(kernels, fmt):
    """A decode token's routed experts in one native call (CpuDevice.experts) equal the experts one by one
    (expert_sum) bit for bit (fp32 rounding without kernels), with the swiglu clamps active, the experts in
    scattered slots, and a layer large enough to run on several threads (the second case); prefill rows go one
    expert at a time."""
    from dsflash.runtime.experts.device import CpuDevice, PackedMatrix, ShardLayout, expert_sum

    rng = np.random.default_rng(1)
    for d, inter, n in ((64, 32, 2), (256, 96, 6)):
        shapes = ((inter, d), (inter, d), (d, inter))
        packed = [
            [bfp.pack((rng.standard_normal(sh) * 0.2).astype(np.float32), fmt) for sh in shapes] for _ in range(n)
        ]
        sizes = [p.nbytes for p in packed[0]]
        o1, o3, o2, end = np.cumsum([0, *sizes]).tolist()
        layout = ShardLayout(fmt, PackedMatrix(o1, sizes[0], inter, d), PackedMatrix(o3, sizes[1], inter, d),
                             PackedMatrix(o2, sizes[2], d, inter), end)  # fmt: skip
        dev = CpuDevice()
        slots = dev.allocate(n + 3, end)
        ids = rng.permutation(n + 3)[:n].tolist()
        for e, slot in enumerate(ids):
            slots[slot, :end] = np.concatenate(packed[e])
        x, w = torch.randn(1, d) * 3, torch.rand(1, n)
        want = expert_sum(dev, slots, ids, layout, x, w, 1.0)
        got = dev.experts(slots, ids, layout, x, w, 1.0)
        if kernels == "none":
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # one expert's product (a batched step's) has the bits of that expert inside the one call
            assert torch.equal(got, want)
        assert (native.moe_decode(slots, ids, layout, x, w, 1.0) is None) == (kernels == "none")
        assert not torch.equal(want, expert_sum(dev, slots, ids, layout, x, w, 0.0))  # the clamps were active
        xs, ws = torch.randn(3, d), torch.rand(3, n)  # several tokens: expert by expert
        assert torch.equal(
            dev.experts(slots, ids, layout, xs, ws, 1.0), expert_sum(dev, slots, ids, layout, xs, ws, 1.0)
        )
        dev.close()


@pytest.mark.parametrize("fmt", ["bfp4_b", "bfp8_b"])
def test_a_batched_steps_experts_give_each_token_its_own_calls_bits(kernels, fmt):
    """Several decode tokens, each through its own routed experts (CpuDevice.routed: one native call, each expert
    read once for all its tokens), equal each token alone in its one-token call with its experts in route order,
    bit for bit: tokens sharing an expert one to sixteen at a time (the several-vector loops), tokens alone on an
    expert (the paired rows), on several threads. Outside a decode step more tokens than the GEMVs take are
    refused (prefill goes expert by expert, as matrices)."""
    from dsflash.runtime.cpu import rows
    from dsflash.runtime.experts.device import CpuDevice, PackedMatrix, ShardLayout

    rng = np.random.default_rng(2)
    for d, inter, n, k, t in ((64, 32, 4, 2, 3), (256, 96, 9, 6, 8), (256, 96, 20, 3, 16)):
        shapes = ((inter, d), (inter, d), (d, inter))
        packed = [
            [bfp.pack((rng.standard_normal(sh) * 0.2).astype(np.float32), fmt) for sh in shapes] for _ in range(n)
        ]
        sizes = [p.nbytes for p in packed[0]]
        o1, o3, o2, end = np.cumsum([0, *sizes]).tolist()
        layout = ShardLayout(fmt, PackedMatrix(o1, sizes[0], inter, d), PackedMatrix(o3, sizes[1], inter, d),
                             PackedMatrix(o2, sizes[2], d, inter), end)  # fmt: skip
        dev = CpuDevice()
        slots = dev.allocate(n + 2, end)
        ids = rng.permutation(n + 2)[:n].tolist()
        for e, slot in enumerate(ids):
            slots[slot, :end] = np.concatenate(packed[e])
        x, w = torch.randn(t, d) * 3, torch.rand(t, k)
        route = torch.tensor(np.stack([rng.permutation(n)[:k] for _ in range(t)]), dtype=torch.int32)
        route[-1] = route[0]  # two tokens with the same experts
        with rows.decoding():
            got = dev.routed(slots, ids, layout, x, route, w, 1.0)
        if kernels == "none":
            assert got is None
            continue
        for i in range(t):
            alone = dev.experts(slots, [ids[j] for j in route[i].tolist()], layout, x[i : i + 1], w[i : i + 1], 1.0)
            assert torch.equal(got[i : i + 1], alone), (d, i)
        assert dev.routed(slots, ids, layout, torch.randn(17, d), route[:1].repeat(17, 1), w[:1].repeat(17, 1),
                          1.0) is None  # fmt: skip
        dev.close()


def test_a_few_queries_attention_and_index_scores_are_each_query_alone(kernels):
    """Sparse attention and the indexer's scores for a few queries (native.sparse_attention / index_scores: a decode
    step's, a verify's positions) give each query the bits it gets alone, whatever rows or keys lie beside its
    selection and wherever its selection sits (leading or trailing unselected entries), with 1 to 64 heads; both
    are the model's math to fp32 rounding; so are a prefill's many queries, chunked."""
    from dsflash.model.attention import sparse_attention

    gen = torch.Generator().manual_seed(5)
    for h, n, d in ((1, 30, 64), (2, 30, 64), (4, 200, 512), (64, 40, 128)):
        q, kv, sink = torch.randn(1, 4, h, d, generator=gen), torch.randn(1, n + 3, d, generator=gen), torch.randn(h)
        idx = torch.arange(n).view(1, 1, n).repeat(1, 4, 1)
        for j in range(4):
            idx[0, j, n - 2 + j :] = -1  # later queries see more rows
        idx[0, 0, :5] = -1
        got = native.sparse_attention(q, kv, sink, idx, 0.125)
        if kernels == "none":
            assert got is None
            continue
        torch.testing.assert_close(got, sparse_attention(q, kv, sink, idx, 0.125), atol=1e-5, rtol=1e-5)
        moved = torch.cat([torch.randn(1, 7, d, generator=gen), kv], dim=1)  # the rows elsewhere, more unselected
        idx2 = torch.cat([torch.full((1, 4, 3), -1), torch.where(idx >= 0, idx + 7, -1)], dim=-1)
        assert torch.equal(native.sparse_attention(q, moved, sink, idx2, 0.125), got)
        for j in range(4):
            alone = native.sparse_attention(q[:, j : j + 1], kv[:, : n + j], sink, idx[:, j : j + 1], 0.125)
            assert torch.equal(alone, got[:, j : j + 1]), (h, j)
        keys, w = torch.randn(1, 50, 32, generator=gen), torch.randn(1, 4, h, generator=gen)
        qq = torch.randn(1, 4, h, 32, generator=gen)
        scores = native.index_scores(qq, keys, w)
        want = (torch.einsum("bshd,btd->bsht", qq, keys).relu() * w.unsqueeze(-1)).sum(2)
        torch.testing.assert_close(scores, want, atol=1e-5, rtol=1e-5)
        for j in range(4):  # a query alone over the keys visible to it
            alone = native.index_scores(qq[:, j : j + 1], keys[:, : 20 + j], w[:, j : j + 1])
            assert torch.equal(alone[:, 0], scores[:, j, : 20 + j])
    if kernels != "none":  # more queries than one call takes (a prefill's): each still its own bits
        many = torch.randn(1, native.ATTN_CHUNK + 5, 2, 64, generator=gen)
        kv, sink = torch.randn(1, 40, 64, generator=gen), torch.randn(2)
        wide = torch.randint(-1, 40, (1, many.shape[1], 24), generator=gen)
        got = native.sparse_attention(many, kv, sink, wide, 0.125)
        torch.testing.assert_close(got, sparse_attention(many, kv, sink, wide, 0.125), atol=1e-5, rtol=1e-5)
        for j in (0, native.ATTN_CHUNK - 1, native.ATTN_CHUNK, many.shape[1] - 1):
            assert torch.equal(native.sparse_attention(many[:, j : j + 1], kv, sink, wide[:, j : j + 1], 0.125),
                               got[:, j : j + 1])  # fmt: skip


def test_grouped_fp8_decode_is_each_group_alone(kernels):
    """The block-diagonal decode (wo_a's groups in one call) gives each group the bits of its own GEMV, for groups
    whose rows straddle the kernel's 8-row units and the scale blocks; more rows fall back to group by group."""
    for groups, per in ((4, 40), (2, 64), (3, 8)):
        w = torch.randn(groups * per, 128) * 0.03
        q, s = fp8.quant_block(w, 32)
        W = Fp8Weight.exact(fp8.dequant_block(q, s, 32), 32)
        x = torch.randn(1, 1, groups, 128)
        got = W.grouped(x, groups)
        if kernels == "none":
            assert got is None
            continue
        assert got.shape == (1, 1, groups, per)
        for g in range(groups):
            assert torch.equal(got[0, 0, g], W.linear(x[0, 0, g][None])[0, g * per : (g + 1) * per])
        assert W.grouped(torch.randn(2, 1, groups, 128), groups) is None


def test_screened_head_rescores_its_top_rows_from_bf16(kernels):
    """Decode logits: the HEAD_EXACT highest carry the bf16 head's bits, the rest the FP8 screen's (the bf16
    weight rounded to FP8 blocks); many rows, and no kernels, the bf16 head's everywhere."""
    vocab, d = 300, 256
    w = torch.randn(vocab, d) * 0.05
    head, exact = ScreenedHead(w, 32), Bf16Weight(w)
    x = torch.randn(1, d)
    got, want = head.logits(x, TP.single(), vocab), exact.linear(x)
    assert got.shape == (1, vocab)
    many = torch.randn(20, d)
    assert torch.equal(head.logits(many, TP.single(), vocab), exact.linear(many))
    if kernels == "none":
        assert torch.equal(got, want)
        return
    screen = Fp8Weight.quantized(exact.w, 32).linear(x)
    top = screen.topk(HEAD_EXACT).indices[0]
    tail = torch.ones(vocab, dtype=torch.bool)
    tail[top] = False
    assert torch.equal(got[0, top], want[0, top])
    assert torch.equal(got[0, tail], screen[0, tail])
    assert not torch.equal(got, want)  # the tail really is the screen's
    assert int(got.argmax()) == int(want.argmax())
    torch.testing.assert_close(got, want, atol=0.1 * float(want.abs().max()), rtol=0)
    # a screen of FP8 blocks holds every FP8 value exactly
    q, s = fp8.quant_block(w, 32)
    on_grid = fp8.dequant_block(q, s, 32)
    assert torch.equal(Fp8Weight.quantized(on_grid, 32).q, Fp8Weight.exact(on_grid, 32).q)
    # what a decode step reads (the benchmark's bytes per token): the screen and the re-scored rows
    module = Head(vocab, d, TP.single())
    module.packed = head
    assert decode_bytes(module) == vocab * d + head.screen.scale.numel() * 4 + HEAD_EXACT * d * 2


def test_bf16_rows_by_index_are_the_gemv_bits(kernels):
    """The head's re-scored rows, read in place by index (repeats and any order), carry bf16_gemv's bits; enough
    rows to run on several threads."""
    w = (torch.randn(700, 512) * 0.05).bfloat16()
    x = torch.randn(1, 512)
    rows = torch.tensor([699, 0, 5, 5, *range(100, 700, 2)])
    got = native.bf16_gemv_rows(w, rows, x)
    if kernels == "none":
        assert got is None
        return
    assert torch.equal(got, native.bf16_gemv(w, x)[0, rows])


@pytest.mark.skipif(not native.amx_ready(), reason="no AMX-BF16 on this CPU")
@pytest.mark.parametrize("m,n,k", [(9, 64, 64), (40, 64, 64), (70, 96, 160), (33, 70, 200)])
def test_amx_products_are_fp32_grade_and_row_independent(m, n, k):
    """bf16x2 prefill products: within a few fp32 ulps of float64 for every weight source, and a shard's rows (a
    TP rank's) come out bit for bit as in the whole matrix, whatever the token count."""
    w, x = torch.randn(n, k) * 0.05, torch.randn(m, k)
    q, s = fp8.quant_block(w, 32)
    exact = fp8.dequant_block(q, s, 32)
    w8, s = q.view(torch.uint8).contiguous(), s.float()
    sources = {
        "fp8": (exact, lambda a, b: native.fp8_dequant(w8[a:b], s[a // 32 :] * 256, 32, torch.bfloat16)),
        "bf16": (exact, lambda a, b: exact[a:b].bfloat16()),
    }
    if n % 32 == 0 and k % 32 == 0:
        for fmt in ("bfp4_b", "bfp8_b"):
            tiles = {(a, b): bfp.pack(w[a:b].numpy(), fmt) for a, b in ((0, n), (32, n))}
            dense = torch.from_numpy(bfp.unpack(tiles[0, n], fmt, (n, k)))
            sources[fmt] = (dense, lambda a, b, t=tiles, f=fmt: native.dequant_bf16(t[a, b], (b - a, k), f))
    for name, (dense, expand) in sources.items():
        y = native.amx_linear(x, expand(0, n).clone())
        want = x.double() @ dense.double().T
        assert (y - want).abs().max() < 1e-5 * (1 + want.abs().max()), name
        assert torch.equal(native.amx_linear(x, expand(32, n).clone()), y[:, 32:]), name
        assert torch.equal(native.amx_linear(x[:5], expand(0, n).clone()), y[:5]), name


@pytest.mark.skipif(not native.amx_ready(), reason="no AMX-BF16 on this CPU")
@pytest.mark.parametrize("m,n,k", [(9, 64, 64), (40, 96, 256), (70, 70, 160), (33, 256, 96)])
def test_amx_on_packed_weights_is_amx_on_their_expansion(m, n, k):
    """Panels expanded where they are multiplied give the bits of the whole expansion multiplied: FP8 (ragged rows,
    several scale blocks), bfp4_b and bfp8_b tiles."""
    w, x = torch.randn(n, k) * 0.05, torch.randn(m, k)
    q, s = fp8.quant_block(w, 32)
    w8, s256 = q.view(torch.uint8).contiguous(), (s.float() * 256).contiguous()
    want = native.amx_linear(x, native.fp8_dequant(w8, s256, 32, torch.bfloat16).clone())
    assert torch.equal(native.amx_packed(x, w8, "fp8", (n, k), s256, 32), want)
    if n % 32 == 0:
        for fmt in ("bfp4_b", "bfp8_b"):
            tiles = bfp.pack(w.numpy(), fmt)
            want = native.amx_linear(x, native.dequant_bf16(tiles, (n, k), fmt).clone())
            assert torch.equal(native.amx_packed(x, tiles, fmt, (n, k)), want), fmt
    assert native.amx_packed(x[:, :40], w8[:, :40].contiguous(), "fp8", (n, 40), s256, 32) is None  # K % 32: expand


@pytest.mark.parametrize("m, k", [(1, 32), (5, 64), (17, 40), (33, 5120), (3, 7)])
def test_vector_split_of_x_is_the_portable_loops(m, k):
    """AMX's activations (x as two bf16 terms in tile layout) from the AVX-512 blocks equal the portable loops bit for
    bit: rounding, infinities and NaNs, denormals, rows and columns past the end."""
    fast, portable = native.lib(), native.build(native.GENERIC_FLAGS)
    if fast is None or portable is None:
        pytest.skip("no C compiler")
    if "avx512f" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("the native build is the portable one on this CPU")
    torch.manual_seed(m * k)
    x = torch.randn(m, k) * torch.exp(torch.randn(m, k) * 20)
    flat = x.view(-1)
    flat[::7], flat[::11], flat[::13], flat[::17] = float("inf"), float("nan"), 1e-40, -0.0
    mp, kp = -(-m // 32) * 32, -(-k // 32) * 32

    def split(lib):
        out = torch.full((2 * mp, kp), 12345, dtype=torch.int16)  # every element must be written
        lib.split_vnni(x.data_ptr(), m, k, out.data_ptr(), mp, kp)
        return out

    assert torch.equal(split(fast), split(portable))


def test_fused_sinkhorn_is_the_models(kernels):
    """One C call for mHC's Sinkhorn: the torch version's result to float32 rounding, decode-sized and prefill-sized,
    including rows whose logits differ by hundreds (the softmax's max subtraction matters there)."""
    from dsflash.model.mhc import sinkhorn

    if kernels == "none":  # no compiler: the runtime keeps the torch version
        assert native.sinkhorn(torch.zeros(1, 4, 4), 20, 1e-6) is None
        return
    g = torch.Generator().manual_seed(3)
    for shape in ((1, 1, 4, 4), (2, 37, 4, 4)):
        c = torch.randn(*shape, generator=g) * 4
        c[0, 0, 1] *= 100
        want = sinkhorn(c, 20, 1e-6)
        got = native.sinkhorn(c, 20, 1e-6)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
        assert not torch.equal(got, c)  # a fresh result; the input is left as it was
    assert native.sinkhorn(torch.zeros(0, 4, 4), 20, 1e-6).shape == (0, 4, 4)


def test_fused_mixes_are_the_models(kernels):
    """mHC's mixing weights (RMS statistic, projections, gates, Sinkhorn) as one C call: the torch version's results
    to float32 rounding for a decode token and a prefill chunk, at the embedded model's width and V4.1's."""
    from dsflash.model.mhc import mixes

    if kernels == "none":
        assert native.mhc_mixes(torch.zeros(1, 1, 4, 64), *([torch.zeros(1)] * 3), 20, 1e-6, 1e-6) is None
        return
    g = torch.Generator().manual_seed(5)
    for t, hc, d in ((1, 4, 64), (37, 4, 64), (1, 4, 5120), (3, 2, 96)):
        x = torch.randn(1, t, hc, d, generator=g) * 3
        fn = torch.randn((2 + hc) * hc, hc * d, generator=g) / d**0.5
        scale, base = torch.randn(3, generator=g), torch.randn((2 + hc) * hc, generator=g)
        want = mixes(x, fn, scale, base, 20, 1e-6, 1e-6)
        got = native.mhc_mixes(x, fn, scale, base, 20, 1e-6, 1e-6)
        for w, o in zip(want, got, strict=True):
            assert o.shape == w.shape
            torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-6)


def test_fused_collapse_norm_and_expand_are_the_models(kernels):
    """A block's collapse + RMSNorm and its expansion, one C call each: the norm to float32 rounding (its mean sums in
    another order), the expansion bit for bit (the same sums in the same order), for decode tokens and a prefill
    chunk, at V4.1's width and a narrow one, the weights as strided views; other dtypes are left to torch."""
    from dsflash.model import mhc
    from dsflash.model.layers import RMSNorm

    g = torch.Generator().manual_seed(6)
    for t, hc, d in ((1, 4, 5120), (37, 4, 64), (3, 2, 96)):
        x = torch.randn(1, t, hc, d, generator=g) * 3
        # views into one [.., (2 + hc) hc] tensor, as mhc.mixes hands them over: not contiguous
        m = torch.rand(1, t, (2 + hc) * hc, generator=g)
        w, post, comb = m[..., :hc], m[..., hc : 2 * hc] * 2, m[..., 2 * hc :].unflatten(-1, (hc, hc))
        f = torch.randn(1, t, d, generator=g)
        norm = RMSNorm(d, 1e-20)
        norm.weight.data = torch.randn(d, generator=g)
        got = native.hc_collapse_norm(x, w, norm.weight, norm.eps), native.hc_expand(f, x, post, comb)
        if kernels == "none":
            assert got == (None, None)
            return
        torch.testing.assert_close(got[0], norm(mhc.collapse(x, w)), rtol=1e-5, atol=1e-6)
        assert torch.equal(got[1], mhc.expand(f, x, post, comb))
    bf = x.bfloat16()
    assert native.hc_collapse_norm(bf, w, norm.weight, 1e-20) is None and native.hc_expand(f, bf, post, comb) is None


def test_shared_expert_in_one_call_is_its_three_products(kernels):
    """The shared expert's decode row (W2 swiglu(W1 x, W3 x), FP8 weights) as one call: each product the GEMV's,
    the activation torch's to float32 rounding, with the clamps active, for widths whose rows straddle the kernel's
    8-row units; shapes off the scale blocks are declined (the caller multiplies matrix by matrix)."""
    from dsflash.model.experts import swiglu

    g = torch.Generator().manual_seed(7)
    for f_, d in ((96, 64), (2304, 5120), (40 * 32, 160)):
        w1, w3, w2 = (Fp8Weight.quantized(torch.randn(*s, generator=g) * 0.3, 32) for s in ((f_, d), (f_, d), (d, f_)))
        x = torch.randn(1, d, generator=g)
        args = (w1.q, w1.scale256, w3.q, w3.scale256, w2.q, w2.scale256, 32)
        got = native.fp8_ffn_decode(*args, x, 1.0)
        vector = kernels == "avx2" or (kernels == "native" and (AVX512 or HAS_AVX2))
        if not vector:  # the portable loops have no vector loops to share; none: nothing
            assert got is None
            return
        want = w2.linear(swiglu(w1.linear(x), w3.linear(x), 1.0))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert not torch.equal(want, w2.linear(swiglu(w1.linear(x), w3.linear(x), 0.0)))  # the clamps were active
        # a batched decode step's rows (runtime/cpu/fused.py): the products row by row and the call's activation
        # give each row the bits of the one-row call
        xb = torch.randn(3, d, generator=g)
        h = native.swiglu(w1.linear(xb), w3.linear(xb), torch.ones(3, 1), 1.0)
        rows = w2.linear(h)
        for i in range(3):
            assert torch.equal(rows[i : i + 1], native.fp8_ffn_decode(*args, xb[i : i + 1], 1.0)), (d, i)
    odd = Fp8Weight.quantized(torch.randn(48, 64), 32)  # 48 rows: not whole 32-row scale blocks
    assert (
        native.fp8_ffn_decode(odd.q, odd.scale256, odd.q, odd.scale256, odd.q, odd.scale256, 32, x[:, :64], 1.0) is None
    )


def test_top_indices_are_topks_set(kernels):
    """The screened head's candidates: each row's k largest as torch.topk finds them, in any order; among equal
    values at the boundary the earlier indices; k beyond the row takes all of it."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 129280, generator=g)
    x[0, 5:70] = 7.0  # 65 equal values for 64 places
    x[2, -1] = 50.0  # the last value, past the 16-wide loop's end
    got = native.top_indices(x, 64)
    if kernels == "none":
        assert got is None
        return
    assert got.shape == (3, 64)
    for r in range(3):
        assert set(got[r].tolist()) == set(torch.topk(x[r], 64).indices.tolist())
    assert sorted(got[0].tolist()) == list(range(5, 69))
    assert sorted(native.top_indices(torch.tensor([[1.0, 3.0, 2.0]]), 5)[0].tolist()) == [0, 1, 2]


def test_fused_norm_and_router_are_the_models(kernels):
    """RMSNorm and the MoE router as one C call each: the norm to float32 rounding; the router picks the same
    experts in the same order (descending score + bias, the bias never scaling them) with weights to float32
    rounding, for every scoring function, normalised or not; what they do not handle is left to torch."""
    from dsflash.model.layers import RMSNorm
    from dsflash.model.moe import Gate

    g = torch.Generator().manual_seed(9)
    norm = RMSNorm(96, 1e-20)
    norm.weight.data = torch.randn(96, generator=g)
    x = torch.randn(7, 96, generator=g) * 4
    gate = Gate.__new__(Gate)
    torch.nn.Module.__init__(gate)
    gate.weight = torch.nn.Parameter(torch.randn(64, 96, generator=g) * 0.1, requires_grad=False)
    gate.bias = torch.nn.Parameter(torch.randn(64, generator=g) * 0.05, requires_grad=False)
    gate.temp, gate.route_scale, gate.fused = 1.3, 1.5, None
    if kernels == "none":
        assert native.rms_norm(x, norm.weight, norm.eps) is None
        assert native.moe_route(x, gate.weight, gate.bias, 1.0, "softmax", 6, True, 1.0) is None
        return
    torch.testing.assert_close(native.rms_norm(x, norm.weight, norm.eps), norm(x), rtol=1e-5, atol=1e-6)
    for func, k, normed in (("sqrtsoftplus", 6, True), ("softmax", 8, False), ("sigmoid", 1, True)):
        gate.score_func, gate.topk, gate.norm_topk = func, k, normed
        want_w, want_ids = gate(x)
        got_w, got_ids = native.moe_route(x, gate.weight, gate.bias, gate.temp, func, k, normed, gate.route_scale)
        assert torch.equal(got_ids, want_ids), func
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-7)
    assert native.moe_route(x, gate.weight, gate.bias, 1.0, "relu", 6, True, 1.0) is None
    assert native.rms_norm(x.bfloat16(), norm.weight, norm.eps) is None


def test_fused_rope_is_the_models(kernels):
    """The rotary embedding as one C call: the untouched channels copied exactly, the rotated ones equal to float32
    rounding, forwards and inverse, with heads and without, several positions and batch rows; a position count
    that does not match x's is left to torch."""
    from dsflash.model.layers import Rope

    rope = Rope(64, 160000.0, 65536, 16.0, 32.0, 1.0)
    g = torch.Generator().manual_seed(10)
    for shape in ((1, 1, 8, 512), (2, 5, 512), (1, 7, 3, 128)):
        x = torch.randn(*shape, generator=g) * 2
        cis = rope.cis(torch.arange(100, 100 + shape[1]))
        for inverse in (False, True):
            got = native.rope_rotate(x, cis, 64, inverse)
            if kernels == "none":
                assert got is None
                continue
            want = rope.rotate(x, cis, inverse)
            assert torch.equal(got[..., :-64], want[..., :-64])
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert native.rope_rotate(x, rope.cis(torch.arange(2)), 64, False) is None


def test_fused_engram_write_is_the_models(kernels):
    """Engram's gated write after its wkv product as one C call equals Engram.forward's torch math to float32
    rounding, for a decode token and a chunk, gates on both sides of 0.5 (signed square roots)."""
    from dsflash.model.engram import Engram

    g = torch.Generator().manual_seed(11)
    for t, hc, d in ((1, 4, 512), (9, 2, 96)):
        x = torch.randn(1, t, hc, d, generator=g)
        kv = torch.randn(1, t, (hc + 1) * d, generator=g)
        e = Engram.__new__(Engram)
        torch.nn.Module.__init__(e)
        e.dim, e.hc, e.eps, e.fused = d, hc, 1e-20, None
        e.embed, e.wkv = (lambda ids: ids), (lambda rows, kv=kv: kv)  # the looked-up rows' product, given
        e.q_weight, e.k_weight = torch.randn(hc, d, generator=g), torch.randn(hc, d, generator=g)
        want = e(x, torch.zeros(1, t, 1, 1))
        e.fused = native.engram_gate
        got = e(x, torch.zeros(1, t, 1, 1))
        if kernels == "none":
            assert native.engram_gate(x, kv, e.q_weight, e.k_weight, 1e-20) is None
            return
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        gate = (got - x)[..., 0] / kv[..., hc * d : hc * d + 1]
        assert (gate < 0.5).any() and (gate > 0.5).any()
