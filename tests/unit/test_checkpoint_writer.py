"""writer.py: random checkpoints of any config in the official format, read back by our reader and safetensors."""

import json
import os
import resource
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsflash.checkpoint import writer
from dsflash.checkpoint.index import Checkpoint
from dsflash.checkpoint.names import expected_inventory, summary
from dsflash.config import ModelConfig
from dsflash.formats import fp4, fp8

DATA = Path(__file__).resolve().parents[1] / "data"
TINY = DATA / "dsv41_tiny"


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def tiny_v4() -> dict:
    """architecture §8.1 (tiny-V4: hash layers, CSA ratio 4, HCA ratio 16, NextN MTP)."""
    raw = _json(DATA / "configs" / "deepseek-v4-flash.config.json")
    raw.update(
        vocab_size=512, hidden_size=64, num_hidden_layers=6, num_hash_layers=2, num_attention_heads=4, head_dim=96,
        qk_rope_head_dim=32, q_lora_rank=32, o_lora_rank=32, o_groups=2, sliding_window=8,
        compress_ratios=[0, 0, 4, 16, 4, 16, 0], index_n_heads=4, index_head_dim=64, index_topk=4,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    )  # fmt: skip
    raw["quantization_config"]["weight_block_size"] = [32, 32]
    return raw


def tiny_v41_vision() -> dict:
    """tiny_a's text model plus a small vision tower (adds gate.bias_vl and the vision tensors)."""
    raw = _json(TINY / "tiny_a" / "model" / "config.json")
    raw["image_token_id"] = 1000
    raw["vision_config"] = {
        "model_type": "deepseek_v41_vision", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
        "intermediate_size": 96, "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 3,
        "max_image_tokens": 16, "min_pixels": 3136, "max_wh_ratio": None,
    }  # fmt: skip
    return raw


CONFIGS = {
    "tiny_a": lambda: _json(TINY / "tiny_a" / "model" / "config.json"),
    "tiny_b": lambda: _json(TINY / "tiny_b" / "model" / "config.json"),
    "v4": tiny_v4,
    "v41_vision": tiny_v41_vision,
}


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, make in CONFIGS.items():
        out[name] = writer.write_checkpoint(make(), tmp_path_factory.mktemp(name), seed=7)
    return out


@pytest.mark.parametrize("case", list(CONFIGS))
def test_written_checkpoint_verifies(written, case):
    ckpt = Checkpoint.open(written[case])
    want = summary(expected_inventory(ckpt.config))
    assert ckpt.verify() == {"tensors": want["tensors"], "bytes": want["bytes"]}
    index = _json(written[case] / "model.safetensors.index.json")
    assert index["metadata"]["total_size"] == want["bytes"]
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert _json(written[case] / "config.json") == CONFIGS[case]()  # config.json exactly as given
    assert (written[case] / "tokenizer.json").is_file() and (written[case] / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("case", list(CONFIGS))
def test_safetensors_reads_what_we_wrote(written, case):
    ckpt = Checkpoint.open(written[case])
    with safe_open(str(written[case] / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(ckpt.names())
        for name in sorted(f.keys()):
            theirs, ours = f.get_tensor(name), ckpt.raw(name)
            assert theirs.dtype == ours.dtype and theirs.shape == ours.shape, name
            assert torch.equal(theirs.view(torch.uint8), ours.view(torch.uint8)), name


def _expected(cfg: ModelConfig, name: str, seed: int) -> torch.Tensor:
    """What .tensor() must return: the writer's fp32 values through the storage format's quantization rule."""
    spec = next(s for s in expected_inventory(cfg) if s.name == name)
    v = writer.tensor_values(cfg, name, seed)
    fmt = spec.row.fmt
    if fmt == "fp8":
        return fp8.dequant_block(*fp8.quant_block(v, cfg.fp8_block), cfg.fp8_block)
    if fmt == "fp4":
        return fp4.dequant(*fp4.quant(v))
    if fmt == "fp8_rows":  # written out independently of the writer: 2^ceil(log2(amax/448)) per row and 32 columns
        g = v.unflatten(-1, (-1, 32))
        s = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1, keepdim=True) / 448)))
        return (fp8.to_e4m3(g / s).float() * s).flatten(-2)
    if fmt == "bf16":
        return v.bfloat16().float()
    return v


