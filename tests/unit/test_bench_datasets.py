"""The random dataset: vLLM's construction (draw order, id runs, lengths) and exact token counts."""

import math

import numpy as np
import pytest

from dsflash.bench.datasets import PRESETS, TokenCounter, random_requests
from dsflash.errors import ConfigError
from dsflash.text.tokenizer import Tokenizer


class CharTokenizer:
    """One id per character (a bijection), so decoded prompts show the sampled ids exactly; id 0 is BOS."""

    class _Backend:
        def get_vocab_size(self, with_added_tokens=False):
            return 500

    backend = _Backend()
    special_ids = frozenset({0, 1})
    bos_id = 0

    def encode(self, text):
        return [ord(c) - 0x4E00 for c in text]

    def decode(self, ids):
        return "".join(chr(0x4E00 + i) for i in ids)


@pytest.fixture(scope="module")
def deepseek():
    return TokenCounter(Tokenizer.bundled("v41"))


def test_vllm_construction_and_draw_order():
    tok = TokenCounter(CharTokenizer())
    reqs = random_requests(tok, 4, input_len=20, output_len=7, range_ratio=0.25, prefix_len=3, seed=5)
    # the same draws in vLLM's order: input lens, output lens, offsets, then the prefix
    rng = np.random.default_rng(5)
    real = 20 - 1  # the BOS the server adds is part of the requested input length
    lens = rng.integers(math.floor(real * 0.75), math.ceil(real * 1.25) + 1, size=4)
    outs = rng.integers(math.floor(7 * 0.75), math.ceil(7 * 1.25) + 1, size=4)
    offsets = rng.integers(0, 500, size=4)
    allowed = np.arange(2, 500)
    prefix = allowed[rng.integers(0, len(allowed), size=3)].tolist()
    for i, r in enumerate(reqs):
        inner = allowed[(offsets[i] + i + np.arange(lens[i])) % len(allowed)].tolist()
        assert tok.encode(r.prompt) == prefix + inner
        assert r.prompt_len == 3 + lens[i]
        assert r.expected_output_len == outs[i]
        assert r.request_id == str(i)


def test_real_tokenizer_lengths_are_exact(deepseek):
    reqs = random_requests(deepseek, 5, input_len=128, output_len=16, seed=0)
    assert [r.prompt_len for r in reqs] == [127] * 5  # + BOS = 128 on the server
    assert all(len(deepseek.encode(r.prompt)) == 127 for r in reqs)
    assert len({r.prompt for r in reqs}) == 5


def test_seeded(deepseek):
    a = random_requests(deepseek, 2, 64, 8, seed=1)
    b = random_requests(deepseek, 2, 64, 8, seed=1)
    c = random_requests(deepseek, 2, 64, 8, seed=2)
    assert a == b and a != c


def test_too_short_and_bad_ratio(deepseek):
    with pytest.raises(ConfigError, match="too small"):
        random_requests(deepseek, 1, 1, 8)
    with pytest.raises(ConfigError, match="range-ratio"):
        random_requests(deepseek, 1, 64, 8, range_ratio=1.0)


def test_presets_are_the_reference_table():
    assert {k: (p.input_len, p.output_len, p.context) for k, p in PRESETS.items()} == {
        "chat": (128, 256, 9216),
        "codegen": (1024, 1024, 9216),
        "agent": (8192, 512, 9216),
        "long": (32768, 256, 33792),
        "multi-turn": (4096, 64, 9216),  # the first turn; each later one resends it with 64 new tokens
    }
    assert (PRESETS["multi-turn"].turns, PRESETS["multi-turn"].turn_len) == (4, 64)
    assert PRESETS["chat"].scaled(0.1) == (13, 26)
    assert PRESETS["chat"].scaled(0.001) == (1, 2)
