"""The embedded default model: deterministic files, sized from the real V4.1 tokenizer, reused while unchanged."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from dsflash.checkpoint.index import Checkpoint
from dsflash.service.catalog import DEMO, EMBEDDED, choose, packaged_dir
from dsflash.service.embedded import ensure_embedded
from dsflash.text.token_map import compressed_token_map
from dsflash.text.tokenizer import Tokenizer


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_generated_twice_is_byte_identical_and_reused(tmp_path):
    a = ensure_embedded(tmp_path / "a", EMBEDDED)
    b = ensure_embedded(tmp_path / "b", EMBEDDED)
    assert a.generated and b.generated and _digest(a.path) == _digest(b.path)
    again = ensure_embedded(tmp_path / "a", EMBEDDED)
    assert not again.generated and again.path == a.path
    ckpt = Checkpoint.open(a.path)
    ckpt.verify()
    tok = Tokenizer.from_dir(a.path, ckpt.config.model_type)
    cfg = ckpt.config
    assert cfg.vocab_size == tok.vocab_size == 129281 and tok.token_to_id("<｜System｜>") == 129280
    assert cfg.engram_compressed_vocab_size == max(compressed_token_map(tok.backend)) + 1 == 99093
    kinds = {(s.ratio, s.is_kv_source, s.is_index_source, s.uses_candidates, s.has_engram) for s in cfg.layers()}
    assert len(kinds) >= 6 and cfg.has_dspark  # SWA, ratio-2 source/consumer, ratio-1 source/users, Engram
    stamp = json.loads((a.path / "dsflash-embedded.json").read_text())
    assert stamp["recipe"] and stamp["seed"] == 41


def test_model_names_resolve():
    assert choose(None) == choose(DEMO)  # `make serve` answers with the trained model
    tiny = choose(EMBEDDED)
    assert tiny.embedded and tiny.profile.context == 9216 and "default" not in tiny.aliases
    demo = choose(DEMO)
    assert demo.model_id == DEMO and not demo.embedded and demo.profile.context == 9216 and "default" in demo.aliases
    assert (Path(demo.source) / "config.json").is_file()  # shipped in the package, nothing to generate
    c = choose("rothgar/deepseek-v4.1-flash-p300x2", "p300x2-32k")
    assert (c.source, c.profile.context) == ("deepseek-ai/DeepSeek-V4.1-Flash@2cba9e42", 33792)
    assert choose("org/name@abc").source == "org/name@abc" and choose("org/name@abc").model_id == "org/name"


def test_our_models_are_known_by_their_files_not_by_how_they_are_named(tmp_path):
    # ours: a release changes their files, so serve rebuilds their store instead of refusing it (as gates do)
    assert choose(EMBEDDED).ours and choose(DEMO).ours
    assert choose(str(packaged_dir("demo-v4.1"))).ours  # the packaged directory, served by its path
    copy = tmp_path / "demo-copy"
    shutil.copytree(packaged_dir("demo-v4.1"), copy)
    assert not choose(str(copy)).ours  # a user's copy is theirs: a stale store is refused, as for any model
    assert not choose("rothgar/deepseek-v4.1-flash-p300x2").ours and not choose("org/name@abc").ours
