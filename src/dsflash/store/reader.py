"""Read the packed expert store: every layer file mmapped once; records, rank shards and their three packed
matrices are zero-copy views of the page cache."""

from __future__ import annotations

import contextlib
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsflash.errors import StoreCorrupt, StoreMismatch
from dsflash.formats import bfp
from dsflash.store.layout import (
    Geometry,
    LayerEntry,
    StoreManifest,
    StoreMissing,
    differences,
    layout_differences,
    mismatch_message,
    model_stores,
    moe_layers,
    store_dir,
    store_identity,
)

PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class PackedPart:
    """One rank's shard of one matrix: packed tiles (zero-copy view) and the logical shape they decode to."""

    name: str  # w1, w3, w2
    data: np.ndarray  # uint8 [packed bytes]
    shape: tuple[int, int]
    tile_format: str

    def unpack(self) -> np.ndarray:
        """fp32 [rows, cols], decoded as ttnn.to_torch would."""
        return bfp.unpack(self.data, self.tile_format, self.shape)


class Store:
    """An opened store. Layers are addressed by layer id (DSpark stage k is num_hidden_layers + k)."""

    def __init__(self, directory: Path, manifest: StoreManifest, maps: dict[int, mmap.mmap]):
        self.directory = directory
        self.manifest = manifest
        self._maps = maps
        self._arrays = {lid: np.frombuffer(mm, dtype=np.uint8) for lid, mm in maps.items()}

    @classmethod
    def open(cls, directory: str | Path, expect: dict | None = None) -> Store:
        """Map a finished store. `expect`: identity (format_version, model_id, revision, tp, tile_format) it must
        have; any difference raises StoreMismatch naming it. Missing or unfinished: StoreMissing; a layer file
        of the wrong size (truncated, overwritten): StoreCorrupt."""
        directory = Path(directory)
        have = StoreManifest.read_identity(directory)
        if have is None:
            raise StoreMissing(f"no expert store in {directory}; build it with `dsflash store build MODEL`")
        if expect is not None:
            diffs = differences(have, expect)
            if diffs:
                raise StoreMismatch(
                    f"the expert store in {directory} was built for something else: {'; '.join(diffs)}; rebuild it "
                    "with `dsflash store build MODEL --rebuild` (or use another --cache-dir)"
                )
        m = StoreManifest.read(directory)
        if not m.complete:
            missing = sorted(set(m.expected_layers) - set(m.layers))
            raise StoreMissing(
                f"the expert store in {directory} is unfinished ({len(m.layers)} of {len(m.expected_layers)} layers; "
                f"missing {_ids(missing)}); run `dsflash store build MODEL` again to finish it"
            )
        maps: dict[int, mmap.mmap] = {}
        try:
            for lid, e in sorted(m.layers.items()):
                maps[lid] = _map(directory / e.file, e)
        except BaseException:
            for mm in maps.values():
                mm.close()
            raise
        return cls(directory, m, maps)

    # ---- addressing -----------------------------------------------------------------------------------------------
    @property
    def geometry(self) -> Geometry:
        return self.manifest.geometry

    @property
    def tp(self) -> int:
        return self.geometry.tp

    @property
    def tile_format(self) -> str:
        return self.geometry.tile_format

    @property
    def layers(self) -> list[int]:
        return sorted(self.manifest.layers)

    def entry(self, layer: int) -> LayerEntry:
        e = self.manifest.layers.get(layer)
        if e is None:
            raise IndexError(f"layer {layer} is not in the expert store (layers {_ids(self.layers)})")
        return e

    def n_experts(self, layer: int) -> int:
        return self.entry(layer).experts

    def _at(self, layer: int, expert: int, rank: int | None = None) -> int:
        e = self.entry(layer)
        if not 0 <= expert < e.experts:
            raise IndexError(f"expert {expert} out of range 0..{e.experts - 1} in layer {layer}")
        if rank is not None and not 0 <= rank < self.tp:
            raise IndexError(f"rank {rank} out of range 0..{self.tp - 1}")
        return expert * self.geometry.record_bytes + (rank or 0) * self.geometry.stride

    def shard_range(self, layer: int, expert: int, rank: int) -> tuple[Path, int, int]:
        """(file, byte offset, bytes) of one rank's shard: page-aligned, w1 | w3 | w2 without the padding."""
        return self.directory / self.entry(layer).file, self._at(layer, expert, rank), self.geometry.shard_bytes

    # ---- views ----------------------------------------------------------------------------------------------------
    def _view(self, layer: int, start: int, n: int, torch: bool):
        v = self._arrays[layer][start : start + n]
        if torch:
            import torch as _torch

            # the mapping is private (copy-on-write): a write through the tensor never reaches the file
            return _torch.from_numpy(v)
        v = v.view()
        v.flags.writeable = False
        return v

    def record(self, layer: int, expert: int, torch: bool = False):
        """All ranks of one expert (record_bytes, rank blocks with their padding), zero-copy."""
        return self._view(layer, self._at(layer, expert), self.geometry.record_bytes, torch)

    def shard(self, layer: int, expert: int, rank: int, torch: bool = False):
        """One rank's shard of one expert, w1 | w3 | w2 packed (shard_bytes), zero-copy: numpy read-only by default,
        torch.uint8 with torch=True."""
        return self._view(layer, self._at(layer, expert, rank), self.geometry.shard_bytes, torch)

    def parts(self, layer: int, expert: int, rank: int) -> tuple[PackedPart, PackedPart, PackedPart]:
        """The rank's w1, w3, w2 shards as zero-copy views with their logical shapes."""
        shard = self.shard(layer, expert, rank)
        return tuple(
            PackedPart(p.name, shard[p.offset : p.offset + p.nbytes], p.shape, self.tile_format)
            for p in self.geometry.parts
        )

    def unpack(self, layer: int, expert: int, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """fp32 w1 [I/N, H], w3 [I/N, H], w2 [H, I/N] of one rank (tests, reference paths)."""
        w1, w3, w2 = (p.unpack() for p in self.parts(layer, expert, rank))
        return w1, w3, w2

    def prefetch(self, layer: int, experts, rank: int | None = None) -> int:
        """madvise(MADV_WILLNEED) over these experts' records (or only one rank's shards): the kernel starts reading
        them into the page cache without blocking. Returns the bytes advised (0 where madvise is unavailable)."""
        if not hasattr(mmap, "MADV_WILLNEED"):
            return 0
        mm = self._maps[self.entry(layer).layer]
        if rank is None:
            ranges = [(self._at(layer, e), self.geometry.record_bytes) for e in experts]
        else:
            ranges = [(self._at(layer, e, rank), self.geometry.shard_bytes) for e in experts]
        total = 0
        for start, n in _merge(ranges):
            lo = start // PAGE * PAGE  # madvise wants a page-aligned start (rank blocks are 4 KiB aligned anyway)
            mm.madvise(mmap.MADV_WILLNEED, lo, start + n - lo)
            total += n
        return total

    # ---- lifetime -------------------------------------------------------------------------------------------------
    def close(self) -> None:
        self._arrays.clear()
        for mm in self._maps.values():
            with contextlib.suppress(BufferError):  # views are still alive; the mapping goes when they do
                mm.close()
        self._maps.clear()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        m = self.manifest
        return (
            f"Store({str(self.directory)!r}, model={m.model_id!r}, tp={self.tp}, {self.tile_format}, "
            f"{len(m.layers)} layers, {m.total_bytes() / 1e9:.2f} GB)"
        )


def _map(path: Path, e: LayerEntry) -> mmap.mmap:
    if not path.is_file():
        raise StoreCorrupt(f"{path} is missing (layer {e.layer}, {e.prefix}); rebuild the store")
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size != e.nbytes:
            what = "truncated" if size < e.nbytes else "longer than built"
            raise StoreCorrupt(
                f"{path} is {what}: {size} bytes, the manifest says {e.nbytes} (layer {e.layer}, {e.prefix}); "
                "rebuild the store"
            )
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for start, n in sorted(ranges):
        if out and start <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], start + n - out[-1][0])
        else:
            out.append([start, n])
    return [(s, n) for s, n in out]


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:8])) + (f" ... ({len(ids)} in all)" if len(ids) > 8 else "")


