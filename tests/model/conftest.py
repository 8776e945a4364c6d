import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from dsflash.checkpoint.index import Checkpoint
from dsflash.runtime.reference.loader import LoadedModel, load_reference
from dsflash.text.token_map import compressed_token_map
from dsflash.text.tokenizer import Tokenizer

CASES = ["tiny_a", "tiny_b"]
ROOT = Path(__file__).parents[1] / "data" / "dsv41_tiny"


@dataclass
class Case:
    name: str
    dir: Path
    ref: LoadedModel
    tokens: list[int]
    prefill: int
    golden: dict

    def load(self, name: str):
        return np.load(self.dir / name)

    def run(self, tokens: list[int], start_pos: int, state, **kw):
        return self.ref.model(torch.tensor([tokens]), start_pos, state, self.ref.experts, **kw)


def open_case(name: str) -> Case:
    d = ROOT / name
    ckpt = Checkpoint.open(d / "model")
    tok = Tokenizer.from_dir(d / "model", ckpt.config.model_type)
    ref = load_reference(ckpt, compressed_token_map(tok.backend))
    meta = json.loads((d / "tokens.json").read_text())
    golden = json.loads((d / "golden.json").read_text())
    return Case(name, d, ref, meta["ids"], meta["prefill_len"], golden)


@pytest.fixture(scope="session", params=CASES)
def case(request) -> Case:
    return open_case(request.param)
