"""Packed expert store: layout, round trip against the checkpoint, identity checks, integrity checks."""

import json
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from dsflash.checkpoint.index import Checkpoint
from dsflash.checkpoint.writer import write_checkpoint
from dsflash.config import ModelConfig
from dsflash.errors import NoSpace, StoreCorrupt, StoreMismatch
from dsflash.formats import bfp
from dsflash.store import layout
from dsflash.store.build import PAUSE_ENV, build_store
from dsflash.store.layout import (
    FORMAT_VERSION,
    MANIFEST,
    StoreManifest,
    StoreMissing,
    model_identity,
    model_name,
    store_dir,
)
from dsflash.store.reader import Store, open_store
from dsflash.store.verify import verify_store

TINY = Path(__file__).resolve().parents[1] / "data" / "dsv41_tiny"


@pytest.fixture(scope="module")
def tiny():
    return Checkpoint.open(TINY / "tiny_a" / "model")


def _wide_config(inter: int = 128) -> dict:
    raw = json.loads((TINY / "tiny_a" / "model" / "config.json").read_text())
    raw["text_config"]["moe_intermediate_size"] = inter
    return raw


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """moe_intermediate_size 128: shards of 32 and 64 features, w2 split on whole FP4 scale groups."""
    return Checkpoint.open(write_checkpoint(_wide_config(), tmp_path_factory.mktemp("wide") / "model", seed=3))


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Built stores, shared by the tests of this module: (ckpt path, tp, fmt) -> Store."""
    root = tmp_path_factory.mktemp("stores")
    cache = {}

    def get(ckpt, tp, fmt):
        key = (str(ckpt.path), tp, fmt)
        if key not in cache:
            r = root / f"{len(cache)}"
            build_store(ckpt, r, tp, fmt, progress=False)
            cache[key] = open_store(ckpt, r, tp, fmt)
        return cache[key]

    yield get
    for s in cache.values():
        s.close()


def _expected(ckpt, prefix, e, w, a, b, fmt):
    full = ckpt.tensor(f"{prefix}.ffn.experts.{e}.{w}.weight")
    if w == "w2" and (b - a) % 16:
        # a face row would straddle ranks: the store rounds w2 over the whole matrix (the TP-1 values) first
        full = torch.from_numpy(bfp.unpack(_pack(full, fmt), fmt, tuple(full.shape)))
    return full[:, a:b] if w == "w2" else full[a:b]


def _pack(x, fmt):
    """What a store holds: bfp4_b with the exponent search (it lowers FP4's weight error), bfp8_b as ttnn packs."""
    return bfp.pack(x, fmt, search=fmt == "bfp4_b")


def test_narrow_shards_hold_the_tp1_values(tiny, stores):
    """Whatever the TP degree, the decoded shards put together are the TP-1 expert: engines agree across TP."""
    one, four = stores(tiny, 1, "bfp4_b"), stores(tiny, 4, "bfp4_b")
    w1, w3, w2 = one.unpack(0, 3, 0)
    parts = [four.unpack(0, 3, r) for r in range(4)]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), w1)
    np.testing.assert_array_equal(np.concatenate([p[2] for p in parts], axis=1), w2)
    assert verify_store(four, ckpt=tiny, decode=10**6)["decoded"] == 14 * 8 * 4 - 2 * 4 * 4  # every shard


# ---------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("fmt", ["bfp4_b", "bfp8_b"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_tiny(tiny, stores, tp, fmt):
    """inter 32: TP 2 and 4 give shards of 16 and 8 features, narrower than a tile (padded); layers 12, 13 are the
    DSpark stages (4 experts each)."""
    store = stores(tiny, tp, fmt)
    assert store.layers == list(range(14))
    assert [store.n_experts(i) for i in (0, 11, 12, 13)] == [8, 8, 4, 4]
    _check_layers(tiny, store, [0, 7, 12, 13], fmt)


@pytest.mark.parametrize("tp,fmt", [(4, "bfp4_b"), (2, "bfp8_b"), (2, "bfp4_b")])
def test_round_trip_wide(wide, stores, tp, fmt):
    store = stores(wide, tp, fmt)
    _check_layers(wide, store, [1, 13], fmt)


