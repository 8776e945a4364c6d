"""The model is the architecture, not the fixtures: other schedules and options load, run, and decode == prefill."""

import copy
import json
import logging

import numpy as np
import pytest
import torch

from dsflash.checkpoint.index import Checkpoint
from dsflash.checkpoint.writer import write_checkpoint
from dsflash.errors import UnsupportedInput
from dsflash.gates.compare import compare_logits
from dsflash.runtime.reference.loader import load_reference
from tests.model.conftest import ROOT

BASE = json.loads((ROOT / "tiny_b" / "model" / "config.json").read_text())


def _variant(**text) -> dict:
    raw = copy.deepcopy(BASE)
    raw["text_config"].update(text)
    return raw


VARIANTS = {
    # no candidate pre-filter, no DSpark, one routed expert per token (no weight normalisation)
    "plain": _variant(candidate_source_layer_id=-1, candidate_topk_blocks=0, candidate_block_size=0,
                      num_nextn_predict_layers=0, dspark_block_size=0, dspark_target_layer_ids=[],
                      num_experts_per_tok=1, compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1]),
    # no Engram, softmax router, ratio-1 only, a wider window than the sequence
    "ratio1": _variant(engram_layer_ids=[], engram_num_embeddings=[], scoring_func="softmax", sliding_window=64,
                       compress_ratios=[0, 1, 1, 1, 1, 1, 1, 1, 0], kv_source_layer_ids=[1],
                       index_source_layer_ids=[1, 4], candidate_source_layer_id=1),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "model"
    write_checkpoint(VARIANTS[request.param], out, seed=7, tokenizer_dir=ROOT / "tiny_b" / "model")
    from dsflash.text.token_map import compressed_token_map
    from dsflash.text.tokenizer import Tokenizer

    ckpt = Checkpoint.open(out)
    ckpt.verify()
    tm = compressed_token_map(Tokenizer.from_dir(out, ckpt.config.model_type).backend)
    return load_reference(ckpt, tm if ckpt.config.engram_layer_ids else None)


def test_decode_equals_prefill(variant):
    ids = list(np.random.default_rng(1).integers(3, 1000, 70))
    model, experts = variant.model, variant.experts
    state = model.new_state(len(ids))
    full = model(torch.tensor([ids]), 0, state, experts)[0].numpy()
    state.reset()
    first = model(torch.tensor([ids[:23]]), 0, state, experts)[0].numpy()
    rows = [model(torch.tensor([[t]]), p, state, experts)[0, -1].numpy() for p, t in enumerate(ids) if p >= 23]
    report = compare_logits(full, np.concatenate([first, np.stack(rows)]))
    assert report["mean_abs"] < 1e-4 and report["decisive_top1"] == 1.0, report


def test_vision_config_is_accepted_and_images_refused(tmp_path, caplog):
    raw = copy.deepcopy(BASE)
    raw["image_token_id"] = 1000
    raw["vision_config"] = {"model_type": "deepseek_v41_vision", "num_hidden_layers": 1, "hidden_size": 32,
                            "num_attention_heads": 2, "intermediate_size": 64, "patch_size": 14,
                            "downsample_ratio": 3, "max_image_tokens": 16}  # fmt: skip
    out = tmp_path / "model"
    write_checkpoint(raw, out, seed=2, tokenizer_dir=ROOT / "tiny_b" / "model")
    ckpt = Checkpoint.open(out)
    ckpt.verify()
    assert ckpt.vision_names()
    from dsflash.text.token_map import compressed_token_map
    from dsflash.text.tokenizer import Tokenizer

    tm = compressed_token_map(Tokenizer.from_dir(out, ckpt.config.model_type).backend)
    with caplog.at_level(logging.WARNING):
        ref = load_reference(ckpt, tm)
    assert sum("vision" in r.message for r in caplog.records) == 1
    state = ref.model.new_state(8)
    ref.model(torch.tensor([[5, 6]]), 0, state, ref.experts)
    with pytest.raises(UnsupportedInput, match="image tokens"):
        ref.model(torch.tensor([[5, 1000]]), 0, state, ref.experts)
