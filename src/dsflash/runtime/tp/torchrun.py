"""Whether this process was started by torchrun, and as which rank (environment only: no torch import, so the CLI
can ask before loading anything)."""

from __future__ import annotations

import os


def launched_rank() -> tuple[int, int, int, int] | None:
    """(rank, world size, local rank, local world size) under torchrun (TORCHELASTIC_RUN_ID set), else None."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    env = os.environ
    world = int(env["WORLD_SIZE"])
    return int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", world))


def local_rank(rank: int) -> int:
    """This process's rank among its host's: torchrun's LOCAL_RANK, else the rank (the engine spawns on one host)."""
    return int(os.environ.get("LOCAL_RANK", rank))


def local_world(world: int) -> int:
    """How many ranks run on this host: torchrun's LOCAL_WORLD_SIZE, else all of them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))
