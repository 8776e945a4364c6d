"""Build the packed expert store from a checkpoint: atomic per layer, resumable, refused without the packer
self-check. A store in place that was built for something else is replaced only when asked; reading a store is
store.reader's (open_store), which never imports this module."""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import time
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from dsflash.checkpoint.names import block_prefix
from dsflash.errors import CheckpointError, NoSpace, StoreCorrupt, StoreMismatch
from dsflash.formats import bfp, fp4
from dsflash.store.layout import (
    LOCK,
    MANIFEST,
    PARTIAL,
    Geometry,
    LayerEntry,
    StoreManifest,
    differences,
    fsync_dir,
    layer_file,
    layout_differences,
    mismatch_message,
    moe_layers,
    store_dir,
    store_identity,
)

# Testing hook: stop (sleep) after this many records have been written by this process, so that a test can
# kill the build at a known point. Unset in normal use.
PAUSE_ENV = "DSFLASH_STORE_TEST_PAUSE_AFTER_RECORDS"


def expert_tensor(prefix: str, expert: int, w: str) -> str:
    """Checkpoint name of a routed expert matrix: `layers.3.ffn.experts.7.w1.weight`."""
    return f"{prefix}.ffn.experts.{expert}.{w}.weight"


_E8M0 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).float().numpy()  # byte -> 2^(e-127)
_FP4_QUADS: list[np.ndarray] = []  # two FP4 bytes (uint16) -> their four fp32 values as one 16-byte item


def _fp4_quads() -> np.ndarray:
    if not _FP4_QUADS:
        b = np.arange(256)
        table = fp4.FP4_TABLE.numpy()
        pairs = np.stack([table[b & 15], table[b >> 4]], -1).view(np.uint64)[:, 0]  # low nibble first
        w = np.arange(1 << 16)
        quads = np.stack([pairs[w & 255], pairs[w >> 8]], -1)  # little-endian: the first byte is the low one
        _FP4_QUADS.append(quads.view(np.complex128)[:, 0])  # any 16-byte dtype: take() moves it whole
    return _FP4_QUADS[0]