def _check_layers(ckpt, store, layers, fmt):
    g = store.geometry
    for lid in layers:
        prefix = store.entry(lid).prefix
        for e in range(store.n_experts(lid)):
            for r in range(g.tp):
                a, b = g.rank_slice(r)
                unpacked = store.unpack(lid, e, r)
                for part, got in zip(store.parts(lid, e, r), unpacked):
                    x = _expected(ckpt, prefix, e, part.name, a, b, fmt)
                    assert part.shape == tuple(x.shape)
                    packed = _pack(x, fmt)
                    # bytes of the store == the packing of the dequantized checkpoint slice
                    assert np.array_equal(part.data, packed), (lid, e, r, part.name)
                    # and its decode == the bfp round trip of that slice
                    np.testing.assert_array_equal(got.view(np.uint32), bfp.unpack(packed, fmt, x.shape).view(np.uint32))
                    assert np.abs(got - x.numpy()).max() <= np.abs(x.numpy()).max() * 2**-2


def test_narrow_shard_is_one_padded_tile_row(tiny, stores):
    g = stores(tiny, 4, "bfp4_b").geometry
    w1, w3, w2 = g.parts
    assert (w1.shape, w1.tiles) == ((8, 64), (1, 2))
    assert (w2.shape, w2.tiles) == ((64, 8), (2, 1))
    assert g.shard_bytes == 6 * bfp.tile_bytes("bfp4_b")


# ---------------------------------------------------------------------------------------------- layout


def test_on_disk_layout(wide, stores):
    """Record e at e * record_bytes, rank r at r * stride (4 KiB aligned), w1 | w3 | w2 inside, zeros after, crc32
    of each whole rank block in the manifest; views are zero-copy."""
    store = stores(wide, 2, "bfp4_b")
    g = store.geometry
    assert g.stride % 4096 == 0 and g.record_bytes == 2 * g.stride
    lid, e = 3, 5
    entry = store.entry(lid)
    data = (store.directory / entry.file).read_bytes()
    assert len(data) == entry.experts * g.record_bytes == entry.nbytes
    for r in range(2):
        start = e * g.record_bytes + r * g.stride
        block = data[start : start + g.stride]
        assert zlib.crc32(block) == entry.crc32[e][r]
        assert block[: g.shard_bytes] == store.shard(lid, e, r).tobytes()
        assert set(block[g.shard_bytes :]) <= {0}
        for part in store.parts(lid, e, r):
            p = next(q for q in g.parts if q.name == part.name)
            assert block[p.offset : p.offset + p.nbytes] == part.data.tobytes()
        path, off, n = store.shard_range(lid, e, r)
        assert (path.name, off, n) == (entry.file, start, g.shard_bytes) and off % 4096 == 0
    m = json.loads((store.directory / MANIFEST).read_text())
    rec = m["layers"][lid]["records"][e]
    assert rec == {"expert": e, "offset": e * g.record_bytes, "crc32": [f"{c:08x}" for c in entry.crc32[e]]}
    assert [p["name"] for p in m["parts"]] == ["w1", "w3", "w2"] and m["complete"] is True
    # zero-copy: the views point into the mapping
    rec_view = store.record(lid, e)
    assert store.shard(lid, e, 1).ctypes.data == rec_view.ctypes.data + g.stride
    assert not store.shard(lid, e, 0).flags.writeable
    t = store.shard(lid, e, 1, torch=True)
    assert t.dtype == torch.uint8 and t.data_ptr() == rec_view.ctypes.data + g.stride
    with Store.open(store.directory) as again:  # without an expected identity: whatever is there
        assert again.record(lid, e).tobytes() == rec_view.tobytes()


def test_prefetch(wide, stores):
    store = stores(wide, 2, "bfp4_b")
    g = store.geometry
    assert store.prefetch(2, [0, 1, 5]) == 3 * g.record_bytes
    assert store.prefetch(2, [4], rank=1) == g.shard_bytes
    with pytest.raises(IndexError, match="expert 8 out of range"):
        store.prefetch(2, [8])


def test_dequant_fp4_is_bit_exact():
    """Every FP4 byte under every E8M0 scale (0: denormal products, 254: inf, 255: NaN) against fp4.dequant."""
    from dsflash.formats import fp4
    from dsflash.store.build import dequant_fp4

    packed = np.tile(np.arange(256, dtype=np.uint8), (256, 1))  # [256 scales, 256 bytes = 512 values]
    scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    for rows in (slice(0, 255), slice(None)):  # without and with the NaN scale
        got = dequant_fp4(torch.from_numpy(packed[rows]).view(torch.int8), torch.from_numpy(scale[rows]))
        want = fp4.dequant(torch.from_numpy(packed[rows]).view(torch.int8), torch.from_numpy(scale[rows]))
        assert np.array_equal(got.view(np.uint32), want.numpy().view(np.uint32))


