"""Shelf: one rank's snapshots of its decode state, by key, in host memory and (with a directory) on disk. It
does what rank 0's PrefixCache decides; it decides nothing itself (every rank must hold the same keys)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from dsflash.model.state import DecodeState
from dsflash.runtime.prefix import files

log = logging.getLogger(__name__)


@dataclass
class Taken:
    """What a snapshot cost (summed over ranks): bytes kept in memory, bytes written to disk, how many ranks found
    the disk full and how many failed to write their file."""

    memory: int = 0
    disk: int = 0
    disk_full: int = 0
    disk_failed: int = 0


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def state_bytes(state: DecodeState, length: int) -> int:
    """Bytes of a snapshot of `length` tokens of this state (DecodeState.snapshot)."""
    total = sum(t[:, :rows].numel() * t.element_size() for st in state.layers for _, t, rows in st.parts(length))
    if state.engram_history is not None:
        total += state.engram_history.shape[0] * length * state.engram_history.element_size()
    return total


class Shelf:
    def __init__(self, state: DecodeState, identity: dict, rank: int = 0, world: int = 1, directory=None):
        self.state, self.identity, self.rank, self.world = state, identity, rank, world
        self.directory = Path(directory) if directory is not None else None
        self.memory: dict[int, dict[str, torch.Tensor]] = {}

    def path(self, key: int) -> Path:
        return self.directory / files.file_name(key, self.rank, self.world)

    def take(self, key: int, keep: bool, write: bool, tokens=None, salt: str = "") -> Taken:
        """Snapshot the state as it is now under `key`: kept in memory and / or written to disk."""
        snap = self.state.snapshot()
        out = Taken()
        if write and self.directory is not None:
            header = {"identity": self.identity, "key": f"{key:016x}", "length": self.state.length,
                      "rank": self.rank, "world": self.world, "salt": salt,
                      "tokens": list(tokens) if tokens is not None else None}  # fmt: skip
            try:
                out.disk = files.write(self.path(key), snap, header)
            except files.DiskFull as e:
                log.warning("prefix cache: %s; snapshots stay in memory only from now on", e)
                out.disk_full = 1
            except OSError as e:  # any other write failure costs that snapshot's file, never the request
                log.warning("prefix cache: writing %s failed: %s", self.path(key), e)
            out.disk_failed = int(not out.disk)
        if keep:
            self.memory[key] = snap
            out.memory = nbytes(snap)
        return out

    def load(self, key: int, length: int, from_disk: bool) -> dict[str, torch.Tensor] | None:
        """The snapshot's tensors, verified against this state (a bad file is removed), or None."""
        if not from_disk:
            snap = self.memory.get(key)
        else:
            path = self.path(key)
            try:
                header, snap = files.read(path, self.identity, key)
                if header.get("length") != length:
                    raise files.BadFile(f"holds {header.get('length')} tokens, not {length}")
            except FileNotFoundError:
                log.warning("prefix cache: %s is gone", path)
                return None
            except (files.BadFile, OSError) as e:
                files.remove(path, str(e))
                return None
        if snap is None:
            return None
        try:
            self.state.check(snap, length)
        except ValueError as e:
            if from_disk:
                files.remove(self.path(key), str(e))
            else:
                self.memory.pop(key, None)
            return None
        return snap

    def apply(self, key: int, snap: dict[str, torch.Tensor], length: int, keep: bool) -> None:
        self.state.restore(snap, length)
        if keep:
            self.memory[key] = snap

    def drop(self, key: int, memory: bool, disk: bool) -> None:
        if memory:
            self.memory.pop(key, None)
        if disk and self.directory is not None:
            self.path(key).unlink(missing_ok=True)
