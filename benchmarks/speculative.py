"""Speculative decoding with the DSpark head (issue 26): decode tokens/s with and without it in one process, the
acceptance, the cost of a verify of K+1 positions against one decode step, and the break-even acceptance.

Part 1, per model with a DSpark head (the demo model, the tiny fixture): two engine runners at TP 1 over the same
checkpoint, one plain and one speculative; the same greedy prompts run plain, with speculation and its guard, with
the guard but without the confidence head's cut, and held on (the guard and the cut bypassed: what a head that does
not pay costs without them). Prompt sets: random ids with EOS ignored (drafts the head cannot guess: the guard's
case) and, on the demo, held-out prompts of its own task families, each answer ending at EOS (the case the head was
trained for), then again with the head made useless (its drafts shifted by one id, its confidence kept: what the
guard alone must bound). Decode tokens/s counts from the first token to the last of each request. Costs: a plain
step, a speculative runner's plain step (which also seeds the head), a draft of K, a verify of K+1 positions with
its accept.

Part 2, at V4.1 widths (engine_decode.py's generated 4-layer checkpoint, no DSpark head): one decode step against
one forward of K+1 positions with every position's logits (the verify), experts resident after a warm-up.

Break-even: drafts accepted per verify a* with (a* + 1) / (t_draft + t_verify) = 1 / t_step.

    .venv/bin/python benchmarks/speculative.py [--tokens N] [--prompts P] [--threads T] [--skip-real]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import CACHE, TINY, generated, real_width_config  # noqa: E402
from dsflash.runtime.scheduler import speculative  # noqa: E402
from dsflash.runtime.scheduler.engine import Engine  # noqa: E402
from dsflash.runtime.scheduler.queue import GenerationRequest  # noqa: E402
from dsflash.runtime.scheduler.sampler import SamplingParams  # noqa: E402
from dsflash.runtime.spec import EngineSpec  # noqa: E402
from dsflash.runtime.tp.launch import start_engine  # noqa: E402
from dsflash.service.catalog import is_packaged  # noqa: E402
from engine_decode import open_model  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "src" / "dsflash" / "data" / "demo-v4.1"


SPECULATIVE = ("guarded", "uncut", "held_on")


class HeldOn(speculative.Costs):
    """The guard bypassed: every step drafts and verifies all K."""

    def judge(self, tokens, seconds):
        return True

    def cut(self, k, confidence):
        return k


class Uncut(speculative.Costs):
    """The guard without the confidence head's cut: every draft verified whole."""

    def cut(self, k, confidence):
        return k


class Useless:
    """A speculative runner whose head is made useless: every drafted token shifted by one id (never the target's
    choice), the confidence head's scores left as they were (so the cut does not see it: the guard must)."""

    def __init__(self, runner, vocab: int):
        self.runner, self.vocab = runner, vocab

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def draft(self, token, pos, k, sampling):
        out = self.runner.draft(token, pos, k, sampling)
        return None if out is None else ([(t + 1) % self.vocab for t in out[0]], *out[1:])


def decode_time(engine, prompt: list[int], tokens: int, ignore_eos: bool) -> tuple[int, float]:
    """(decode tokens, seconds) of one greedy request: first token to last."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=ignore_eos)
    handle = engine.submit(GenerationRequest(tuple(prompt), params))
    times = [time.perf_counter() for e in handle if e.token is not None]
    return len(times) - 1, times[-1] - times[0]


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def costs(plain, spec, prompt: list[int], k: int, reps: int) -> dict:
    """Seconds of a plain step, a seeding step, a draft of k and a verify of k + 1 (+ accept of one)."""
    out = {}
    for name, runner in (("step", plain), ("seeded_step", spec)):
        runner.reset()
        runner.forward(prompt, 0, False)
        pos = [len(prompt)]

        def step(runner=runner, pos=pos):
            runner.forward([5], pos[0], False)
            pos[0] += 1

        out[name] = timed(step, reps)
    pos = [pos[0]]

    def draft(pos=pos):
        spec.draft(5, pos[0], k, (0.0, 0, 1.0, 0.0, 0, -1))

    def verify(pos=pos):
        spec.verify([5] * (k + 1), pos[0])
        spec.accept(1)
        pos[0] += 1

    out["draft"], out["verify"] = timed(draft, reps), timed(verify, reps)
    out["break_even_accepted"] = (out["draft"] + out["verify"]) / out["step"] - 1
    return out


def family_prompts(model_dir: Path, n: int) -> list[list[int]]:
    """Held-out prompts of the demo's task families, in turn, half in thinking mode (what the head was trained on)."""
    from dsflash.text.tokenizer import Tokenizer
    from dsflash.train.data import FAMILIES, Generator

    tok, gen = Tokenizer.from_dir(model_dir), Generator(2026, held_out=True)
    return [tok.encode(gen.sample(FAMILIES[i % len(FAMILIES)], thinking=i % 2 == 0).prompt()) for i in range(n)]


