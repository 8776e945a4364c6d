"""`dsflash store build|verify`: the packed expert store (bfp tiles of every routed expert, one file per layer)."""

from __future__ import annotations

import argparse

from dsflash.cli._engine import add_expert_format_argument
from dsflash.paths import CACHE_DEFAULT

FORMATS = ("bfp4_b", "bfp8_b")


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _common(p: argparse.ArgumentParser, build: bool) -> None:
    p.add_argument("model", metavar="MODEL", help="model directory, or Hub repo id org/name[@revision]")
    if build:
        p.add_argument("--tp", type=_positive, default=1, help="tensor-parallel degree; must divide "
                       "moe_intermediate_size (default: %(default)s)")  # fmt: skip
        add_expert_format_argument(p, flag="--format")
    else:
        p.add_argument("--tp", type=_positive, default=None, help="TP degree the store must have (default: as built)")
        p.add_argument("--format", choices=FORMATS, default=None, help="tile format the store must have (default: as "
                       "built)")  # fmt: skip
    p.add_argument("--cache-dir", default=None, help="store root; the store is <root>/<model-name>/weights, or "
                   "weights-tp<N>-<format> beside it for another TP degree or format "
                   f"(default: {CACHE_DEFAULT})")  # fmt: skip


def add_parser(sub) -> None:
    p = sub.add_parser("store", help="build or verify the packed expert store of a model")
    p.set_defaults(run=run)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    b = actions.add_parser(
        "build",
        help="pack every routed expert into bfp tiles, one file per layer (resumes an interrupted build)",
        description="Build the store; finished layers of an interrupted build are kept. A store for another TP "
        "degree or format goes beside the model's first one and replaces nothing; one of another model, revision or "
        "store format version in its place is refused unless --rebuild. Prints one JSON line.",
    )
    _common(b, build=True)
    b.add_argument("--rebuild", action="store_true", help="replace a store built for something else (default: off)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar on stderr (default: off)")
    v = actions.add_parser(
        "verify",
        help="check every record's checksums (and optionally shards against the checkpoint)",
        description="Check the store against the model's identity and every record's crc32 against the manifest; "
        "prints one JSON line, or names the bad records and exits 1.",
    )
    _common(v, build=False)
    v.add_argument("--sample", type=_positive, default=None, help="check only this many random records (default: all)")
    v.add_argument("--decode", type=int, default=0, help="also re-pack this many random rank shards from the "
                   "checkpoint and compare bytes (default: %(default)s)")  # fmt: skip
    v.add_argument("--seed", type=int, default=0, help="seed of the random samples (default: %(default)s)")
    v.add_argument("--progress", action="store_true", help="progress bar on stderr (default: off)")


def run(args) -> int:
    return _build(args) if args.action == "build" else _verify(args)


def _checkpoint(spec: str):
    from dsflash.checkpoint.index import Checkpoint
    from dsflash.checkpoint.source import resolve_model_dir

    return Checkpoint.open(resolve_model_dir(spec))


def _build(args) -> int:
    import json

    from dsflash.runtime.spec import EngineSpec, resolve
    from dsflash.store.build import build_store
    from dsflash.store.layout import store_dir

    ckpt = _checkpoint(args.model)
    ckpt.verify()  # a missing expert tensor should stop us now, not hours in
    # the format serve will look for: the spec's, resolved for this model as serve resolves it
    fmt = resolve(EngineSpec(expert_format=args.expert_format), ckpt.config).expert_format
    m = build_store(ckpt, args.cache_dir, args.tp, fmt, progress=not args.no_progress, rebuild=args.rebuild)

    s = m.stats
    row = {
        "store": str(store_dir(ckpt.path, args.cache_dir, m.tp, m.tile_format)),
        "model_id": m.model_id,
        "revision": m.revision,
        "tp": m.tp,
        "format": m.tile_format,
        "layers": len(m.layers),
        "built": s["built"],
        "kept": s["kept"],
        "bytes": m.total_bytes(),
        "bytes_written": s["bytes_written"],
        "seconds": round(s["seconds"], 3),
        "mb_per_s": round(s["bytes_written"] / max(s["seconds"], 1e-9) / 1e6, 1),
    }
    print(json.dumps(row))
    return 0


def _verify(args) -> int:
    import json

    from dsflash.store.reader import open_store
    from dsflash.store.verify import verify_store

    ckpt = _checkpoint(args.model)
    with open_store(ckpt, args.cache_dir, args.tp, args.format) as store:
        summary = verify_store(
            store, sample=args.sample, seed=args.seed, ckpt=ckpt, decode=args.decode, progress=args.progress
        )
        row = {"store": str(store.directory), "ok": True, "tp": store.tp, "format": store.tile_format, **summary}
    print(json.dumps(row))
    return 0
