"""names.py: the inventory generated from a config alone must equal the released checkpoints and the fixtures."""

import copy
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dsflash.checkpoint.names import SHARD_RULES, TABLE, expected_inventory, summary
from dsflash.config import ModelConfig

DATA = Path(__file__).resolve().parents[1] / "data"
CONFIGS = DATA / "configs"
TINY = DATA / "dsv41_tiny"

V41_TOTALS = {
    "tensors": 96_085,
    "bytes": 510_286_023_000,
    "params": 763_205_315_794,
    "by_dtype": {"BF16": 520, "F32": 387, "F8_E4M3": 357, "F8_E8M0": 47_589, "I8": 47_232},
}
V4_TOTALS = {
    "tensors": 69_187,
    "bytes": 159_609_485_896,
    "params": 290_942_289_362,
    "by_dtype": {"BF16": 433, "F32": 417, "F8_E4M3": 375, "F8_E8M0": 34_167, "I64": 3, "I8": 33_792},
}


def _raw(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def test_v41_flash_totals():
    cfg = ModelConfig.from_dict(_raw("deepseek-v4.1-flash.config.json"))
    assert summary(expected_inventory(cfg)) == V41_TOTALS


def test_v4_flash_totals():
    cfg = ModelConfig.from_dict(_raw("deepseek-v4-flash.config.json"))
    assert summary(expected_inventory(cfg)) == V4_TOTALS


def test_v41_parameter_split():
    # architecture §2.6: 196,613,849,600 Engram table parameters, 485,268,480 vision/aligner/delimiters
    inv = expected_inventory(ModelConfig.from_dict(_raw("deepseek-v4.1-flash.config.json")))
    engram = sum(s.params for s in inv if ".engram.embed." in s.name)
    vision = sum(s.params for s in inv if s.row.shard == "skip_vision")
    dspark = sum(s.params for s in inv if s.name.startswith("mtp."))
    assert (engram, vision, dspark) == (196_613_849_600, 485_268_480, 14_225_362_530)


def test_v4_pro_totals():
    # architecture §2.3: V4-Pro = Flash layout with Pro widths; 145,116 tensors, 864,704,792,696 bytes
    raw = _raw("deepseek-v4-flash.config.json")
    raw.update(
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        q_lora_rank=1536,
        o_groups=16,
        n_routed_experts=384,
        moe_intermediate_size=3072,
        compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0],
    )
    got = summary(expected_inventory(ModelConfig.from_dict(raw)))
    assert (got["tensors"], got["bytes"], got["params"]) == (145_116, 864_704_792_696, 1_598_837_347_742)


def test_v4_dspark_variant_count():
    # V4-Flash-0731 (architecture §1, §3.3): three DSpark stages instead of NextN -> 72,317 tensors
    raw = _raw("deepseek-v4-flash.config.json")
    raw.update(
        num_nextn_predict_layers=3,
        dspark_block_size=5,
        dspark_markov_rank=256,
        dspark_noise_token_id=128799,
        dspark_target_layer_ids=[40, 41, 42],
        compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0, 0, 0],
    )
    inv = expected_inventory(ModelConfig.from_dict(raw))
    names = {s.name for s in inv}
    assert len(inv) == 72_317
    assert {"mtp.0.main_proj.weight", "mtp.2.markov_head.markov_w1.weight", "mtp.2.hc_head_fn"} <= names
    assert "mtp.0.e_proj.weight" not in names


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


@pytest.mark.parametrize("case", ["tiny_a", "tiny_b"])
def test_tiny_fixture_index_and_header_match_inventory(case):
    model = TINY / case / "model"
    want = {(s.name, s.dtype, tuple(s.shape)) for s in expected_inventory(ModelConfig.from_file(model))}
    header = _header(model / "model.safetensors")
    got = {(k, v["dtype"], tuple(v["shape"])) for k, v in header.items()}
    index = json.loads((model / "model.safetensors.index.json").read_text())
    assert got == want
    assert set(index["weight_map"]) == {name for name, _, _ in want}


def test_doc_tiny_configs():
    # architecture §8.1 / §8.2: tiny-V4 942,536 params / 585 tensors, tiny-V4.1 1,258,076 params / 762 tensors
    v4 = _raw("deepseek-v4-flash.config.json")
    v4.update(
        vocab_size=512, hidden_size=64, num_hidden_layers=6, num_hash_layers=2, num_attention_heads=4, head_dim=96,
        qk_rope_head_dim=32, q_lora_rank=32, o_lora_rank=32, o_groups=2, sliding_window=8,
        compress_ratios=[0, 0, 4, 16, 4, 16, 0], index_n_heads=4, index_head_dim=64, index_topk=4,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    )  # fmt: skip
    v4["quantization_config"]["weight_block_size"] = [32, 32]
    got = summary(expected_inventory(ModelConfig.from_dict(v4)))
    assert (got["tensors"], got["params"]) == (585, 942_536)
    v41 = copy.deepcopy(json.loads((TINY / "tiny_a" / "model" / "config.json").read_text()))
    v41["text_config"].update(
        vocab_size=512, hidden_size=64, num_hidden_layers=8, num_nextn_predict_layers=2, num_attention_heads=4,
        head_dim=96, qk_rope_head_dim=32, o_groups=2, sliding_window=8,
        compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1, 0, 0], kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 4, 6],
        candidate_source_layer_id=4, candidate_topk_blocks=2, index_n_heads=4, index_head_dim=64, index_topk=4,
        swiglu_limit=10.0, engram_layer_ids=[1, 3], engram_num_embeddings=[290, 370], engram_max_ngram_size=3,
        engram_n_heads=2, engram_vocab_size=64, engram_compressed_vocab_size=512, dspark_noise_token_id=500,
        dspark_target_layer_ids=[5, 6, 7],
    )  # fmt: skip
    got = summary(expected_inventory(ModelConfig.from_dict(v41)))
    assert (got["tensors"], got["params"]) == (762, 1_258_076)


def test_table_rows_are_well_formed():
    for row in TABLE:
        assert row.shard in SHARD_RULES, row.name
        assert row.fmt in ("bf16", "f32", "i64", "fp8", "fp4", "fp8_rows"), row.name
        if row.fmt in ("fp8", "fp4", "fp8_rows"):
            assert row.name.endswith(".weight"), row.name


@pytest.mark.parametrize("config", ["deepseek-v4.1-flash.config.json", "deepseek-v4-flash.config.json"])
def test_inventory_names_are_unique_and_scales_follow_weights(config):
    inv = expected_inventory(ModelConfig.from_dict(_raw(config)))
    assert len({s.name for s in inv}) == len(inv)
    for i, s in enumerate(inv):
        if s.is_scale:
            assert s.dtype == "F8_E8M0" and s.params == 0
            assert inv[i - 1].name.removesuffix(".weight") == s.name.removesuffix(".scale")


def test_inventory_cli_prints_one_json_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "dsflash", "inventory", str(CONFIGS / "deepseek-v4.1-flash.config.json")],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == V41_TOTALS
    # a directory holding a config.json works too
    (tmp_path / "config.json").write_text((CONFIGS / "deepseek-v4-flash.config.json").read_text())
    out = subprocess.run(
        [sys.executable, "-m", "dsflash", "inventory", str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == V4_TOTALS


def test_inventory_cli_bad_config_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    out = subprocess.run([sys.executable, "-m", "dsflash", "inventory", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 1
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