def test_geometry_rules():
    with pytest.raises(StoreMismatch, match="does not divide"):
        layout.Geometry(3, "bfp4_b", 64, 32)
    with pytest.raises(StoreMismatch, match="unknown tile format"):
        layout.Geometry(1, "bfp2", 64, 32)
    # V4.1 widths: every rank block is already a whole number of pages, the alignment costs nothing
    for tp in (1, 2, 4):
        for fmt in ("bfp4_b", "bfp8_b"):
            g = layout.Geometry(tp, fmt, 5120, 2304)
            assert g.stride == g.shard_bytes


def test_auto_format_is_exact_where_the_store_fits_and_bfp4_where_it_must(tiny):
    flash = ModelConfig.from_file(
        Path(__file__).resolve().parents[1] / "data" / "configs" / "deepseek-v4.1-flash.config.json"
    )
    assert 300e9 < layout.store_bytes(flash, "bfp4_b") < 330e9  # the reference box's 313 GB
    assert layout.store_bytes(flash, "bfp8_b") > 580e9
    tb = 2**40
    assert layout.resolve_tile_format("auto", flash, memory=2 * tb) == "bfp4_b"  # 590 GB > a quarter of 2 TiB
    assert layout.resolve_tile_format("auto", flash, memory=4 * tb) == "bfp8_b"
    small = layout.store_bytes(tiny.config, "bfp8_b")
    assert layout.resolve_tile_format("auto", tiny.config, memory=4 * small) == "bfp8_b"
    assert layout.resolve_tile_format("auto", tiny.config, memory=4 * small - 1) == "bfp4_b"
    assert layout.resolve_tile_format("auto", tiny.config) == "bfp8_b"  # this machine
    assert layout.resolve_tile_format("bfp4_b", tiny.config, memory=tb) == "bfp4_b"  # asked for: kept


def test_names_and_roots(tmp_path, monkeypatch, tiny):
    snap = tmp_path / "hub" / "models--deepseek-ai--DeepSeek-V4.1-Flash" / "snapshots" / ("ab" * 20)
    snap.mkdir(parents=True)
    assert model_name(snap) == "deepseek-v4.1-flash"
    assert model_identity(snap) == ("deepseek-ai/DeepSeek-V4.1-Flash", "ab" * 20)
    assert model_name("deepseek-ai/DeepSeek-V4.1-Flash@main") == "deepseek-v4.1-flash"
    a, b = model_name(TINY / "tiny_a" / "model"), model_name(TINY / "tiny_b" / "model")
    assert a.startswith("model-") and b.startswith("model-") and a != b
    monkeypatch.setenv("DSFLASH_CACHE", str(tmp_path / "c"))
    assert store_dir(snap) == tmp_path / "c" / "deepseek-v4.1-flash" / "weights"
    assert store_dir(snap, tmp_path / "d") == tmp_path / "d" / "deepseek-v4.1-flash" / "weights"
    monkeypatch.delenv("DSFLASH_CACHE")
    assert store_dir(snap) == Path.home() / ".cache" / "dsflash" / "deepseek-v4.1-flash" / "weights"


# ---------------------------------------------------------------------------------------------- identity


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny):
    """A finished tiny_a store, TP 2 bfp4_b; tests copy it before changing anything."""
    root = tmp_path_factory.mktemp("built")
    build_store(tiny, root, 2, "bfp4_b", progress=False)
    return root


def _copy(built, tmp_path) -> Path:
    shutil.copytree(built, tmp_path / "root")
    return tmp_path / "root"


def test_other_tp_or_format_gets_its_own_store_beside_the_first(tmp_path, built, tiny):
    root = _copy(built, tmp_path)
    first = store_dir(tiny.path, root)
    before = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    with pytest.raises(StoreMissing, match="weights-tp4-bfp4_b"):  # never the first store, whatever it holds
        open_store(tiny, root, 4, "bfp4_b")
    with pytest.raises(StoreMissing, match="weights-tp2-bfp8_b"):
        open_store(tiny, root, 2, "bfp8_b")
    m = build_store(tiny, root, 1, "bfp8_b", progress=False)
    assert m.stats["reason"] == "new" and store_dir(tiny.path, root, 1, "bfp8_b") == first.parent / "weights-tp1-bfp8_b"
    assert build_store(tiny, root, 1, "bfp8_b", progress=False).stats["built"] == []  # found again, kept
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == before  # the first store as it was
    with open_store(tiny, root, 2, "bfp4_b") as s, open_store(tiny, root, None, None) as t:
        assert s.directory == t.directory == first and s.tp == t.tp == 2  # unspecified: the first store
    with open_store(tiny, root, 1, "bfp8_b") as s, open_store(tiny, root, None, "bfp8_b") as t:
        assert s.directory == t.directory != first and (s.tp, s.tile_format) == (1, "bfp8_b")
        verify_store(s, ckpt=tiny, decode=4)


