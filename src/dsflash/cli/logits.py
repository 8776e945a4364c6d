"""`dsflash logits MODEL --tokens FILE --out OUT.npz`: teacher-forced logits in the golden-file format."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dsflash.cli._engine import add_engine_arguments, engine_spec
from dsflash.errors import InvalidRequest


def add_parser(sub) -> None:
    p = sub.add_parser(
        "logits",
        help="write prefill and teacher-forced decode logits of a token file",
        description="Write prefill_logits [T, V] (one forward over all T tokens) and decode_logits [T-P, V] "
        "(prefill P tokens, then one decode step per remaining token) as float32 arrays in an .npz.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", help="model directory, Hub repo id[@revision] or dsflash-demo-v4.1 (the packaged model)")
    p.add_argument("--tokens", required=True, type=Path, help='JSON file {"tokens": [...], "prefill": P}')
    p.add_argument("--out", required=True, type=Path, help="output .npz")
    p.add_argument("--backend", choices=["reference", "engine"], default="reference", help="what computes the logits")
    p.add_argument("--no-qat", action="store_true", help="turn off the model's fake-quant points")
    add_engine_arguments(p, "engine: ")
    p.set_defaults(run=run)


def read_tokens(path: Path) -> tuple[list[int], int]:
    """{"tokens": [...], "prefill": P} (or the fixtures' {"ids": [...], "prefill_len": P})."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidRequest(f"no such token file: {path}") from None
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise InvalidRequest(f'{path}: expected an object {{"tokens": [...], "prefill": P}}')
    tokens = raw.get("tokens", raw.get("ids"))
    prefill = raw.get("prefill", raw.get("prefill_len"))
    if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
        raise InvalidRequest(f"{path}: 'tokens' must be a non-empty list of integers")
    if type(prefill) is not int or not 1 <= prefill <= len(tokens):
        raise InvalidRequest(f"{path}: 'prefill' must be an integer in 1..{len(tokens)}, got {prefill!r}")
    return tokens, prefill


def run(args) -> int:
    import numpy as np

    from dsflash.runtime.reference.scoring import decode_logits, prefill_logits

    tokens, prefill = read_tokens(args.tokens)
    spec = logits_spec(args)  # bad engine flags fail before anything loads
    forward, close = _backend(args, spec, len(tokens))
    try:
        out = {"prefill_logits": prefill_logits(forward, tokens),
               "decode_logits": decode_logits(forward, tokens, prefill)}  # fmt: skip
    finally:
        close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, **out)
    print(
        json.dumps(
            {
                "out": str(args.out),
                "tokens": len(tokens),
                "prefill": prefill,
                "backend": args.backend,
                "vocab": int(out["prefill_logits"].shape[1]),
            }
        )
    )
    return 0


def logits_spec(args):
    """The engine `--backend engine` runs (the reference takes its qat alone)."""
    return engine_spec(args, qat=not args.no_qat)


def _backend(args, spec, max_len: int):
    """(Forward, close) for the chosen backend."""
    from dsflash.gates.reference import reference_forward, runner_forward
    from dsflash.service.files import open_files

    files = open_files(args.model)
    if args.backend == "reference":
        from dsflash.runtime.reference.loader import load_reference

        ref = load_reference(files.ckpt, files.token_map, qat=spec.qat, dspark=False)
        return reference_forward(ref, max_len), lambda: None
    from dsflash.runtime.tp.launch import start_engine

    runner = start_engine(files.ckpt, files.token_map, max_len, spec)
    return runner_forward(runner), runner.close
