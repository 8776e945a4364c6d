"""The --device flag every engine-running command shares."""

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