def compare(plain, spec, prompts: list[list[int]], tokens: int, eos: int | None) -> dict:
    """Decode tokens/s plain, speculative with the guard (and the confidence cut), with the guard but no cut, and
    held on, over the same greedy prompts (interleaved: a shared machine's load drifts alike over all of them); eos
    None: EOS ignored."""
    engines = {"plain": Engine(plain, eos_ids={eos} - {None})}
    for label in SPECULATIVE:
        engines[label] = Engine(spec, eos_ids={eos} - {None}, num_speculative_tokens=0)
    engines["uncut"].costs = Uncut()
    engines["held_on"].costs = HeldOn()
    rates, row = {label: [0, 0.0] for label in engines}, {}
    for e in engines.values():
        e.start()
    for p in prompts:
        for label, e in engines.items():
            n, seconds = decode_time(e, p, tokens, ignore_eos=eos is None)
            rates[label][0] += n
            rates[label][1] += seconds
    row["decode_tokens"] = rates["plain"][0]
    for label, (n, seconds) in rates.items():
        row[f"{label}_tok_s"] = n / seconds
    for label in SPECULATIVE:
        s = engines[label].speculative_stats()
        row[f"{label}_vs_plain"] = row[f"{label}_tok_s"] / row["plain_tok_s"]
        row[f"{label}_verifies"] = s["spec_verifies"]
        row[f"{label}_mean_accepted"] = s["spec_mean_accepted"]
        row[f"{label}_guard_off_steps"] = s["spec_guard_off_steps"]
        row[f"{label}_cut_drafts"] = s["spec_cut_tokens"]
    for e in engines.values():
        e.close()
    return row


def with_head(name: str, model_dir: Path, args, families: bool) -> None:
    """Random-id prompts (EOS ignored: what a head that cannot guess costs) and, with `families`, the demo's own
    task families (EOS ends each answer)."""
    ckpt, token_map = open_model(model_dir, args.threads)
    cfg = ckpt.config
    rng = np.random.default_rng(0)
    sets = {"random ids": [[int(t) for t in rng.integers(3, cfg.vocab_size - 1, 24)] for _ in range(args.prompts)]}
    if families:
        sets["task families"] = family_prompts(model_dir, args.prompts)
    # the packaged demo's store is replaced when a release changed its weights, as serve and gates replace it
    common = dict(
        threads=args.threads,
        cache_dir=str(CACHE / "stores"),
        prefix_cache=False,
        expert_format="bfp8_b",
        rebuild_store=is_packaged(model_dir),
    )
    max_len = max(len(p) for ps in sets.values() for p in ps) + args.tokens + 8
    plain_runner = start_engine(ckpt, token_map, max_len, EngineSpec(**common))
    spec_runner = start_engine(ckpt, token_map, max_len, EngineSpec(speculative="dspark", **common))
    k = cfg.dspark_block_size
    try:
        row = {"model": name, "k": k, "threads": args.threads}
        row.update(costs(plain_runner, spec_runner, sets["random ids"][0], k, args.reps))
        print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        for label, prompts in sets.items():
            eos = cfg.eos_token_id if label == "task families" else None
            row = {"model": name, "prompts": label, **compare(plain_runner, spec_runner, prompts, args.tokens, eos)}
            print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if families:  # the same prompts with a head made useless: its drafts shifted, its confidence kept
            useless = Useless(spec_runner, cfg.vocab_size)
            got = compare(plain_runner, useless, sets["task families"], args.tokens, cfg.eos_token_id)
            row = {"model": name, "prompts": "task families, useless head", **got}
            print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    finally:
        plain_runner.close()
        spec_runner.close()


def real_widths(args) -> None:
    """A decode step against a forward of K+1 positions (all logits) at V4.1 widths, experts resident."""
    model_dir = generated("real4x32", real_width_config(4, 32))
    ckpt, token_map = open_model(model_dir, args.threads)
    spec = EngineSpec(expert_slots=128, expert_format="bfp4_b", cache_dir=str(CACHE / "stores"),
                      threads=args.threads, prefix_cache=False)  # fmt: skip
    runner = start_engine(ckpt, token_map, 512, spec)
    rng = np.random.default_rng(0)
    try:
        prompt = [int(t) for t in rng.integers(3, 100000, 16)]
        runner.forward(prompt, 0, False)
        pos = [len(prompt)]
        for _ in range(8):  # every expert the random tokens route to made resident
            runner.forward([int(t) for t in rng.integers(3, 100000, 6)], pos[0], True)
            pos[0] += 6
        one = timed(lambda: (runner.forward([7], pos[0], False), pos.__setitem__(0, pos[0] + 1)), args.reps)
        row = {"model": "V4.1 widths, 4 layers x 32 experts", "threads": args.threads, "step_s": one}
        for k in (1, 2, 3, 5):
            ids = [int(t) for t in rng.integers(3, 100000, k + 1)]
            t = timed(lambda ids=ids: (runner.forward(ids, pos[0], True), pos.__setitem__(0, pos[0] + len(ids))), 3)
            row[f"verify_{k + 1}_vs_step"] = t / one
            row[f"break_even_accepted_k{k}"] = t / one - 1  # the draft's cost not included
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    finally:
        runner.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per prompt")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10, help="repetitions of each timed call")
    ap.add_argument("--threads", type=int, default=1 if os.cpu_count() <= 2 else os.cpu_count())
    ap.add_argument("--skip-real", action="store_true", help="skip the V4.1-width part (a 5.7 GB checkpoint)")
    args = ap.parse_args()
    with_head("demo-v4.1", DEMO, args, families=True)
    with_head("tiny_a", TINY, args, families=False)
    if not args.skip_real:
        real_widths(args)


if __name__ == "__main__":
    main()