@pytest.mark.parametrize(
    "case,names",
    [
        ("tiny_a", ["layers.2.attn.wq_b.weight", "layers.3.ffn.experts.5.w2.weight", "layers.1.engram.embed.weight",
                    "embed.weight", "layers.0.hc_attn_fn", "mtp.1.markov_head.head.weight", "layers.2.ffn.gate.bias"]),
        ("v4", ["layers.0.ffn.gate.tid2eid", "layers.2.attn.compressor.ape", "mtp.0.e_proj.weight",
                "layers.4.attn.indexer.wq_b.weight", "hc_head_scale", "layers.5.ffn.experts.0.w1.weight"]),
    ],
)  # fmt: skip
def test_tensor_dequantizes_to_the_written_values(written, case, names):
    ckpt = Checkpoint.open(written[case])
    for name in names:
        got = ckpt.tensor(name)
        want = _expected(ckpt.config, name, seed=7)
        assert got.shape == want.shape, name
        assert torch.equal(got, want), name


def test_init_keeps_activations_sane(written):
    ckpt = Checkpoint.open(written["tiny_a"])
    x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(0))
    for name in (
        "layers.0.attn.wq_a.weight",
        "layers.0.ffn.experts.0.w1.weight",
        "layers.0.ffn.shared_experts.w3.weight",
    ):
        y = x @ ckpt.tensor(name).T
        assert 0.8 < y.std() < 1.25, name  # std = gain * fan_in^-0.5 keeps unit-variance inputs at unit variance
    for name, gain in (("layers.0.attn.wo_b.weight", 0.15), ("layers.0.ffn.experts.1.w2.weight", 0.15)):
        w = ckpt.tensor(name)
        assert 0.8 < w.std() * w.shape[1] ** 0.5 / gain < 1.25, name
    assert abs(ckpt.tensor("layers.0.attn_norm.weight").mean() - 1) < 0.1
    scale = ckpt.tensor("layers.0.hc_attn_scale")
    assert ((scale >= 0.5) & (scale <= 1.5)).all()
    assert "layers.0.ffn.gate.tid2eid" not in ckpt  # V4.1 has no hash routing
    tid = Checkpoint.open(written["v4"]).tensor("layers.1.ffn.gate.tid2eid")
    assert tid.dtype == torch.int64 and tid.min() >= 0 and tid.max() < 8
    assert (tid.sort(-1).values.diff(dim=-1) > 0).all()  # distinct experts per token


def test_vision_tensors_are_written_and_reported(written):
    ckpt = Checkpoint.open(written["v41_vision"])
    vision = ckpt.vision_names()
    assert "vision.blocks.1.mlp.w1.weight" in vision and "aligner.w2.bias" in vision and "image_newline" in vision
    assert "layers.0.ffn.gate.bias_vl" in ckpt.names() and "layers.0.ffn.gate.bias_vl" not in vision
    assert Checkpoint.open(written["tiny_a"]).vision_names() == []


def test_sharded_output(tmp_path):
    out = writer.write_checkpoint(CONFIGS["tiny_b"](), tmp_path / "m", seed=1, shards=3)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    ckpt = Checkpoint.open(out)
    assert ckpt.verify()["tensors"] == 613
    weight_map = ckpt.weight_map
    for name in ckpt.names():  # a weight and its scale share a shard
        if name.endswith(".scale"):
            assert weight_map[name] == weight_map[name.removesuffix(".scale") + ".weight"]
    for file in files:
        with safe_open(str(out / file), "pt") as f:
            assert all(weight_map[k] == file for k in sorted(f.keys()))
    sizes = [(out / f).stat().st_size for f in files]
    assert max(sizes) < 2 * min(sizes)  # balanced by bytes
    # the same tensors as the single-file checkpoint with the same seed
    single = Checkpoint.open(writer.write_checkpoint(CONFIGS["tiny_b"](), tmp_path / "s", seed=1))
    for name in ("embed.weight", "mtp.0.main_proj.weight", "layers.7.ffn.experts.2.w3.scale"):
        assert torch.equal(single.raw(name).view(torch.uint8), ckpt.raw(name).view(torch.uint8))
    # rewriting with fewer shards removes the old ones
    writer.write_checkpoint(CONFIGS["tiny_b"](), out, seed=1, shards=2)
    assert len(list(out.glob("*.safetensors"))) == 2
    assert Checkpoint.open(out).verify()["tensors"] == 613


def test_deterministic(tmp_path, written):
    again = writer.write_checkpoint(CONFIGS["tiny_a"](), tmp_path / "again", seed=7, workers=2)  # forked workers
    assert _files(again) == _files(written["tiny_a"])
    other = writer.write_checkpoint(CONFIGS["tiny_a"](), tmp_path / "other", seed=8)
    assert _files(other)["model.safetensors"] != _files(again)["model.safetensors"]


