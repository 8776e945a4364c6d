"""`dsflash inventory CONFIG_OR_DIR`: the tensor inventory a config implies, as one JSON line."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser(
        "inventory",
        help="tensors, bytes, parameters and dtype counts of the official checkpoint of a config",
        description="Print {tensors, bytes, params, by_dtype} of the checkpoint a config.json implies (one JSON "
        "line; computed from the config alone, nothing is read but the config).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("config", metavar="CONFIG_OR_DIR", help="a config.json, or a directory holding one")
    p.set_defaults(run=run)


def run(args) -> int:
    import json

    from dsflash.checkpoint.names import expected_inventory, summary
    from dsflash.config import ModelConfig

    cfg = ModelConfig.from_file(args.config)
    print(json.dumps(summary(expected_inventory(cfg))))
    return 0