def dequant_fp4(packed, scale) -> np.ndarray:
    """FP4 I8 [O, I/2] + E8M0 [O, I/32] -> fp32 [O, I], bit for bit fp4.dequant (the same fp32 products), several
    times faster: one 16-byte table lookup per two FP4 bytes and one multiply per element. A NaN (0xFF) scale,
    whose NaN bits could depend on the multiply's operand order, goes through fp4.dequant itself."""
    p = packed.view(torch.uint8).numpy() if isinstance(packed, torch.Tensor) else np.asarray(packed).view(np.uint8)
    s = scale.view(torch.uint8).numpy() if isinstance(scale, torch.Tensor) else np.asarray(scale).view(np.uint8)
    if p.ndim != 2 or s.shape != (p.shape[0], p.shape[1] // 16) or p.shape[1] % 16:
        raise CheckpointError(f"FP4 weight {p.shape} and E8M0 scale {s.shape} are not [O, I/2] and [O, I/32]")
    # a private copy: aligned, contiguous, and take() reads it at twice the speed of the page-cache mapping
    p, s = np.array(p, order="C"), np.ascontiguousarray(s)
    if (s == 0xFF).any():
        return fp4.dequant(torch.from_numpy(p), torch.from_numpy(s)).numpy()
    rows, groups = s.shape
    v = _fp4_quads().take(p.view(np.uint16)).view(np.float32).reshape(rows, groups, 32)
    with np.errstate(over="ignore"):  # 6 * 2^127 is inf in fp4.dequant too
        v *= _E8M0[s][:, :, None]
    return v.reshape(rows, groups * 32)


class ExpertSource:
    """One routed expert of the checkpoint, packed shard by shard. bfp4_b from FP4 takes the direct FP4 -> bfp4
    path on row slices (w1, w3) and on column slices that keep whole 32-column scale groups (w2 when
    I/N % 32 == 0); anything else is dequantized, sliced and packed, which gives the same bytes."""

    def __init__(self, ckpt, prefix: str, expert: int, geom: Geometry):
        self.ckpt, self.geom = ckpt, geom
        self.names = {w: expert_tensor(prefix, expert, w) for w in ("w1", "w2", "w3")}
        self.raw: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        want = {"w1": (geom.inter, geom.hidden), "w3": (geom.inter, geom.hidden), "w2": (geom.hidden, geom.inter)}
        for w, name in self.names.items():
            t = ckpt.raw(name)
            scale_name = name.removesuffix(".weight") + ".scale"
            s = ckpt.raw(scale_name) if t.dtype == torch.int8 else None
            logical = (t.shape[0], 2 * t.shape[1]) if s is not None else tuple(t.shape)
            if s is not None and tuple(s.shape) != (logical[0], logical[1] // 32):
                raise CheckpointError(
                    f"{scale_name} has shape {tuple(s.shape)}, expected {[logical[0], logical[1] // 32]}"
                )
            if logical != want[w]:
                raise CheckpointError(f"{name} is {list(logical)} (logical), the config implies {list(want[w])}")
            self.raw[w] = (t, s)
        self._w2 = None

    def _fp32(self, w: str, rows: slice = slice(None)):
        t, s = self.raw[w]
        if s is not None:
            return dequant_fp4(t[rows], s[rows])
        return self.ckpt.tensor(self.names[w])[rows]

    def rows(self, w: str, a: int, b: int) -> np.ndarray:
        """Packed rows a:b of w1 / w3."""
        t, s = self.raw[w]
        if self.geom.tile_format == "bfp4_b" and s is not None:
            return bfp.fp4_to_bfp4(t[a:b], s[a:b], search=self.geom.search)
        return self.geom.pack(self._fp32(w, slice(a, b)))

    def cols(self, a: int, b: int) -> np.ndarray:
        """Packed input columns a:b of w2."""
        t, s = self.raw["w2"]
        fmt = self.geom.tile_format
        if fmt == "bfp4_b" and s is not None and a % fp4.GROUP == 0 and b % fp4.GROUP == 0:
            return bfp.fp4_to_bfp4(t[:, a // 2 : b // 2], s[:, a // 32 : b // 32], search=self.geom.search)
        if self._w2 is None:
            self._w2 = self.geom.w2_values(self._fp32("w2"))
        return self.geom.pack(self._w2[:, a:b])

    def pieces(self) -> list[list[np.ndarray]]:
        """The record in file order: per rank, the packed w1, w3, w2 shards and the zeros up to the stride."""
        g = self.geom
        pad = _zeros(g.stride - g.shard_bytes)
        out = []
        for r in range(g.tp):
            a, b = g.rank_slice(r)
            ranks = []
            for part in g.parts:
                data = self.cols(a, b) if part.name == "w2" else self.rows(part.name, a, b)
                if data.size != part.nbytes:  # pragma: no cover - packed_size and the packers agree
                    raise StoreCorrupt(
                        f"{self.names[part.name]} rank {r}: packed {data.size} bytes, expected {part.nbytes}"
                    )
                ranks.append(data)
            out.append(ranks + [pad] if pad.size else ranks)
        return out


_ZEROS: dict[int, np.ndarray] = {}


def _zeros(n: int) -> np.ndarray:
    if n not in _ZEROS:
        z = np.zeros(n, dtype=np.uint8)
        z.flags.writeable = False
        _ZEROS[n] = z
    return _ZEROS[n]


def rank_crcs(pieces: list[list[np.ndarray]]) -> list[int]:
    """crc32 of each rank block (its pieces one after the other, padding included)."""
    out = []
    for ranks in pieces:
        crc = 0
        for a in ranks:
            crc = zlib.crc32(a, crc)
        out.append(crc)
    return out


# ---------------------------------------------------------------------------------------------- build


class _Progress:
    """tqdm over bytes, its description counting layers; silent when disabled."""

    def __init__(self, enabled: bool, total: int, initial: int, n_layers: int, done: int, name: str):
        self.bar = None
        self.n_layers, self.done, self.name = n_layers, done, name
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024,
                            desc=self._desc(), file=sys.stderr, dynamic_ncols=True)  # fmt: skip

    def _desc(self) -> str:
        return f"store {self.name}: layers {self.done}/{self.n_layers}"

    def bytes(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def layer(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_description(self._desc())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _lock(directory: Path) -> int:
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreMismatch(f"another process is building the expert store in {directory}; wait for it") from None
    return fd


def _store_files(directory: Path, finished: bool = True) -> list[Path]:
    """What a store consists of in a directory (never anything else there); finished=False: only unfinished files."""
    names = (MANIFEST + PARTIAL,) if not finished else (MANIFEST, MANIFEST + PARTIAL)
    ends = (".experts.bin" + PARTIAL,) if not finished else (".experts.bin", ".experts.bin" + PARTIAL)
    return [p for p in directory.iterdir() if p.name in names or p.name.endswith(ends)]


def _wipe(directory: Path) -> None:
    for p in _store_files(directory):
        p.unlink()


def _check_space(directory: Path, need: int, afresh: bool) -> None:
    """Refuse before writing anything when the layers to write do not fit in the disk's free space plus what the
    build removes first (the whole old store when it starts afresh, else the unfinished files)."""
    freed = sum(p.stat().st_size for p in _store_files(directory, finished=afresh))
    free = shutil.disk_usage(directory).free + freed
    if need > free:
        raise NoSpace(
            f"the expert store needs {need / 1e9:,.1f} GB more in {directory}, but {free / 1e9:,.1f} GB are free "
            "there; free some space or choose another --cache-dir"
        )


def _plan(directory: Path, want: dict, geom: Geometry, specs, rebuild: bool) -> tuple[StoreManifest | None, str]:
    """The manifest whose finished layers can be kept (None: start afresh), and why (for messages)."""
    try:
        have = StoreManifest.read_identity(directory)
    except StoreCorrupt as e:
        if rebuild:
            return None, "damaged manifest"
        raise StoreCorrupt(f"{e}; pass --rebuild (rebuild=True) to replace the store") from None
    if have is None:
        return None, "new"
    diffs = differences(have, want)
    if diffs:
        if rebuild:
            return None, "built for " + "; ".join(diffs)
        raise StoreMismatch(mismatch_message(directory, diffs, "build"))
    try:
        m = StoreManifest.read(directory)
    except StoreCorrupt as e:
        if rebuild:
            return None, "damaged manifest"
        raise StoreCorrupt(f"{e}; pass --rebuild (rebuild=True) to replace the store") from None
    layout = layout_differences(m, geom, specs)
    if layout:
        if rebuild:
            return None, layout
        raise StoreMismatch(mismatch_message(directory, [layout], "build"))
    return m, "resume"


def _kept_layers(directory: Path, m: StoreManifest, cfg, specs) -> dict[int, LayerEntry]:
    """Finished layers whose file is there with the size the manifest says; the rest is redone."""
    kept = {}
    by_id = {s.layer_id: s for s in specs}
    for lid, e in m.layers.items():
        spec = by_id.get(lid)
        if spec is None or e.prefix != block_prefix(cfg, spec) or e.file != layer_file(e.prefix):
            continue
        p = directory / e.file
        if p.is_file() and p.stat().st_size == e.nbytes:
            kept[lid] = e
    return kept


def build_store(
    ckpt, root: str | Path | None, tp: int, fmt: str, progress: bool = True, *,
    rebuild: bool = False,
) -> StoreManifest:  # fmt: skip
    """Build (or finish) the store of `ckpt` for this TP degree and tile format in `store_dir` (the model's first
    store, `<root>/<model-name>/weights/`, or one beside it: the model's stores for other degrees or formats stay
    as they are). Finished layers of a matching store are kept; a store in its place of another model, revision or
    format version is refused (StoreMismatch) unless rebuild=True, which replaces it. Runs the packer self-check
    before writing anything. Returns the manifest; its `.stats` says which layers were built and kept."""
    t0 = time.perf_counter()
    cfg = ckpt.config
    want, geom, name = store_identity(ckpt, tp, fmt)
    specs = moe_layers(cfg)
    directory = store_dir(ckpt.path, root, tp, fmt)
    directory.mkdir(parents=True, exist_ok=True)
    lock = _lock(directory)
    try:
        old, why = _plan(directory, want, geom, specs, rebuild)
        kept = _kept_layers(directory, old, cfg, specs) if old is not None else {}
        todo = [s for s in specs if s.layer_id not in kept]
        m = StoreManifest(want["model_id"], want["revision"], name, geom, dict(kept), [s.layer_id for s in specs])
        if todo:
            _check_space(directory, sum(s.n_experts for s in todo) * geom.record_bytes, afresh=old is None)
            try:
                bfp.self_check()
            except StoreCorrupt as e:
                raise StoreCorrupt(f"refusing to build the expert store: {e}") from None
            if old is None:
                _wipe(directory)
            for p in directory.glob("*" + PARTIAL):
                p.unlink()
            m.write(directory)  # claims the directory for this identity before any layer file is written
        written = _build_layers(ckpt, directory, m, todo, progress, name)
    finally:
        os.close(lock)
    seconds = time.perf_counter() - t0
    m.stats = {"built": [s.layer_id for s in todo], "kept": sorted(kept), "bytes_written": written,
               "seconds": seconds, "reason": why if todo else "up to date"}  # fmt: skip
    return m


def _build_layers(ckpt, directory: Path, m: StoreManifest, todo, progress: bool, name: str) -> int:
    """Pack in this thread; checksum and write in another (zlib and os.write release the GIL), at most two records
    behind, so that packing the next record overlaps writing the last ones."""
    geom = m.geometry
    total = sum(s.n_experts for s in moe_layers(ckpt.config)) * geom.record_bytes
    bar = _Progress(progress, total, m.total_bytes(), len(m.expected_layers), len(m.layers), name)
    pause_at = int(os.environ.get(PAUSE_ENV, "0") or 0)
    pending: deque[Future] = deque()
    records = written = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small per-shard ops: the pool only costs time here
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="store-writer") as writer:
            for spec in todo:
                prefix = block_prefix(ckpt.config, spec)
                file = layer_file(prefix)
                tmp = directory / (file + PARTIAL)
                crcs: list[list[int]] = [[] for _ in range(spec.n_experts)]
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    for e in range(spec.n_experts):
                        pieces = ExpertSource(ckpt, prefix, e, geom).pieces()
                        while len(pending) >= 2:
                            pending.popleft().result()
                        pending.append(writer.submit(_emit, fd, pieces, crcs, e))
                        records += 1
                        written += geom.record_bytes
                        bar.bytes(geom.record_bytes)
                        if records == pause_at:
                            _drain(pending)
                            print(f"dsflash store: test pause after {records} records", file=sys.stderr, flush=True)
                            time.sleep(3600)
                    _drain(pending)
                    os.fsync(fd)
                finally:
                    _drain(pending, quiet=True)
                    os.close(fd)
                os.replace(tmp, directory / file)
                fsync_dir(directory)
                nbytes = spec.n_experts * geom.record_bytes
                m.layers[spec.layer_id] = LayerEntry(spec.layer_id, prefix, file, spec.n_experts, nbytes, crcs)
                m.write(directory)
                bar.layer()
    except OSError as e:
        raise StoreCorrupt(f"cannot write the expert store in {directory}: {e}") from None
    finally:
        torch.set_num_threads(threads)
        bar.close()
    return written


def _emit(fd: int, pieces: list[list[np.ndarray]], crcs: list, expert: int) -> None:
    crcs[expert] = rank_crcs(pieces)
    for ranks in pieces:
        for a in ranks:
            _write_all(fd, a)


def _drain(pending: deque, quiet: bool = False) -> None:
    """Wait for the writer; re-raise its error unless quiet (already unwinding from another)."""
    while pending:
        f = pending.popleft()
        if quiet:
            f.exception()
        else:
            f.result()


def _write_all(fd: int, buf: np.ndarray) -> None:
    view = memoryview(buf)
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]