# ---------------------------------------------------------------------------------------------- open


def open_store(ckpt, root: str | Path | None, tp: int | None, fmt: str | None) -> Store:
    """The store of `ckpt` at this TP degree and tile format (None: that of a store the model has, the first one
    first), checked against the model, for reading. A missing, unfinished or mismatched store is refused:
    StoreMissing / StoreMismatch saying what differs (store.build.build_store makes or replaces one); a truncated
    layer file: StoreCorrupt."""
    if tp is None or fmt is None:
        tp, fmt = _built_for(ckpt, root, tp, fmt)
    want, geom, _ = store_identity(ckpt, tp, fmt)
    directory = store_dir(ckpt.path, root, tp, fmt)
    store = Store.open(directory, expect=want)
    layout = layout_differences(store.manifest, geom, moe_layers(ckpt.config))
    if layout:
        store.close()
        raise StoreMismatch(mismatch_message(directory, [layout], "open"))
    return store


def _built_for(ckpt, root, tp: int | None, fmt: str | None) -> tuple[int, str]:
    """The TP degree and tile format of the model's first store (`weights`, then those beside it) that has the
    given ones (None: any); the given ones, defaulted, where none has."""
    for directory in model_stores(ckpt.path, root):
        try:
            have = StoreManifest.read_identity(directory)
        except StoreCorrupt:
            continue
        if have and tp in (None, have.get("tp")) and fmt in (None, have.get("tile_format")):
            return have["tp"], have["tile_format"]
    return tp or 1, fmt or "bfp4_b"
