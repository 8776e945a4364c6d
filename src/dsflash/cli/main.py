"""`dsflash`: subcommand dispatch. Every other module in this package is one subcommand with
add_parser(sub) and run(args) -> int; they import their heavy dependencies inside run()."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import dsflash.cli as cli_pkg
from dsflash import __version__
from dsflash.errors import DsflashError


def subcommand_modules() -> list[str]:
    names = [m.name for m in pkgutil.iter_modules(cli_pkg.__path__) if not m.name.startswith("_")]
    return sorted(n for n in names if n not in ("main", "common"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsflash",
        description="Serve DeepSeek-V4.1-Flash on accelerators far smaller than the model.",
    )
    parser.add_argument("--version", action="version", version=f"dsflash {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in subcommand_modules():
        importlib.import_module(f"dsflash.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from dsflash.runtime.tp.torchrun import launched_rank

    launched = launched_rank()
    if launched is not None and launched[0] != 0:  # torchrun's other ranks follow rank 0's engine, whatever the command
        from dsflash.runtime.tp.workers import torchrun_follower

        return torchrun_follower()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except DsflashError as e:
        print(f"dsflash {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