def test_chunked_writing(tmp_path, monkeypatch, written):
    # real-width tensors are written in many chunks, by several processes, each chunk at its own offset
    monkeypatch.setattr(writer, "CHUNK", 1000)
    serial = writer.write_checkpoint(CONFIGS["tiny_a"](), tmp_path / "serial", seed=7)
    forked = writer.write_checkpoint(CONFIGS["tiny_a"](), tmp_path / "forked", seed=7, workers=2)
    assert _files(serial) == _files(forked)
    ckpt = Checkpoint.open(serial)
    assert ckpt.verify()["tensors"] == 1081
    names = ["layers.2.attn.wq_b.weight", "layers.1.engram.embed.weight", "embed.weight", "layers.4.attn.wo_a.weight"]
    names += ["layers.3.ffn.experts.5.w2.weight"]
    for name in names:
        assert writer.chunk_rows(ckpt.specs[name], ckpt.config) < ckpt.specs[name].logical[0]  # really chunked
        assert torch.equal(ckpt.tensor(name), _expected(ckpt.config, name, seed=7)), name
    # chunks draw from their own generators, so only the first chunk matches the unchunked checkpoint
    unchunked = Checkpoint.open(written["tiny_a"])
    assert torch.equal(ckpt.raw("embed.weight")[:3], unchunked.raw("embed.weight")[:3])
    assert not torch.equal(ckpt.raw("embed.weight"), unchunked.raw("embed.weight"))


def test_writer_accepts_modelconfig_and_path(tmp_path):
    cfg = ModelConfig.from_dict(CONFIGS["tiny_b"]())
    assert ModelConfig.from_dict(writer.config_dict(cfg)) == cfg
    assert ModelConfig.from_dict(writer.config_dict(ModelConfig.from_dict(tiny_v4()))) == ModelConfig.from_dict(
        tiny_v4()
    )
    out = writer.write_checkpoint(cfg, tmp_path / "a", tokenizer_dir=TINY / "tiny_b" / "model")
    assert Checkpoint.open(out).config == cfg
    assert (out / "tokenizer.json").read_bytes() == (TINY / "tiny_b" / "model" / "tokenizer.json").read_bytes()
    out = writer.write_checkpoint(TINY / "tiny_b" / "model" / "config.json", tmp_path / "b")
    assert Checkpoint.open(out).verify()["tensors"] == 613


def test_fast_fp4_quant_is_byte_identical_to_formats():
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6])
    edges = torch.cat([grid, grid.nextafter(torch.tensor(9.0)), grid.nextafter(torch.tensor(-9.0)).clamp_min(0)])
    edges = torch.cat([edges, -edges, torch.zeros(96 - 2 * edges.numel())]).reshape(3, 32)
    edges[:, 0] = 6.0  # pins the scale to 1 so the values above are the ones rounded
    cases = [
        torch.randn(64, 256, generator=g),
        torch.randn(8, 64, generator=g) * 1e-30,
        torch.randn(8, 64, generator=g) * 1e30,
        torch.zeros(4, 64),
        edges,
        edges * 2.0**-5,
    ]
    for w in cases:
        a, b = writer.quant_fp4(w), fp4.quant(w)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))


def test_bad_shard_count(tmp_path):
    from dsflash.errors import CheckpointError

    with pytest.raises(CheckpointError, match="shards"):
        writer.write_checkpoint(CONFIGS["tiny_b"](), tmp_path, shards=0)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DSFLASH_SLOW"), reason="set DSFLASH_SLOW=1 (writes ~4 GB in ~20-40 s)")
def test_real_width_checkpoint_streams(tmp_path):
    raw = _json(DATA / "configs" / "deepseek-v4.1-flash.config.json")
    raw.pop("vision_config")
    raw["text_config"].update(
        num_hidden_layers=2, n_routed_experts=8, compress_ratios=[0, 2, 0], kv_source_layer_ids=[1],
        index_source_layer_ids=[1], candidate_source_layer_id=-1, engram_layer_ids=[1], engram_num_embeddings=[4096],
        num_nextn_predict_layers=1, dspark_target_layer_ids=[0, 1], dspark_n_routed_experts=8,
    )  # fmt: skip
    start = time.time()
    out = writer.write_checkpoint(raw, tmp_path, shards=2)
    took = time.time() - start
    peak_mb = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) >> 10
    ckpt = Checkpoint.open(out)
    assert ckpt.verify()["bytes"] == summary(expected_inventory(ckpt.config))["bytes"]
    print(f"real-width write: {took:.1f} s, peak RSS {peak_mb} MB")
    assert took < 60, took
    assert peak_mb < 2048, peak_mb  # the embedding alone is 2.6 GB in fp32
