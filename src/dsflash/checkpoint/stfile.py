"""The safetensors file format: 8-byte little-endian header length, JSON header, then the tensor bytes.

Read and written by hand so that a header can be checked without touching the data and a writer can stream.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

TORCH_DTYPE = {
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8,
    "I64": torch.int64,
    "F16": torch.float16,
    "U8": torch.uint8,
    "I32": torch.int32,
}
ITEMSIZE = {name: torch.empty(0, dtype=dt).element_size() for name, dt in TORCH_DTYPE.items()}
MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers too
ALIGN = 8


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes lie: `offset` is absolute in `file`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Header:
    """A parsed shard header; `problems` lists what is wrong with it (empty for a sound file)."""

    path: Path
    entries: dict[str, Entry]
    data_start: int
    file_size: int
    problems: tuple[str, ...]


def read_header(path: Path) -> Header:
    """Parse and check one shard header without reading tensor data; never raises for bad content."""
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return Header(path, {}, 0, size, (f"{name}: file is {size} bytes, too short for a header",))
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                return Header(path, {}, 0, size, (f"{name}: corrupt header length {n} (file is {size} bytes)",))
            raw = f.read(n)
    except OSError as e:
        return Header(path, {}, 0, 0, (f"{name}: cannot read ({e.strerror or e})",))
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return Header(path, {}, 0, size, (f"{name}: header is not valid JSON ({e})",))
    if not isinstance(meta, dict):
        return Header(path, {}, 0, size, (f"{name}: header is not a JSON object",))
    return _check_entries(path, meta, 8 + n, size)


def _check_entries(path: Path, meta: dict, start: int, size: int) -> Header:
    name = path.name
    entries: dict[str, Entry] = {}
    problems: list[str] = []
    spans = []
    for key, info in meta.items():
        if key == "__metadata__":
            continue
        entry, spans_or_err = _parse_entry(path, key, info, start)
        if entry is None:
            problems.append(f"{name}: tensor {key}: {spans_or_err}")
            continue
        entries[key] = entry
        spans.append((entry.offset - start, entry.offset - start + entry.nbytes, key))
    spans.sort()
    end = 0
    for begin, stop, key in spans:
        if begin != end:
            what = "overlaps the previous tensor" if begin < end else f"leaves a gap of {begin - end} bytes"
            problems.append(f"{name}: tensor {key} {what}")
        end = max(end, stop)
    if start + end > size:
        cut = sorted(k for k, e in entries.items() if e.offset + e.nbytes > size)
        shown = ", ".join(cut[:3]) + (f", ... (+{len(cut) - 3} more)" if len(cut) > 3 else "")
        problems.append(f"{name}: truncated (data ends at byte {start + end}, file has {size}; cut off: {shown})")
        entries = {k: e for k, e in entries.items() if k not in cut}
    elif start + end < size:
        problems.append(f"{name}: {size - start - end} trailing bytes after the last tensor")
    return Header(path, entries, start, size, tuple(problems))


def _parse_entry(path: Path, key: str, info, start: int) -> tuple[Entry | None, str]:
    if not isinstance(info, dict):
        return None, "entry is not an object"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in ITEMSIZE:
        return None, f"unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        return None, f"bad shape {shape!r}"
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        return None, f"bad data_offsets {offsets!r}"
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != nbytes:
        return None, f"data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, {dtype} {shape} needs {nbytes}"
    return Entry(key, dtype, tuple(shape), path, start + offsets[0], nbytes), ""


def encode_header(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict | None = None) -> bytes:
    """(name, dtype, shape) in data order -> length-prefixed header with contiguous data_offsets."""
    meta: dict = {"__metadata__": metadata or {"format": "pt"}}
    pos = 0
    for name, dtype, shape in tensors:
        n = math.prod(shape) * ITEMSIZE[dtype]
        meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # data starts 8-aligned, as the safetensors library writes it
    return struct.pack("<Q", len(raw)) + raw
