"""BFLOAT4_B / BFLOAT8_B tiles: golden bytes from tt-metal's packer, the worked example of bfp_format.md §8,
the checkpoint FP4 fast path, the CLI and the shipped self-check."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dsflash.cli.main import main
from dsflash.errors import DsflashError, StoreCorrupt
from dsflash.formats import bfp, fp4, tiles

DATA = Path(__file__).resolve().parents[1] / "data" / "bfp"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
CASES = [(c["name"], fmt) for c in MANIFEST["cases"] for fmt in ("bfp4_b", "bfp8_b")]
FORMATS = ("bfp4_b", "bfp8_b")


def _case(name):
    return next(c for c in MANIFEST["cases"] if c["name"] == name)


def _golden(name, fmt):
    """-> (input fp32 [H, W], packed bytes, ttnn's decode fp32 [H, W])"""
    c = _case(name)
    out = c["outputs"][fmt]
    return np.load(DATA / c["input"]), (DATA / out["packed"]).read_bytes(), np.load(DATA / out["unpacked"])


def _assert_same_floats(got, want):
    """Bit-identical, except that any NaN matches any NaN."""
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


# ---------------------------------------------------------------- golden vectors


def test_golden_files_are_intact():
    for c in MANIFEST["cases"]:
        assert hashlib.sha256((DATA / c["input"]).read_bytes()).hexdigest() == c["input_sha256"]
        for out in c["outputs"].values():
            assert hashlib.sha256((DATA / out["packed"]).read_bytes()).hexdigest() == out["packed_sha256"]


@pytest.mark.parametrize("name,fmt", CASES)
def test_golden_pack(name, fmt):
    x, packed, _ = _golden(name, fmt)
    got = bfp.pack(x, fmt)
    assert got.dtype == np.uint8 and got.size == bfp.packed_size(x.shape, fmt) == len(packed)
    assert got.tobytes() == packed
    assert bfp.pack(torch.from_numpy(x), fmt).tobytes() == packed
    assert bfp.pack_reference(x, fmt).tobytes() == packed  # the benchmark's baseline is right too


@pytest.mark.parametrize("name,fmt", CASES)
def test_golden_unpack(name, fmt):
    x, packed, decoded = _golden(name, fmt)
    _assert_same_floats(bfp.unpack(packed, fmt, x.shape), decoded)
    _assert_same_floats(bfp.unpack(np.frombuffer(packed, np.uint8), fmt, x.shape), decoded)
    _assert_same_floats(bfp.unpack_reference(packed, fmt, x.shape), decoded)


# ---------------------------------------------------------------- bfp_format.md §8, byte by byte


def _worked_example():
    x = np.zeros((32, 32), np.float32)
    x[0, :16] = [3.0, 1.0, -0.75, 0.3, 0.01, -2.5, 0.1, 0.0, -0.0, 1.03125, 1e-45, 3.96875, -1.0, 2.0, 0.5, 0.25]
    x[0, 16:] = np.arange(16) * 0.25
    x[16, 0], x[31, 31] = -100, 7
    return x


def _example_exponents(buf):
    exps = np.zeros(64, np.uint8)
    exps[[0, 16, 32, 63]] = [0x80, 0x80, 0x85, 0x81]
    buf[:64] = exps


def test_worked_example_bfp8():
    want = np.zeros(1088, np.uint8)
    _example_exponents(want)
    want[64:80] = np.frombuffer(bytes.fromhex("60 20 98 0a 00 d0 03 00 00 21 00 7f a0 40 10 08"), np.uint8)
    want[320:336] = np.arange(16) * 8
    want[576], want[1087] = 0xE4, 0x70
    got = bfp.pack(_worked_example(), "bfp8_b")
    np.testing.assert_array_equal(got, want)
    words = got.view("<u4")
    assert words[0] == 0x00000080 and words[16] == 0x0A982060


def test_worked_example_bfp4():
    want = np.zeros(576, np.uint8)
    _example_exponents(want)
    want[64:72] = np.frombuffer(bytes.fromhex("26 1a d0 00 20 70 4a 01"), np.uint8)
    want[192:200] = np.frombuffer(bytes.fromhex("00 21 22 43 44 65 66 77"), np.uint8)
    want[320], want[575] = 0x0E, 0x70
    got = bfp.pack(_worked_example(), "bfp4_b")
    np.testing.assert_array_equal(got, want)
    back = bfp.unpack(got, "bfp4_b", (32, 32))
    assert back[0, 3] == 0.5 and back[0, 2] == -1.0 and back[16, 0] == -96.0 and back[0, 11] == 3.5


# ---------------------------------------------------------------- against the clear NumPy model of §4/§5


@pytest.mark.parametrize("search", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_random_bit_patterns_match_reference(fmt, search):
    rng = np.random.default_rng(7)
    w = rng.integers(0, 2**32, (70, 99), dtype=np.uint32)  # every class: NaN, Inf, denormal, wide exponent spread
    w[:8] = (w[:8] & 0x807FFFFF) | (rng.integers(120, 130, (8, 99), dtype=np.uint32) << 23)  # narrow spread: ties
    w[8:12] = (w[8:12] & 0x807FFFFF) | (rng.integers(0, 3, (4, 99), dtype=np.uint32) << 23)  # bottom exponents
    x = w.view(np.float32)
    np.testing.assert_array_equal(bfp.pack(x, fmt, search), bfp.pack_reference(x, fmt, search))


def _row_error(x, fmt, search):
    return np.square(bfp.unpack(bfp.pack(x, fmt, search), fmt, x.shape).astype(np.float64) - x).sum(axis=1)


def test_search_lowers_the_exponent_only_where_that_is_strictly_better():
    x = np.zeros((32, 32), np.float32)
    x[0, :16] = [4] + [0.5, 1.5] * 7 + [1]  # alone at the top: 4 -> 3.5 and every 0.5 / 1.5 exact
    x[1, :16] = [6] + [0.5] * 15  # 6 -> 3.5 would cost more than the halves gain
    x[2, :16] = [4, 4] + [0.5] * 2 + [1] * 12  # equal errors (2 x 1/4 each way): ttnn's exponent stays
    plain, best = bfp.pack(x, "bfp4_b"), bfp.pack(x, "bfp4_b", search=True)
    assert list(plain[:3]) == [129, 129, 129] and list(best[:3]) == [128, 129, 129]  # exponent bytes of face 0
    got = bfp.unpack(best, "bfp4_b", x.shape)
    np.testing.assert_array_equal(got[0, :16], [3.5] + [0.5, 1.5] * 7 + [1])
    np.testing.assert_array_equal(np.delete(best, [0, *range(64, 72)]), np.delete(plain, [0, *range(64, 72)]))
    gauss = np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32)
    for fmt in FORMATS:
        a, b = _row_error(gauss, fmt, False), _row_error(gauss, fmt, True)
        assert (b <= a).all() and b.sum() < a.sum()


def test_search_leaves_inf_nan_and_tiny_rows_as_ttnn_packs_them():
    x = np.zeros((32, 32), np.float32)
    x[0, :3] = [np.inf, 0.5, 1.5]
    x[1, :3] = [np.nan, 0.5, 3.0]
    x[2, :2] = [2.0**-126, 2.0**-127]  # exponent field 1: nothing below to try
    np.testing.assert_array_equal(bfp.pack(x, "bfp4_b", search=True)[:64], bfp.pack(x, "bfp4_b")[:64])


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_byte_streams_decode_like_reference(fmt):
    shape = (2, 40, 70)
    buf = np.random.default_rng(8).integers(0, 256, bfp.packed_size(shape, fmt), dtype=np.uint8)
    got, want = bfp.unpack(buf, fmt, shape), bfp.unpack_reference(buf, fmt, shape)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_ties_round_half_even_without_sticky_bit():
    x = np.zeros((1, 16), np.float32)
    x[0, :4] = [2.0, 1 + 1 / 64 + 2**-23, 1.125 * 2**-0, 1.375]
    codes = bfp.pack(x, "bfp8_b")[64:68]
    assert list(codes) == [64, 32, 36, 44]  # 1+1/64+ulp loses its sticky bit: 32, not 33
    x[0, :4] = [1.0, 1.125, 1.375, 1.9]
    assert list(bfp.pack(x, "bfp4_b")[64:66]) == [4 | 4 << 4, 6 | 7 << 4]  # 1.125 -> 4, 1.375 -> 6, 1.9 -> 7


# ---------------------------------------------------------------- inputs


@pytest.mark.parametrize("fmt", FORMATS)
def test_bfloat16_input_packs_as_its_fp32_value(fmt):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(50, 70, generator=g) * torch.exp2(torch.randint(-130, 120, (50, 70), generator=g))).bfloat16()
    x[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    x[1, :2] = torch.tensor([1e-40, 3.3895e38])  # bf16 denormal and max
    assert bfp.pack(x, fmt).tobytes() == bfp.pack(x.float(), fmt).tobytes()


@pytest.mark.parametrize("fmt", FORMATS)
def test_batched_input_is_slices_back_to_back(fmt):
    x = np.random.default_rng(4).standard_normal((2, 3, 45, 70)).astype(np.float32)
    got = bfp.pack(x, fmt)
    slices = [bfp.pack(s, fmt) for s in x.reshape(6, 45, 70)]
    np.testing.assert_array_equal(got, np.concatenate(slices))
    assert got.size == bfp.packed_size(x.shape, fmt) == 6 * 6 * bfp.tile_bytes(fmt)
    np.testing.assert_array_equal(
        bfp.unpack(got, fmt, x.shape), np.stack([bfp.unpack(s, fmt, (45, 70)) for s in slices]).reshape(x.shape)
    )


def test_sizes():
    assert (bfp.tile_bytes("bfp8_b"), bfp.tile_bytes("bfp4_b")) == (1088, 576)
    assert (bfp.packed_size((45, 70), "bfp8_b"), bfp.packed_size((45, 70), "bfp4_b")) == (6528, 3456)
    assert bfp.packed_size((0, 70), "bfp4_b") == 0 and bfp.pack(np.zeros((0, 5), np.float32), "bfp4_b").size == 0


def test_bad_inputs_raise_one_error_type():
    with pytest.raises(bfp.BfpError, match="unknown bfp format"):
        bfp.pack(np.zeros((2, 2), np.float32), "bfp2_b")
    with pytest.raises(bfp.BfpError, match="float32 or bfloat16"):
        bfp.pack(np.zeros((2, 2)), "bfp4_b")
    with pytest.raises(bfp.BfpError, match=r"\[\.\.\., H, W\]"):
        bfp.pack(np.zeros(5, np.float32), "bfp4_b")
    with pytest.raises(bfp.BfpError, match="expected 576 bytes"):
        bfp.unpack(bytes(575), "bfp4_b", (32, 32))
    assert issubclass(bfp.BfpError, DsflashError)


def test_tilize_roundtrip():
    x = np.arange(2 * 45 * 70).reshape(2, 45, 70)
    rows = tiles.tilize(x)
    assert rows.shape == (2 * 6 * 64, 16) and rows[64 + 16, 0] == x[0, 0, 32 + 16]  # tile 1, face 1, row 0
    np.testing.assert_array_equal(tiles.untilize(rows, x.shape), x)


# ---------------------------------------------------------------- checkpoint FP4 -> bfp4_b


def _fp4_expert(rows, cols, scale_values, seed):
    """Random FP4 expert whose face rows have every largest magnitude (and some all-zero rows)."""
    rng = np.random.default_rng(seed)
    top = rng.integers(0, 8, (rows, cols // 16, 1))  # largest magnitude code per face row
    codes = np.minimum(rng.integers(0, 8, (rows, cols // 16, 16)), top) | (
        rng.integers(0, 2, (rows, cols // 16, 16)) << 3
    )
    codes = codes.reshape(rows, cols).astype(np.uint8)
    packed = torch.from_numpy(codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    scale = torch.from_numpy(rng.choice(np.asarray(scale_values, np.uint8), (rows, cols // 32)))
    return packed, scale.view(torch.float8_e8m0fnu)


@pytest.mark.parametrize(
    "rows,cols,scales",
    [
        (64, 256, range(100, 150)),
        (45, 96, range(0, 255)),  # odd shape: padded rows, an odd number of tile columns
        (33, 32, [*range(0, 11), *range(240, 255)]),  # fp32 denormals and overflow to Inf
        (96, 128, [0, 1, 2, 3, 252, 253, 254, 127]),
        (70, 64, [255, 120, 130]),  # E8M0 NaN
    ],
)
@pytest.mark.parametrize("search", [False, True])
def test_fp4_direct_equals_dequant_then_pack(rows, cols, scales, search):
    packed, scale = _fp4_expert(rows, cols, list(scales), seed=rows * cols)
    want = bfp.pack(fp4.dequant(packed, scale).float(), "bfp4_b", search)
    np.testing.assert_array_equal(bfp.fp4_to_bfp4(packed, scale, search), want)
    np.testing.assert_array_equal(bfp.fp4_to_bfp4(packed.numpy(), scale.view(torch.uint8).numpy(), search), want)


def test_fp4_direct_on_quantized_weights():
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(5)) * 0.02
    packed, scale = fp4.quant(w)
    dq = fp4.dequant(packed, scale)
    np.testing.assert_array_equal(bfp.fp4_to_bfp4(packed, scale), bfp.pack(dq, "bfp4_b"))
    best = bfp.fp4_to_bfp4(packed, scale, search=True)
    np.testing.assert_array_equal(best, bfp.pack(dq, "bfp4_b", search=True))

    def rel(buf):
        return np.linalg.norm(bfp.unpack(buf, "bfp4_b", tuple(dq.shape)) - dq.numpy()) / np.linalg.norm(dq.numpy())

    assert rel(best) < 0.75 * rel(bfp.fp4_to_bfp4(packed, scale))  # measured 0.069 vs 0.108


def test_fp4_direct_rejects_mismatched_scales():
    with pytest.raises(bfp.BfpError, match="not \\[O, I/2\\]"):
        bfp.fp4_to_bfp4(np.zeros((32, 32), np.int8), np.zeros((32, 3), np.uint8))


# ---------------------------------------------------------------- shipped self-check


SELFCHECK = Path(bfp.__file__).resolve().parents[1] / "data" / "bfp_selfcheck" / "cases.npz"


def test_self_check_passes():
    bfp.self_check()


@pytest.mark.parametrize("key", ["faces.bfp4_b", "faces.bfp8_b", "single_element_1x1.bfp8_b", "faces.bfp4_b.unpacked"])
def test_self_check_fails_on_corrupted_expectation(tmp_path, key):
    with np.load(SELFCHECK) as z:
        arrays = {k: z[k].copy() for k in z.files}
    flat = arrays[key].reshape(-1).view(np.uint8)
    flat[70] ^= 0x10
    np.savez(tmp_path / "cases.npz", **arrays)
    with pytest.raises(StoreCorrupt, match="bfp self-check"):
        bfp.self_check(tmp_path / "cases.npz")


def test_selfcheck_data_is_golden():
    """Every face row shipped in the self-check is a face row of a golden vector, with its golden bytes."""
    golden = {}
    for c in MANIFEST["cases"]:
        rows = tiles.tilize(np.load(DATA / c["input"]))
        for fmt in FORMATS:
            t = np.frombuffer((DATA / c["outputs"][fmt]["packed"]).read_bytes(), np.uint8).reshape(len(rows) // 64, -1)
            data = t[:, 64:].reshape(len(rows), -1)
            for i, row in enumerate(rows):
                golden[(fmt, row.tobytes())] = bytes([t[i // 64, i % 64]]) + data[i].tobytes()
    with np.load(SELFCHECK) as z:
        rows = tiles.tilize(z["faces.input"])[:32]
        for fmt in FORMATS:
            t = z[f"faces.{fmt}"]
            data = t[64:].reshape(64, -1)
            for i, row in enumerate(rows):
                assert golden[(fmt, row.tobytes())] == bytes([t[i]]) + data[i].tobytes()


# ---------------------------------------------------------------- CLI


@pytest.mark.parametrize("name,fmt", CASES)
def test_cli_pack_and_unpack_in_process(tmp_path, name, fmt):
    x, packed, decoded = _golden(name, fmt)
    c = _case(name)
    assert main(["bfp", "pack", "--format", fmt, str(DATA / c["input"]), str(tmp_path / "t.bin")]) == 0
    assert (tmp_path / "t.bin").read_bytes() == packed
    shape = ",".join(map(str, x.shape))
    assert main(["bfp", "unpack", "--format", fmt, "--shape", shape, str(tmp_path / "t.bin"), str(tmp_path / "u")]) == 0
    _assert_same_floats(np.load(tmp_path / "u"), decoded)


def test_cli_subprocess(tmp_path):
    c = _case("non_multiple_45x70")
    run = [sys.executable, "-m", "dsflash", "bfp"]
    done = subprocess.run(
        [*run, "pack", str(DATA / c["input"]), str(tmp_path / "t.bin")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "t.bin").read_bytes() == (DATA / c["outputs"]["bfp4_b"]["packed"]).read_bytes()
    bad = subprocess.run(
        [*run, "unpack", "--shape", "45,200", str(tmp_path / "t.bin"), str(tmp_path / "u.npy")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().count("\n") == 0 and "expected 8064 bytes" in bad.stderr


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["bfp", "pack", str(tmp_path / "missing.npy"), str(tmp_path / "t.bin")]) == 1
    np.save(tmp_path / "f64.npy", np.zeros((4, 4)))
    assert main(["bfp", "pack", str(tmp_path / "f64.npy"), str(tmp_path / "t.bin")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("dsflash bfp: error:") for line in err)


def test_cli_bench_prints_one_json_line(capsys):
    assert main(["bfp", "bench", "--format", "bfp8_b", "--shape", "64,96", "--reps", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert set(row) == {"format", "shape", "median_ms", "in_mb_per_s", "out_mb_per_s"}
    assert row["format"] == "bfp8_b" and row["shape"] == [64, 96] and row["median_ms"] > 0
    assert row["out_mb_per_s"] == pytest.approx(row["in_mb_per_s"] * 6528 / (64 * 96 * 4), rel=0.01)


def test_cli_help_shows_defaults(capsys):
    for action in ("pack", "unpack", "bench"):
        with pytest.raises(SystemExit):
            main(["bfp", action, "--help"])
        out = capsys.readouterr().out
        assert "default: bfp4_b" in out
    with pytest.raises(SystemExit):
        main(["bfp", "bench", "--help"])
    out = capsys.readouterr().out
    assert "default: 4096,4096" in out and "default: 7" in out
