"""`dsflash simulate`: the trace-driven performance model of an expert-streaming box (docs/simulator.md): the
calibration table against the reference QuietBox 2, and what each lever (cache policy, overlap, prefetch,
expert-major prefill, page cache, cold reads, concurrent streams, speculative decoding) buys."""

from __future__ import annotations


def add_parser(sub) -> None:
    from dsflash.cli._terminal import HelpFormatter

    p = sub.add_parser(
        "simulate",
        help="model TTFT and decode tok/s of the reference box under cache policies and other levers",
        description="Drive routing traces (synthetic, with a stated locality, or recorded with `dsflash serve "
        "--record-routing`) through a model of the QuietBox 2 (4 chips, PCIe links, 4500 expert slots, host page "
        "cache, NVMe) and print the calibration table against the box's measured rows and the what-if table.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--workload", action="append", choices=["chat", "codegen", "agent", "long"], default=None,
                   help="workloads to run (repeatable; default: all four)")  # fmt: skip
    p.add_argument("--table", choices=["calibration", "what-if", "both"], default="both", help="what to print")
    p.add_argument("--prompts", type=int, default=2, help="timed requests per workload (after one untimed)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply workload lengths (quick looks; not calibrated)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="replay a `dsflash serve --record-routing` file instead of synthetic traces")  # fmt: skip
    p.add_argument("--slots", type=int, default=None, help="device expert slots (default: the box's 4500)")
    p.add_argument("--zipf", type=float, default=None, help="synthetic locality: Zipf exponent (default: fitted)")
    p.add_argument("--request-sigma", type=float, default=None,
                   help="synthetic locality: per-request log-normal skew (default: fitted)")  # fmt: skip
    p.add_argument(
        "--reuse",
        type=float,
        default=None,
        help="synthetic locality: chance a token reuses the previous token's experts (default: 0.2)",
    )
    p.add_argument("--streams", default="1,2,4,8", metavar="B[,B...]",
                   help="sequences decoding at once in the what-if's concurrency rows (the union of their experts "
                   "per layer read once per step)")  # fmt: skip
    p.add_argument("--speculate", default="5:1.2,5:2,5:3", metavar="K:A[,K:A...]",
                   help="the what-if's speculation rows: K drafts a verify, A of them kept on average (a stated "
                   "acceptance; the reference box measured 1.2)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic traces")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    import json
    import sys
    from dataclasses import asdict, replace

    from dsflash.errors import ConfigError
    from dsflash.sim.box import REFERENCE, REFERENCE_LOCALITY, WORKLOADS
    from dsflash.sim.run import Simulator
    from dsflash.sim.traces import load_recorded
    from dsflash.sim.whatif import (
        calibration,
        calibration_markdown,
        concurrency,
        concurrency_markdown,
        speculation,
        speculation_markdown,
        what_if,
        what_if_markdown,
    )

    if args.prompts < 1 or args.scale <= 0:
        raise ConfigError("--prompts must be >= 1 and --scale > 0")
    streams = _streams(args.streams)
    speculate = _speculate(args.speculate)
    loc = REFERENCE_LOCALITY
    for name in ("zipf", "request_sigma", "reuse"):
        if getattr(args, name) is not None:
            loc = replace(loc, **{name: getattr(args, name)})
    loc = replace(loc, seed=args.seed)
    box = REFERENCE if args.slots is None else REFERENCE.with_(slots=args.slots)

    def progress(msg):
        print(f"  {msg}", file=sys.stderr, flush=True)

    out = {"box": asdict(box), "locality": asdict(loc)}
    if args.trace:
        reqs, header = load_recorded(args.trace)
        sim = Simulator(box, loc, recorded=reqs, header=header)
        print(f"recorded trace {args.trace}: {len(reqs)} requests, {len(header['layers'])} MoE layers x "
              f"{header['experts']} experts, top {header['top_k']}", file=sys.stderr)  # fmt: skip
        table = what_if(sim, [None], progress=progress)
        print(_recorded_markdown(table))
        out["what_if"] = [{"lever": lv.name, **asdict(r)} for lv, rs in table for r in rs]
    else:
        names = args.workload or list(WORKLOADS)
        wls = [WORKLOADS[n].scaled(args.scale) if args.scale != 1.0 else WORKLOADS[n] for n in names]
        sim = Simulator(box, loc, prompts=args.prompts)
        if args.table in ("calibration", "both"):
            rows = calibration(sim, wls, progress)
            print("## calibration against the reference box\n")
            print(calibration_markdown(rows) if args.scale == 1.0 else "(scaled workloads: no measured rows)")
            out["calibration"] = [asdict(r) | {"decode_tok_s": r.decode_tok_s} for r in rows]
        if args.table in ("what-if", "both"):
            table = what_if(sim, wls, progress=progress)
            print("\n## what-if (factor against the reference box; > 1 is faster)\n")
            print(what_if_markdown(table))
            out["what_if"] = [{"lever": lv.name, **asdict(r), "decode_tok_s": r.decode_tok_s}
                              for lv, rs in table for r in rs]  # fmt: skip
            rows = concurrency(sim, wls, streams, progress=progress)
            print("\n## what-if: concurrent streams (reference box; factor against one stream)\n")
            print(concurrency_markdown(rows))
            out["concurrency"] = [asdict(r) | {"aggregate_tok_s": r.aggregate_tok_s,
                                               "per_stream_tok_s": r.per_stream_tok_s} for r in rows]  # fmt: skip
            spec = speculation(sim, wls, speculate, progress=progress)
            print("\n## what-if: speculative decoding (reference box, one sequence; stated acceptance)\n")
            print(speculation_markdown(spec))
            out["speculation"] = [asdict(r) | {"decode_tok_s": r.decode_tok_s, "plain_decode_tok_s": p.decode_tok_s}
                                  for p, rs in spec for r in rs]  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _streams(text: str) -> tuple[int, ...]:
    from dsflash.errors import ConfigError

    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise ConfigError(f"--streams takes positive integers separated by commas (1,2,4,8); got {text!r}")
    return out


def _speculate(text: str) -> tuple[tuple[int, float], ...]:
    from dsflash.errors import ConfigError

    def pair(part: str) -> tuple[int, float] | None:
        k, _, a = part.partition(":")
        try:
            k, a = int(k), float(a)
        except ValueError:
            return None
        return (k, a) if k >= 1 and 0 <= a <= k else None

    out = [pair(part) for part in text.split(",")]
    if not out or None in out:
        raise ConfigError(f"--speculate takes K:A pairs (drafts, 0 <= accepted <= drafts) separated by commas "
                          f"(5:1.2,5:2); got {text!r}")  # fmt: skip
    return tuple(out)


def _recorded_markdown(table) -> str:
    lines = ["| lever | mean TTFT | decode tok/s | decode slot hits | cold reads |", "|---|---|---|---|---|"]
    for lever, (r,) in table:
        lines.append(f"| {lever.name} | {r.ttft:.2f} s | {r.decode_tok_s:.2f} | {r.decode_hit:.1%} | "
                     f"{r.cold_share:.1%} |")  # fmt: skip
    return "\n".join(lines)