def test_other_model_is_refused(tmp_path, built, tiny):
    root = _copy(built, tmp_path)
    other = Checkpoint.open(TINY / "tiny_b" / "model")
    # the store of tiny_a, put where tiny_b's would be
    os.rename(root / model_name(tiny.path), root / model_name(other.path))
    with pytest.raises(StoreMismatch) as err:
        open_store(other, root, 2, "bfp4_b")
    assert "tiny_a/model' (store) vs" in str(err.value) and "revision" in str(err.value)


def test_other_revision_is_refused_then_rebuilt(tmp_path):
    d = tmp_path / "model"
    ckpt = Checkpoint.open(write_checkpoint(_wide_config(64), d, seed=1))
    build_store(ckpt, tmp_path / "c", 2, "bfp4_b", progress=False)
    first = (store_dir(d, tmp_path / "c") / "layers.0.experts.bin").read_bytes()
    ckpt = Checkpoint.open(write_checkpoint(_wide_config(64), d, seed=2))  # same shapes, other weights
    with pytest.raises(StoreMismatch, match=r"revision 'sha256:\w+' \(store\) vs 'sha256:\w+' \(requested\)"):
        open_store(ckpt, tmp_path / "c", 2, "bfp4_b")
    build_store(ckpt, tmp_path / "c", 2, "bfp4_b", progress=False, rebuild=True)
    with open_store(ckpt, tmp_path / "c", 2, "bfp4_b") as store:
        assert store.manifest.revision == model_identity(d)[1]
        assert store.record(0, 0).tobytes() != first[: store.geometry.record_bytes]
        verify_store(store, ckpt=ckpt, decode=8)


def test_other_format_version_is_refused(tmp_path, built, tiny):
    root = _copy(built, tmp_path)
    path = store_dir(tiny.path, root) / MANIFEST
    path.write_text(path.read_text().replace(f'"format_version": {FORMAT_VERSION}', '"format_version": 99', 1))
    with pytest.raises(StoreMismatch, match=rf"store format version 99 \(store\) vs {FORMAT_VERSION} \(requested\)"):
        open_store(tiny, root, 2, "bfp4_b")
    m = build_store(tiny, root, 2, "bfp4_b", progress=False, rebuild=True)
    assert m.stats["built"] == list(range(14)) and "store format version" in m.stats["reason"]


def test_a_store_that_does_not_fit_the_disk_is_refused_before_writing(tmp_path, built, tiny, monkeypatch):
    from dsflash.store import build

    need = layout.store_bytes(tiny.config, "bfp4_b")
    disk = shutil.disk_usage(tmp_path)

    def free(left):
        monkeypatch.setattr(build.shutil, "disk_usage", lambda p: disk._replace(free=left))

    free(need - 1)
    with pytest.raises(NoSpace, match=r"needs 0\.0 GB more in .*weights, but 0\.0 GB are free there"):
        build_store(tiny, tmp_path / "new", 1, "bfp4_b", progress=False)
    assert [p.name for p in store_dir(tiny.path, tmp_path / "new").iterdir()] == [".build.lock"]  # nothing claimed
    free(need)
    assert build_store(tiny, tmp_path / "new", 1, "bfp4_b", progress=False).total_bytes() == need  # just fits
    # a rebuild counts the old store it removes first: no free space at all is enough to replace it
    root = _copy(built, tmp_path)
    path = store_dir(tiny.path, root) / MANIFEST
    path.write_text(path.read_text().replace(f'"format_version": {FORMAT_VERSION}', '"format_version": 99', 1))
    free(0)
    assert build_store(tiny, root, 2, "bfp4_b", progress=False, rebuild=True).stats["built"] == list(range(14))
    with pytest.raises(NoSpace):
        build_store(tiny, root, 1, "bfp4_b", progress=False)  # beside it: nothing to remove


def test_missing_unfinished_and_damaged(tmp_path, built, tiny):
    with pytest.raises(StoreMissing, match="no expert store"):
        open_store(tiny, tmp_path / "nothing", 2, "bfp4_b")
    root = _copy(built, tmp_path)
    d = store_dir(tiny.path, root)
    m = StoreManifest.read(d)
    del m.layers[5]
    m.write(d)
    with pytest.raises(StoreMissing, match=r"unfinished \(13 of 14 layers; missing 5\)"):
        open_store(tiny, root, 2, "bfp4_b")
    (d / MANIFEST).write_text("{not json")
    with pytest.raises(StoreCorrupt, match="damaged"):
        open_store(tiny, root, 2, "bfp4_b")
    with pytest.raises(StoreCorrupt, match="pass --rebuild"):
        build_store(tiny, root, 2, "bfp4_b", progress=False)


