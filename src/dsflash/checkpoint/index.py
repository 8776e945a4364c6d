"""Checkpoint: a model directory in the official format, read lazily (index + shard headers, data by mmap)."""

from __future__ import annotations

import json
import mmap
from functools import cached_property
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from dsflash.checkpoint import verify as checks
from dsflash.checkpoint.names import INDEX, SINGLE, TensorSpec, expected_inventory
from dsflash.checkpoint.stfile import ITEMSIZE, TORCH_DTYPE, Entry, Header, read_header
from dsflash.config import ModelConfig
from dsflash.errors import CheckpointError
from dsflash.formats import fp4, fp8


class Checkpoint:
    """Names, entries, zero-copy raw tensors and dequantized fp32 tensors of one model directory."""

    def __init__(self, path: Path, config: ModelConfig, weight_map: dict[str, str] | None, total_size=None):
        self.path = path
        self.config = config
        self._index_map = weight_map  # None: single model.safetensors without an index
        self._single_map: dict[str, str] | None = None
        self._total_size = total_size
        self._headers: dict[str, Header | None] = {}
        self._maps: dict[str, np.memmap] = {}

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"{path} is not a model directory")
        config = ModelConfig.from_file(path / "config.json")
        if (path / INDEX).is_file():
            weight_map, total = _read_index(path / INDEX)
            return cls(path, config, weight_map, total)
        if (path / SINGLE).is_file():
            return cls(path, config, None)
        raise CheckpointError(f"{path} has neither {INDEX} nor {SINGLE}")

    # ---- lookup -------------------------------------------------------------------------------------------------
    @property
    def weight_map(self) -> dict[str, str]:
        """tensor name -> shard file name (from the index, or from the single file's header)."""
        if self._index_map is not None:
            return self._index_map
        if self._single_map is None:
            header = self._header(SINGLE)
            if header is None or (header.problems and not header.entries):
                raise CheckpointError(header.problems[0] if header else f"{SINGLE} is missing")
            self._single_map = {name: SINGLE for name in header.entries}
        return self._single_map

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def entry(self, name: str) -> Entry:
        """(dtype, shape, file, absolute data offset, nbytes) of one tensor."""
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"no tensor {name!r} in checkpoint {self.path}")
        header = self._header(file)
        if header is None:
            raise CheckpointError(f"shard {file} of {self.path} is missing (it holds {name})")
        entry = header.entries.get(name)
        if entry is None:
            why = header.problems[0] if header.problems else f"{file} has no tensor {name} (the index says it does)"
            raise CheckpointError(why)
        return entry

    @cached_property
    def specs(self) -> dict[str, TensorSpec]:
        """The expected inventory of the config, by name."""
        return {s.name: s for s in expected_inventory(self.config)}

    def vision_names(self) -> list[str]:
        """Vision-tower tensors present in the checkpoint; the text model does not load them."""
        return [n for n in self.names() if n in self.specs and self.specs[n].row.shard == "skip_vision"]

    # ---- data ---------------------------------------------------------------------------------------------------
    def raw(self, name: str) -> torch.Tensor:
        """The stored tensor, zero-copy over a copy-on-write mmap of its shard, in its stored torch dtype."""
        e = self.entry(name)
        dtype = TORCH_DTYPE[e.dtype]
        if e.nbytes == 0:
            return torch.empty(e.shape, dtype=dtype)
        data = torch.from_numpy(self._map(e.file)[e.offset : e.offset + e.nbytes])
        if e.offset % ITEMSIZE[e.dtype]:
            data = data.clone()  # a misaligned tensor cannot be viewed as its dtype in place
        return data.view(dtype).reshape(e.shape)

    def tensor(self, name: str) -> torch.Tensor:
        """fp32 dequantized (FP8 block / FP8 rows / FP4 with the sibling .scale; BF16/F32 upcast); I64 as int64."""
        e = self.entry(name)
        t = self.raw(name)
        scale_name = name.removesuffix(".weight") + ".scale"
        if e.dtype in ("F8_E4M3", "I8"):
            if not name.endswith(".weight") or scale_name not in self.weight_map:
                raise CheckpointError(f"{name} is quantized ({e.dtype}) but has no sibling {scale_name}")
            try:
                return self._dequant(name, t, self.raw(scale_name))
            except ValueError as err:
                raise CheckpointError(f"cannot dequantize {name}: {err}") from None
        if e.dtype == "I64":
            return t.clone()
        return t.to(torch.float32, copy=True)

    def _dequant(self, name: str, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        if w.dtype == torch.int8:
            return fp4.dequant(w, s)
        spec = self.specs.get(name)
        fmt = spec.row.fmt if spec is not None else None
        rows, cols = w.shape
        if fmt is None and tuple(s.shape) == (rows, cols // 32) and rows > 1:
            fmt = "fp8_rows"
        if fmt == "fp8_rows":
            return fp8.dequant_rows(w, s, torch.arange(rows), cols // s.shape[1])
        return fp8.dequant_block(w, s, self.config.fp8_block)

    # ---- inventory check ------------------------------------------------------------------------------------------
    def verify(self) -> dict:
        """Check config inventory vs index vs shard headers vs file sizes; one CheckpointError naming every
        difference. Returns {"tensors", "bytes"} of a sound checkpoint."""
        expected = expected_inventory(self.config)
        if self._index_map is not None:
            weight_map = self._index_map
        else:
            header = self._header(SINGLE)
            weight_map = {n: SINGLE for n in header.entries} if header else {}
        headers = {f: self._header(f) for f in sorted(set(weight_map.values()) or {SINGLE})}
        problems, unjudged = checks.storage_problems(weight_map, headers)
        if self._index_map is None and problems:
            unjudged = {s.name for s in expected}  # without an index we cannot tell what a broken file held
        found = {n: (e.dtype, e.shape) for h in headers.values() if h for n, e in h.entries.items()}
        payload = sum(e.nbytes for h in headers.values() if h for e in h.entries.values())
        if not problems:
            problems += checks.total_size_problem(self._total_size, payload)
        problems += checks.inventory_problems(expected, found, unjudged)
        checks.raise_if_any(self.path, problems)
        return {"tensors": len(found), "bytes": payload}

    # ---- files ----------------------------------------------------------------------------------------------------
    def _header(self, file: str) -> Header | None:
        if file not in self._headers:
            path = self.path / file
            self._headers[file] = read_header(path) if path.is_file() else None
        return self._headers[file]

    def close(self) -> None:
        """Drop the shard mappings. Tensors still viewing one (Engram tables) keep it alive, but its pages leave
        the resident set until they are read again, so loaded-and-copied weights are not counted twice."""
        for m in self._maps.values():
            mm = getattr(m, "_mmap", None)
            if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
                mm.madvise(mmap.MADV_DONTNEED)
        self._maps.clear()

    def _map(self, path: Path) -> np.memmap:
        key = str(path)
        if key not in self._maps:
            # mode "c": private copy-on-write pages, so torch gets a writable array and the file never changes
            self._maps[key] = np.memmap(key, dtype=np.uint8, mode="c")
        return self._maps[key]


def _read_index(path: Path) -> tuple[dict[str, str], object]:
    try:
        index = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable JSON index ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{path}: 'weight_map' must map tensor names to shard file names")
    for file in set(weight_map.values()):
        p = PurePosixPath(file)
        if p.is_absolute() or ".." in p.parts or not file:
            raise CheckpointError(f"{path}: shard name {file!r} points outside the model directory")
    meta = index.get("metadata")
    total = meta.get("total_size") if isinstance(meta, dict) else None
    return weight_map, total
