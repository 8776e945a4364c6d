"""A second turn with prefix reuse against prefilling its new tokens alone, and against no reuse.

A conversation of P tokens, then a turn that adds N: its TTFT through the engine with the prefix cache (the first
turn's snapshot restored, N tokens prefilled), the floor (the same N tokens prefilled at position P on a state that
is already there: what reuse cannot beat), and the TTFT without reuse (P + N prefilled). The target: reuse within
1.3x (+ 20 ms) of the floor. Models: (a) the embedded model (service/embedded.py), P = 4096; (b) the V4.1-width
checkpoint of benchmarks/engine_decode.py (4 layers x 32 experts), P = 2048 (slow to generate on a small machine).

    .venv/bin/python benchmarks/prefix_reuse.py [--only embedded|real] [--new N] [--repeat R]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import CACHE, generated, real_width_config  # noqa: E402
from dsflash.paths import embedded_dir  # noqa: E402
from dsflash.runtime.prefix.cache import prefix_cache  # noqa: E402
from dsflash.runtime.scheduler.engine import Engine  # noqa: E402
from dsflash.runtime.scheduler.queue import GenerationRequest  # noqa: E402
from dsflash.runtime.scheduler.sampler import SamplingParams  # noqa: E402
from dsflash.runtime.spec import EngineSpec  # noqa: E402
from dsflash.runtime.tp.launch import start_engine  # noqa: E402
from dsflash.service.catalog import EMBEDDED  # noqa: E402
from dsflash.service.embedded import ensure_embedded  # noqa: E402
from dsflash.service.files import open_dir  # noqa: E402


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """(prefill seconds as the engine times it, tokens it restored) of a one-token request."""
    p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    first = next(iter(engine.submit(GenerationRequest(tuple(prompt), p))))
    return first.stats.ttft_s, first.stats.cached_tokens


def measure(model_dir: Path, P: int, N: int, repeat: int) -> dict:
    files = open_dir(model_dir, verify=False)
    spec = EngineSpec(cache_dir=str(CACHE / "stores"))
    runner = start_engine(files.ckpt, files.token_map, P + N + 8, spec)
    try:
        cache = prefix_cache(runner, spec)
        reuse, plain = Engine(runner, {-1}, prefix=cache).start(), None
        rng = random.Random(0)
        vocab = files.ckpt.config.vocab_size
        out = {"reuse": [], "alone": [], "none": [], "snapshot_mb": runner.snapshot_bytes(P) / 1e6}
        for _ in range(repeat):
            conv = [rng.randrange(3, min(vocab, 100_000)) for _ in range(P)]
            new = [rng.randrange(3, min(vocab, 100_000)) for _ in range(N)]
            ttft(reuse, conv)  # the first turn: its prompt-end snapshot is what the second restores
            t, cached = ttft(reuse, conv + new)
            assert cached == P, cached
            out["reuse"].append(t)
            # the floor: the state of the conversation already there, only the N new tokens prefilled
            entry = cache.lookup("", conv + new[:1])
            cache.restore(entry)
            t0 = time.perf_counter()
            runner.forward(new, P, False)
            out["alone"].append(time.perf_counter() - t0)
        reuse.close()
        plain = Engine(runner, {-1}).start()
        for _ in range(max(1, repeat // 2)):
            conv = [rng.randrange(3, min(vocab, 100_000)) for _ in range(P + N)]
            out["none"].append(ttft(plain, conv)[0])
        plain.close()
        return {k: (min(v) if isinstance(v, list) else v) for k, v in out.items()}
    finally:
        runner.close()


def report(name: str, P: int, N: int, m: dict) -> None:
    bound = 1.3 * m["alone"] + 0.020
    print(f"{name}: P = {P}, N = {N}; snapshot of P tokens {m['snapshot_mb']:.1f} MB")
    print(f"  second turn with reuse      {m['reuse'] * 1000:9.1f} ms")
    print(f"  N tokens alone at P         {m['alone'] * 1000:9.1f} ms   (target: reuse <= {bound * 1000:.1f} ms)")
    print(f"  no reuse (P + N prefilled)  {m['none'] * 1000:9.1f} ms   ({m['none'] / m['reuse']:.1f}x reuse)")
    print(f"  reuse / alone = {m['reuse'] / m['alone']:.2f}: {'met' if m['reuse'] <= bound else 'NOT met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["embedded", "real"], default=None)
    ap.add_argument("--new", type=int, default=64, help="N: the second turn's new tokens")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.only in (None, "embedded"):
        emb = ensure_embedded(embedded_dir(None), EMBEDDED)
        report("embedded model", 4096, args.new, measure(emb.path, 4096, args.new, args.repeat))
    if args.only in (None, "real"):
        real = generated("real4x32", real_width_config(4, 32))
        report("V4.1 widths, 4 layers x 32 experts", 2048, args.new, measure(real, 2048, args.new, args.repeat))


if __name__ == "__main__":
    main()