def test_truncated_layer_is_detected_and_rebuilt(tmp_path, built, tiny, capsys):
    root = _copy(built, tmp_path)
    f = store_dir(tiny.path, root) / "layers.4.experts.bin"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 100)
    with pytest.raises(StoreCorrupt, match=r"layers.4.experts.bin is truncated: \d+ bytes, the manifest says"):
        open_store(tiny, root, 2, "bfp4_b")
    m = build_store(tiny, root, 2, "bfp4_b", progress=True)
    assert m.stats["built"] == [4] and len(m.stats["kept"]) == 13
    bar = capsys.readouterr().err  # the progress bar counts layers and bytes, starting from what was kept
    assert "layers 13/14" in bar and "layers 14/14" in bar and "832k/832k" in bar
    assert f.read_bytes() == (store_dir(tiny.path, built) / "layers.4.experts.bin").read_bytes()


# ---------------------------------------------------------------------------------------------- integrity


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_verify_names_the_bad_record(tmp_path, built, tiny):
    root = _copy(built, tmp_path)
    with open_store(tiny, root, 2, "bfp4_b") as store:
        assert verify_store(store)["records"] == 12 * 8 + 2 * 4
        g = store.geometry
        _flip(store.directory / "layers.6.experts.bin", 3 * g.record_bytes + g.stride + 100)
    with open_store(tiny, root, 2, "bfp4_b") as store:
        with pytest.raises(StoreCorrupt, match=r"layer 6 \(layers.6\) expert 3 rank 1: crc32 \w+, manifest \w+"):
            verify_store(store)
        assert verify_store(store, sample=3, seed=0)["records"] == 3  # a sample that misses it passes


def test_verify_padding_byte_and_decode(tmp_path, built, tiny):
    root = _copy(built, tmp_path)
    d = store_dir(tiny.path, root)
    g = StoreManifest.read(d).geometry
    _flip(d / "mtp.1.experts.bin", 2 * g.record_bytes + g.stride - 1)  # last padding byte of rank 0
    with open_store(tiny, root, 2, "bfp4_b") as store, pytest.raises(StoreCorrupt, match=r"layer 13 \(mtp.1\)"):
        verify_store(store)
    # a bad byte with a matching checksum (a packer bug, not a disk error): only the decode comparison sees it
    root = _copy(built, tmp_path / "b")
    d = store_dir(tiny.path, root)
    m = StoreManifest.read(d)
    f = d / "layers.2.experts.bin"
    _flip(f, 7 * g.record_bytes + g.parts[2].offset + 70)  # w2 of expert 7, rank 0
    block = f.read_bytes()[7 * g.record_bytes :][: g.stride]
    m.layers[2].crc32[7][0] = zlib.crc32(block)
    m.write(d)
    with open_store(tiny, root, 2, "bfp4_b") as store:
        verify_store(store)
        with pytest.raises(StoreCorrupt, match=r"layer 2 \(layers.2\) expert 7 rank 0 w2 differs from the checkpoint"):
            verify_store(store, ckpt=tiny, decode=1000)


def test_self_check_failure_refuses_to_build(tmp_path, monkeypatch, tiny):
    golden = Path(bfp.__file__).parent.parent / "data" / "bfp_selfcheck" / "cases.npz"
    with np.load(golden) as z:
        cases = {k: z[k].copy() for k in z.files}
    key = next(k for k in cases if k.endswith(".bfp4_b"))
    cases[key][5] ^= 1
    bad = tmp_path / "cases.npz"
    np.savez(bad, **cases)
    real = bfp.self_check
    monkeypatch.setattr(bfp, "self_check", lambda path=None: real(bad))
    with pytest.raises(StoreCorrupt, match="refusing to build the expert store: bfp self-check"):
        build_store(tiny, tmp_path / "c", 2, "bfp4_b", progress=False)
    assert sorted(p.name for p in store_dir(tiny.path, tmp_path / "c").iterdir()) == [".build.lock"]


def test_concurrent_build_is_refused(tmp_path, tiny):
    import fcntl

    d = store_dir(tiny.path, tmp_path)
    d.mkdir(parents=True)
    with open(d / layout.LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(StoreMismatch, match="another process is building"):
            build_store(tiny, tmp_path, 1, "bfp4_b", progress=False)


def test_pause_hook_is_off_by_default():
    assert PAUSE_ENV not in os.environ
