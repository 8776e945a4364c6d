"""The flags every engine-running command shares: --device (with --enforce-eager), --expert-format and --rebuild."""

from __future__ import annotations

import argparse


def add_device_argument(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help=f"{prefix}where the engine computes: cuda (TP rank r on GPU r %% count), cpu, or auto (cuda where torch "
        "sees a GPU)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help=f"{prefix}on a GPU, run the decode step eagerly instead of replaying it as CUDA graphs captured at start "
        "(slower; for debugging, or where a capture fails)",
    )


def add_expert_format_argument(p: argparse.ArgumentParser, prefix: str = "", flag: str = "--expert-format") -> None:
    p.add_argument(
        flag,
        dest="expert_format",
        choices=["auto", "bfp4_b", "bfp8_b"],
        default="auto",
        help=f"{prefix}tile format of the routed experts: bfp8_b holds FP4 experts exactly at twice the bytes, "
        "bfp4_b is lossy; auto takes bfp8_b where the whole store fits in a quarter of this host's memory, else bfp4_b",
    )


def add_rebuild_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rebuild",
        action="store_true",
        help="replace the expert store for this TP degree and tile format where it was built from another revision "
        "of the model or by another store version (without it such a store is refused: rebuilding V4.1-Flash's takes "
        "tens of minutes). A store for another TP degree or format is never touched: each has its own",
    )
