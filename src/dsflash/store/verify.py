"""Check a store: crc32 of every rank block (or a sample) against the manifest, and optionally a sample of shards
against the checkpoint, re-derived the slow obvious way (dequantize, slice, pack)."""

from __future__ import annotations

import random
import time
import zlib

import numpy as np

from dsflash.errors import StoreCorrupt
from dsflash.store.reader import Store

SHOW = 5  # bad records named in the message


def verify_store(
    store: Store, *, sample: int | None = None, seed: int = 0, ckpt=None, decode: int = 0, progress: bool = False
) -> dict:
    """Recompute the checksums of every record (`sample`: that many random records) and compare with the manifest;
    with `ckpt` and decode > 0, also compare that many random rank shards byte for byte with a fresh pack of the
    dequantized checkpoint slices. Raises StoreCorrupt naming layer, expert and rank of what differs; returns
    {"records", "bytes", "decoded", "seconds"}."""
    t0 = time.perf_counter()
    g = store.geometry
    rng = random.Random(seed)
    records = [(lid, e) for lid in store.layers for e in range(store.n_experts(lid))]
    if sample is not None and sample < len(records):
        records = sorted(rng.sample(records, max(sample, 0)))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(records) * g.record_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="verify")
    bad = []
    try:
        for lid, e in records:
            rec = memoryview(store.record(lid, e))
            want = store.entry(lid).crc32[e]
            for r in range(g.tp):
                got = zlib.crc32(rec[r * g.stride : (r + 1) * g.stride])
                if got != want[r]:
                    bad.append((lid, e, r, got, want[r]))
            if bar is not None:
                bar.update(g.record_bytes)
    finally:
        if bar is not None:
            bar.close()
    if bad:
        raise StoreCorrupt(_checksum_message(store, bad))
    decoded = 0
    if ckpt is not None and decode > 0:
        shards = [(lid, e, r) for lid, e in records for r in range(g.tp)]
        for lid, e, r in sorted(rng.sample(shards, min(decode, len(shards)))):
            _compare_with_checkpoint(store, ckpt, lid, e, r)
            decoded += 1
    return {
        "records": len(records),
        "bytes": len(records) * g.record_bytes,
        "decoded": decoded,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _checksum_message(store: Store, bad: list) -> str:
    g = store.geometry
    named = []
    for lid, e, r, got, want in bad[:SHOW]:
        entry = store.entry(lid)
        start = e * g.record_bytes + r * g.stride
        named.append(
            f"layer {lid} ({entry.prefix}) expert {e} rank {r}: crc32 {got:08x}, manifest {want:08x} "
            f"({entry.file} bytes {start}..{start + g.stride - 1})"
        )
    more = f"; and {len(bad) - SHOW} more" if len(bad) > SHOW else ""
    return f"expert store {store.directory}: {len(bad)} rank block(s) fail their checksum: {'; '.join(named)}{more}"


def expected_parts(ckpt, prefix: str, expert: int, rank: int, geometry) -> dict[str, np.ndarray]:
    """The packed bytes a rank's shard must hold, from the fp32 dequantized checkpoint (independent of the
    builder's direct FP4 path)."""
    a, b = geometry.rank_slice(rank)
    out = {}
    for w in ("w1", "w3", "w2"):
        full = ckpt.tensor(f"{prefix}.ffn.experts.{expert}.{w}.weight")
        out[w] = geometry.pack(geometry.w2_values(full)[:, a:b] if w == "w2" else full[a:b])
    return out


def _compare_with_checkpoint(store: Store, ckpt, lid: int, e: int, r: int) -> None:
    entry = store.entry(lid)
    want = expected_parts(ckpt, entry.prefix, e, r, store.geometry)
    for part in store.parts(lid, e, r):
        w = want[part.name]
        if not np.array_equal(part.data, w):
            i = int(np.flatnonzero(part.data != w)[0]) if part.data.size == w.size else -1
            raise StoreCorrupt(
                f"expert store {store.directory}: layer {lid} ({entry.prefix}) expert {e} rank {r} {part.name} "
                f"differs from the checkpoint's {ckpt.path} (first at packed byte {i}); rebuild the store"
            )
