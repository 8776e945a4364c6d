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
        description="Score the reference and the engine on the same bundled mixed text: a prefill, then teacher-"
        "forced decode steps. A position is decisive when the reference's top-1 logit margin is >= 0.10; KL is "
        "KL(p_ref || p_engine). Prints one JSON report; exits 1 when a threshold fails.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", help="model directory or Hub repo id[@revision]")
    add_engine_arguments(p, "engine: ")
    p.add_argument("--tokens", type=int, default=suites.DEFAULT_TOKENS, help="tokens scored: 2/3 prefill, 1/3 decode")
    p.add_argument("--qat", action="store_true", help="keep the model's activation fake-quant points on (both sides)")
    p.add_argument("--min-prefill-top1", type=float, default=suites.PREFILL_MIN_TOP1)
    p.add_argument("--max-prefill-kl", type=float, default=suites.PREFILL_MAX_KL)
    p.add_argument("--min-decode-top1", type=float, default=suites.DECODE_MIN_TOP1)
    p.add_argument("--max-decode-kl", type=float, default=suites.DECODE_MAX_KL)
    p.set_defaults(run=run)


def run(args) -> int:
    from dsflash.errors import InvalidRequest
    from dsflash.gates.run import run_gates
    from dsflash.service.files import open_files

    if args.tokens < 3:
        raise InvalidRequest("--tokens must be >= 3")
    spec = gates_spec(args)
    thresholds = suites.Thresholds(args.min_prefill_top1, args.max_prefill_kl, args.min_decode_top1, args.max_decode_kl)
    report = run_gates(open_files(args.model), spec, tokens=args.tokens, thresholds=thresholds)
    print(json.dumps(report))
    return 0 if report["pass"] else 1


def gates_spec(args):
    """The engine the gates score: the flags' spec, with the fake-quant points as --qat says on both sides."""
    return engine_spec(args, qat=args.qat)
