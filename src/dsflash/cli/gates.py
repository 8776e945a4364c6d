"""`dsflash gates MODEL`: quality of the engine against DeepSeek's reference; exit 1 below the thresholds."""

from __future__ import annotations

import argparse
import json

from dsflash.cli._engine import add_engine_arguments, engine_spec
from dsflash.gates import suites


def add_parser(sub) -> None:
    p = sub.add_parser(
        "gates",
        help="compare the engine with the CPU reference (decisive top-1, mean KL)",
        description="Score the reference and the engine on the same text (the bundled mixed text unless --text "
        "says otherwise): a prefill, then teacher-forced decode steps. A position is decisive when the "
        "reference's top-1 logit margin is >= 0.10; KL is KL(p_ref || p_engine). Prints one JSON report; exits 1 "
        "when a threshold fails.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", help="model directory, Hub repo id[@revision] or dsflash-demo-v4.1 (the packaged model)")
    add_engine_arguments(p, "engine: ")
    p.add_argument("--tokens", type=int, default=suites.DEFAULT_TOKENS, help="tokens scored: 2/3 prefill, 1/3 decode")
    p.add_argument(
        "--text",
        default="mixed",
        help="what is scored: `mixed` (bundled prose, code, tables), `held-out` (the demo model's generated "
        "conversations from value pools it never trained on) or a UTF-8 text file",
    )
    p.add_argument("--qat", action="store_true", help="keep the model's activation fake-quant points on (both sides)")
    p.add_argument("--min-prefill-top1", type=float, default=suites.PREFILL_MIN_TOP1)
    p.add_argument("--max-prefill-kl", type=float, default=suites.PREFILL_MAX_KL)
    p.add_argument("--min-decode-top1", type=float, default=suites.DECODE_MIN_TOP1)
    p.add_argument("--max-decode-kl", type=float, default=suites.DECODE_MAX_KL)
    p.set_defaults(run=run)


def run(args) -> int:
    from dataclasses import replace

    from dsflash.errors import InvalidRequest
    from dsflash.gates.run import run_gates
    from dsflash.service.catalog import is_packaged
    from dsflash.service.files import open_files

    if args.tokens < 3:
        raise InvalidRequest("--tokens must be >= 3")
    files = open_files(args.model)
    spec = gates_spec(args)
    if is_packaged(files.path):  # as serve does: a release's new demo weights replace the older weights' store
        spec = replace(spec, rebuild_store=True)
    thresholds = suites.Thresholds(args.min_prefill_top1, args.max_prefill_kl, args.min_decode_top1, args.max_decode_kl)
    report = run_gates(files, spec, tokens=args.tokens, thresholds=thresholds, text=gate_text(args))
    print(json.dumps(report))
    return 0 if report["pass"] else 1


def gate_text(args) -> str | None:
    """--text as a string (None: the bundled mixed text)."""
    from pathlib import Path

    from dsflash.errors import InvalidRequest

    if args.text == "mixed":
        return None
    if args.text == "held-out":
        return held_out_text()
    path = Path(args.text)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"--text {args.text}: not a readable UTF-8 file ({type(e).__name__})") from e
    if not text.strip():
        raise InvalidRequest(f"--text {args.text}: the file is empty")
    return text


def held_out_text(n: int = 48, seed: int = 4242) -> str:
    """n finished demo conversations of every family in turn (half in thinking mode), values from the held-out
    pools: text the demo model never trained on (the leading BOS is the gates' own)."""
    from dsflash.train.data import FAMILIES, Generator

    gen = Generator(seed, held_out=True)
    text = "".join(gen.sample(FAMILIES[i % len(FAMILIES)], thinking=i % 2 == 0).full() for i in range(n))
    return text.removeprefix("<｜begin▁of▁sentence｜>")


def gates_spec(args):
    """The engine the gates score: the flags' spec, with the fake-quant points as --qat says on both sides."""
    return engine_spec(args, qat=args.qat)
