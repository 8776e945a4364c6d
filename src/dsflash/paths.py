"""Every directory dsflash reads or writes on disk, computed in this one place (read from the environment at call
time, so that a test or a wrapper that sets a variable is honoured by every command alike).

The cache (generated models, expert stores, built kernels) is `--cache-dir`, else `$DSFLASH_CACHE`, else
`$XDG_CACHE_HOME/dsflash`, else `~/.cache/dsflash`. The state of running servers (their records and logs) is
`$DSFLASH_STATE`, else `$XDG_STATE_HOME/dsflash`, else `~/.local/state/dsflash`.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DEFAULT = "$DSFLASH_CACHE, else $XDG_CACHE_HOME/dsflash, else ~/.cache/dsflash"  # for help texts


def user_cache_home() -> Path:
    """$XDG_CACHE_HOME, else ~/.cache: the base of dsflash's cache and of the Hugging Face hub's."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()


def cache_root(override: str | os.PathLike | None = None) -> Path:
    """--cache-dir, else $DSFLASH_CACHE, else $XDG_CACHE_HOME/dsflash, else ~/.cache/dsflash."""
    if override:
        return Path(override).expanduser()
    if os.environ.get("DSFLASH_CACHE"):
        return Path(os.environ["DSFLASH_CACHE"]).expanduser()
    return user_cache_home() / "dsflash"


def embedded_dir(override: str | os.PathLike | None = None) -> Path:
    """Where the generated default model is kept."""
    return cache_root(override) / "embedded"


def kernel_dir() -> Path:
    """Where the native CPU kernels are built (keyed by source, flags and CPU, so one directory serves every cache):
    $DSFLASH_KERNELS, else the environment's cache (never --cache-dir)."""
    if os.environ.get("DSFLASH_KERNELS"):
        return Path(os.environ["DSFLASH_KERNELS"]).expanduser()
    return cache_root() / "kernels"


def state_root() -> Path:
    """$DSFLASH_STATE, else $XDG_STATE_HOME/dsflash, else ~/.local/state/dsflash."""
    if os.environ.get("DSFLASH_STATE"):
        return Path(os.environ["DSFLASH_STATE"]).expanduser()
    return Path(os.environ.get("XDG_STATE_HOME") or "~/.local/state").expanduser() / "dsflash"


def servers_dir() -> Path:
    """One record per running server: <port>.json."""
    return state_root() / "servers"


def logs_dir() -> Path:
    """The servers' log files."""
    return state_root() / "logs"
