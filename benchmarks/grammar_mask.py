"""What structured output costs per token: the sampler's step with and without a grammar, in the same run, on
random logits over DeepSeek's 129k vocabulary (the model is not in the measurement: only what the mask adds).

Per sampled token, constrained: llguidance's mask (fill_next_token_bitmask), the mask applied to the logits
(sampler._mask), the matcher's advance; unconstrained: the plain step. Greedy: the draw at a temperature (softmax +
torch.multinomial over 129k) is a cost of its own that the mask does not change, and on a loaded host its OpenMP
team made it so noisy (50-90 ms a token) that it hid what is measured here.

    PYTHONPATH=src python benchmarks/grammar_mask.py [--sequences 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dsflash.runtime.scheduler.sampler import Sampler, SamplingParams, _mask
from dsflash.text.grammar import GrammarCache
from dsflash.text.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]


def _run(tok: Tokenizer, grammar, temperature: float, sequences: int, pool: torch.Tensor) -> dict:
    """Sample `sequences` sequences (to EOS, or 200 tokens) -> median microseconds a token of the whole step."""
    steps, k = [], 0
    for seed in range(sequences):
        s = Sampler(SamplingParams(temperature=temperature, seed=seed, max_tokens=200, constraint=grammar))
        for _ in range(200):
            logits = pool[k % len(pool)]
            k += 1
            t = time.perf_counter()
            token = s(logits).token
            steps.append((time.perf_counter() - t) * 1e6)
            if token in tok.eos_ids:
                break
    return {"step": statistics.median(steps), "tokens": len(steps)}


def _parts(tok: Tokenizer, grammar, sequences: int, pool: torch.Tensor) -> dict:
    """The constrained step's two parts, greedy: llguidance's mask, and the mask applied to the logits."""
    mask, apply, k = [], [], 0
    for _ in range(sequences):
        state = grammar()
        for _ in range(200):
            logits = pool[k % len(pool)]
            k += 1
            t = time.perf_counter()
            allowed = state.allowed()
            t1 = time.perf_counter()
            masked = _mask(logits, allowed)
            mask.append((t1 - t) * 1e6)
            apply.append((time.perf_counter() - t1) * 1e6)
            token = int(masked.argmax())
            if token in tok.eos_ids:
                break
            state.advance(token)
    return {"mask": statistics.median(mask), "apply": statistics.median(apply)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=30)
    ap.add_argument("--json", help="write the numbers here too")
    args = ap.parse_args()
    tok = Tokenizer.bundled("v41")
    cache = GrammarCache(tok)
    t = time.perf_counter()
    schema = cache.json_schema(SCHEMA)
    t_first = time.perf_counter() - t  # includes llguidance's tokenizer trie, built once a process
    t = time.perf_counter()
    tool = cache.tool_call(TOOL, "get_weather", False, "v41")
    t_tool = time.perf_counter() - t
    pool = torch.randn(97, tok.vocab_size, generator=torch.Generator().manual_seed(0)) * 3
    out = {"vocab": tok.vocab_size, "compile_first_s": t_first, "compile_tool_s": t_tool, "torch_threads":
           torch.get_num_threads()}  # fmt: skip
    for temp in (0.0,):
        plain = _run(tok, None, temp, args.sequences, pool)
        for name, g in (("json_schema", schema), ("tool_call", tool)):
            c = _run(tok, g, temp, args.sequences, pool) | _parts(tok, g, args.sequences, pool)
            key = f"{name}@T{temp:g}"
            out[key] = {"constrained_us": c["step"], "unconstrained_us": plain["step"],
                        "overhead_us": c["step"] - plain["step"], "mask_us": c["mask"], "apply_us": c["apply"],
                        "tokens": c["tokens"]}  # fmt: skip
            print(f"{key:18s} step {c['step']:7.0f} us vs {plain['step']:6.0f} us unconstrained: "
                  f"+{c['step'] - plain['step']:5.0f} us/token (mask {c['mask']:4.0f}, apply {c['apply']:4.0f}; "
                  f"{c['tokens']} tokens)")  # fmt: skip
    print(f"compile: first schema {t_first:.2f} s (tokenizer trie included), a tool call {t_tool * 1e3:.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
