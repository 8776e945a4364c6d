"""What drawing a token at a temperature costs over DeepSeek's 129k vocabulary: the sampler's numpy draw against
the torch draw it replaced (softmax, a full sort for top_p, torch.multinomial), both in this run, on the same random
logits, per sampling setting. Greedy is the floor (numpy's argmax).

    PYTHONPATH=src python benchmarks/sampler.py [--reps 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import timeit

import torch

from dsflash.runtime.scheduler.sampler import Sampler, SamplingParams

SETTINGS = [
    {"temperature": 0},
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 0.7, "top_k": 50},
    {"temperature": 0.6, "top_p": 0.95, "min_p": 0.05},
    {"temperature": 1.0, "top_p": 0.999},
]


def torch_draw(p: SamplingParams, gen: torch.Generator):
    """The draw as it was (baseline): every filter over the whole vocabulary in torch."""

    def draw(logits: torch.Tensor) -> int:
        x = logits / p.temperature
        if p.top_k > 0:
            x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], -torch.inf)
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0)
        if p.top_p < 1:
            sorted_p, order = probs.sort(descending=True)
            drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p
            drop[0] = False
            probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0))
        return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))

    return draw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    logits = torch.randn(129280, generator=torch.Generator().manual_seed(0)) * 3
    rows = []
    for kw in SETTINGS:
        params = SamplingParams(seed=1, **kw)
        ours = Sampler(params)
        ms = min(timeit.repeat(lambda: ours(logits), number=1, repeat=args.reps)) * 1e3  # noqa: B023
        base = None
        if not params.greedy:
            old = torch_draw(params, torch.Generator().manual_seed(1))
            base = min(timeit.repeat(lambda: old(logits), number=1, repeat=args.reps)) * 1e3  # noqa: B023
        rows.append({"setting": kw, "numpy_ms": round(ms, 3), "torch_ms": base and round(base, 3),
                     "speedup": base and round(base / ms, 1)})  # fmt: skip
        print(
            f"{json.dumps(kw):55s} numpy {ms:7.2f} ms" + (f"  torch {base:7.2f} ms  x{base / ms:5.1f}" if base else "")
        )
    print(f"machine: {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
