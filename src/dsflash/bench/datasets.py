"""`vllm bench serve`'s random dataset: token-id runs decoded to text, re-encoded and trimmed to the target length.

Same construction as vLLM's RandomDataset (numpy.default_rng(seed) for every draw, in the same order): per request
an input length and an output length from [len*(1-r), len*(1+r)], an offset into the allowed (non-special) ids,
then ids allowed[(offset + i + arange(L)) % |allowed|] after a shared random prefix. The input length excludes the
special tokens the tokenizer adds (BOS), so a server that prepends BOS sees exactly --random-input-len tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dsflash.errors import ConfigError


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens of `prompt` by the client's tokenizer (no special tokens)
    expected_output_len: int
    request_id: str


class TokenCounter:
    """What the dataset needs from a tokenizer (dsflash.text.tokenizer.Tokenizer fits): encode, decode, the
    base vocabulary, the special ids, and how many special tokens a server adds (DeepSeek: BOS)."""

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = tok.backend.get_vocab_size(with_added_tokens=False)
        self.special_ids = sorted(tok.special_ids)
        self.num_special_tokens_to_add = 1 if tok.bos_id is not None else 0

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def random_requests(
    tok: TokenCounter,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    request_id_prefix: str = "",
) -> list[SampleRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ConfigError("--random-range-ratio must be in [0, 1)")
    rng = np.random.default_rng(seed)
    real_input = max(0, int(input_len) - tok.num_special_tokens_to_add)
    lo, hi = math.floor(real_input * (1 - range_ratio)), math.ceil(real_input * (1 + range_ratio))
    if prefix_len + lo < 1:
        raise ConfigError(
            f"--random-input-len {input_len} is too small: after the tokenizer's {tok.num_special_tokens_to_add} "
            "special token(s) no prompt token is left"
        )
    out_lo = max(1, math.floor(output_len * (1 - range_ratio)))
    out_hi = max(1, math.ceil(output_len * (1 + range_ratio)))
    input_lens = rng.integers(lo, hi + 1, size=num_requests)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_requests)
    offsets = rng.integers(0, tok.vocab_size, size=num_requests)
    allowed = np.setdiff1d(np.arange(tok.vocab_size), np.asarray(tok.special_ids, dtype=np.int64))
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len > 0 else []
    out = []
    for i in range(num_requests):
        inner = allowed[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % len(allowed)].tolist()
        prompt, ids = decode_to_length(tok, prefix + inner, prefix_len + int(input_lens[i]), rng)
        out.append(SampleRequest(prompt, len(ids), int(output_lens[i]), f"{request_id_prefix}{i}"))
    return out


def decode_to_length(tok: TokenCounter, ids: list[int], target: int, rng: np.random.Generator, tries: int = 10):
    """Decode, re-encode, and pad (random ids) or trim until the text re-encodes to `target` tokens (vLLM's
    gen_prompt_decode_to_target_len: text -> tokens is not one to one). -> (prompt, its token ids)"""
    while True:
        prompt = tok.decode(ids)
        ids = tok.encode(prompt)
        if tries <= 0 or len(ids) == target:
            return prompt, ids
        if len(ids) < target:
            ids.extend(rng.integers(0, tok.vocab_size, size=target - len(ids)).tolist())
        else:
            ids = ids[:target]
        tries -= 1


@dataclass(frozen=True)
class Preset:
    """One of the reference box's workloads: lengths, and the serving profile whose context holds them."""

    input_len: int
    output_len: int
    profile: str
    context: int
    num_prompts: int = 3  # requests; with turns > 1, conversations
    turns: int = 1  # each later turn resends the conversation (prompt + reply) with turn_len new tokens
    turn_len: int = 0

    def scaled(self, f: float) -> tuple[int, int]:
        """(input, output) lengths times f, at least 1 and 2 tokens (TPOT needs two)."""
        return max(1, round(self.input_len * f)), max(2, round(self.output_len * f))


# seed.md: the reference box's `vllm bench serve` table (one user, random tokens, --ignore-eos)
PRESETS = {
    "chat": Preset(128, 256, "default", 9216),
    "codegen": Preset(1024, 1024, "default", 9216),
    "agent": Preset(8192, 512, "default", 9216),
    "long": Preset(32768, 256, "p300x2-32k", 33792),
    # an agent's loop: the first turn's 4096-token context, then 64 new tokens a turn (what prefix reuse serves)
    "multi-turn": Preset(4096, 64, "default", 9216, num_prompts=2, turns=4, turn_len=64),
}
