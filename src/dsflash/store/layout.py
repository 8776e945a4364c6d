"""Where the packed expert store lives, what identifies it, and where every byte of it sits.

A store is one directory, `<root>/<model-name>/weights/` (root: dsflash.paths.cache_root, --cache-dir first),
holding one file per MoE layer (backbone blocks and DSpark stages) and `manifest.json`.

A layer file is nothing but its records, one per routed expert, all the same size, expert e at e * record_bytes.
A record is rank-major: TP rank blocks of `stride` bytes, rank r at r * stride. A rank block holds that rank's
shard of the three matrices, packed as bfp tiles one after the other, then zeros up to the stride:

    w1[r*I/N : (r+1)*I/N, :]   [I/N, H]   (output rows)
    w3[r*I/N : (r+1)*I/N, :]   [I/N, H]   (output rows)
    w2[:, r*I/N : (r+1)*I/N]   [H, I/N]   (input columns)

I = moe_intermediate_size, H = hidden_size, N = TP degree. Each matrix is zero-padded to whole 32x32 tiles on its
own (a shard narrower than a tile takes one padded tile row or column) and tiles go in row-major order, exactly
as formats.bfp.pack writes them. The stride is the data rounded up to ALIGN (4 KiB), so every rank block starts
on a page: one rank's shard is one page-aligned contiguous range that madvise, O_DIRECT reads and DMA from
pinned pages can take whole without touching a neighbour's pages (at the V4.1 widths the data is already a
whole number of pages, so this costs no bytes there).

Checksums are zlib.crc32 of each whole rank block, padding included, so that every byte of a file is covered
and one rank's shard can be checked alone (zlib's crc32 runs at about 2.2 GB/s here, twice sha1/sha256).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from dsflash.errors import StoreCorrupt, StoreMismatch
from dsflash.formats import bfp
from dsflash.paths import cache_root

FORMAT = "dsflash-expert-store"
# 2: w2 shards narrower than a face row are rounded over the whole matrix; 3: bfp4_b face rows take the
# lower-error shared exponent (formats.bfp `search`)
FORMAT_VERSION = 3
TILE_FORMATS = ("bfp4_b", "bfp8_b")
# resolve_tile_format: bfp8_b (exact for FP4 experts) where its whole store fits in RAM_SHARE of the host's memory
AUTO = "auto"
RAM_SHARE = 0.25  # the page cache must also hold the Engram tables and the dense weights beside the slots
ALIGN = 4096
CHECKSUM = "crc32"
MANIFEST = "manifest.json"
PARTIAL = ".partial"  # suffix of a layer file or manifest still being written
LOCK = ".build.lock"
TILE = 32
FACE = 16  # elements sharing one exponent along a row of a bfp tile
# identity of a store: a manifest that differs in any of these was built for something else
IDENTITY_KEYS = ("format_version", "model_id", "revision", "tp", "tile_format")
IDENTITY_WORDS = {
    "format_version": "store format version",
    "model_id": "model",
    "revision": "revision",
    "tp": "TP degree",
    "tile_format": "tile format",
}


class StoreMissing(StoreMismatch):
    """No store, or an unfinished one, where one was expected; `dsflash store build` makes it."""


# ---------------------------------------------------------------------------------------------- where


_HUB_SNAPSHOT = re.compile(r"^models--(?P<repo>.+)$")
_REV = re.compile(r"^[0-9a-f]{40}$")


def _hub_parts(path: Path) -> tuple[str, str] | None:
    """(repo id, commit) of a Hub cache snapshot dir `.../models--org--name/snapshots/<commit>`, else None."""
    parts = path.absolute().parts
    if len(parts) < 3 or parts[-2] != "snapshots" or not _REV.match(parts[-1]):
        return None
    m = _HUB_SNAPSHOT.match(parts[-3])
    if not m:
        return None
    return m.group("repo").replace("--", "/"), parts[-1]


def _slug(text: str) -> str:
    s = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")
    return s or "model"


def model_name(model: str | Path) -> str:
    """Directory name of a model's store: the lower-cased repo name for a Hub model (`deepseek-ai/DeepSeek-V4.1-Flash`
    or its cache snapshot -> `deepseek-v4.1-flash`), `<dir name>-<8 hex of its absolute path>` for a local directory
    (two local dirs both called `model` must not share a store)."""
    path = Path(model).expanduser()
    hub = _hub_parts(path)
    if hub is not None:
        return _slug(hub[0].split("/")[-1])
    if path.is_dir():
        where = str(path.resolve())
        return f"{_slug(path.resolve().name)}-{hashlib.sha256(where.encode()).hexdigest()[:8]}"
    # a Hub spec that is not on disk (yet): org/name[@revision]
    return _slug(str(model).split("@", 1)[0].rstrip("/").split("/")[-1])


def store_dir(
    model_dir: str | Path, root: str | Path | None = None, tp: int | None = None, fmt: str | None = None
) -> Path:
    """Where a resolved model directory's store for TP degree `tp` and tile format `fmt` is (or goes): the model's
    first store is `<root>/<model-name>/weights`; a store for another TP degree or format lives beside it as
    `weights-tp<N>-<fmt>`, so that switching degree or format builds its own store once and never replaces one
    (V4.1-Flash's takes tens of minutes). tp or fmt None: `weights`, whatever it holds."""
    first = _first_store(model_dir, root)
    if tp is None or fmt is None:
        return first
    beside = first.with_name(f"{first.name}-tp{tp}-{fmt}")
    try:
        have = StoreManifest.read_identity(first)
    except StoreCorrupt:
        return first  # where opening or building it says so
    if have is None:
        return beside if (beside / MANIFEST).is_file() else first
    return first if (have.get("tp"), have.get("tile_format")) == (tp, fmt) else beside


def model_stores(model_dir: str | Path, root: str | Path | None = None) -> list[Path]:
    """The directories a model's stores may be in (store_dir's naming): the first one, then those beside it."""
    first = _first_store(model_dir, root)
    return [first, *sorted(first.parent.glob(first.name + "-tp*"))]


def _first_store(model_dir: str | Path, root: str | Path | None) -> Path:
    return cache_root(root) / model_name(model_dir) / "weights"


def fingerprint(model_dir: str | Path) -> str:
    """Revision of a local model directory: sha256 of config.json, the index, and every shard's name, size and
    sampled bytes (its safetensors header and 16 evenly spread 4 KiB blocks). A cheap stand-in for hashing
    hundreds of GB: any re-quantization or re-generation changes the samples, a plain copy keeps them."""
    d = Path(model_dir)
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        p = d / name
        h.update(name.encode() + b"\0" + (p.read_bytes() if p.is_file() else b"-") + b"\0")
    for p in sorted(d.glob("*.safetensors")):
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with p.open("rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(head + f.read(min(n, 1 << 20)))
            for k in range(16):
                f.seek(size * k // 16)
                h.update(f.read(4096))
    return "sha256:" + h.hexdigest()


def model_identity(model_dir: str | Path) -> tuple[str, str]:
    """(model id, revision) of a resolved model directory: the repo id and commit of a Hub cache snapshot, else
    the absolute path and a content fingerprint."""
    path = Path(model_dir)
    hub = _hub_parts(path)
    if hub is not None:
        return hub
    return str(path.resolve()), fingerprint(path)


# ---------------------------------------------------------------------------------------------- geometry


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class Part:
    """One packed matrix inside a rank block."""

    name: str  # w1, w3, w2
    shape: tuple[int, int]  # logical rows, cols of this rank's shard
    tiles: tuple[int, int]  # tile rows, tile cols after padding to 32
    offset: int  # bytes from the start of the rank block
    nbytes: int

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "tiles": list(self.tiles), "offset": self.offset,
                "bytes": self.nbytes}  # fmt: skip


@dataclass(frozen=True)
class Geometry:
    """Byte layout of every record of a store: the same for all its layers (DSpark stages included)."""

    tp: int
    tile_format: str
    hidden: int
    inter: int
    align: int = ALIGN

    def __post_init__(self):
        if self.tile_format not in TILE_FORMATS:
            raise StoreMismatch(f"unknown tile format {self.tile_format!r} (expected one of {', '.join(TILE_FORMATS)})")
        if self.tp < 1 or self.inter % self.tp:
            raise StoreMismatch(
                f"TP degree {self.tp} does not divide moe_intermediate_size {self.inter}; use a divisor (1, 2, 4, ...)"
            )
        if self.hidden % TILE or self.hidden <= 0:
            raise StoreMismatch(f"hidden_size {self.hidden} is not a positive multiple of {TILE}")

    @property
    def shard_inter(self) -> int:
        """Intermediate features per rank."""
        return self.inter // self.tp

    def rank_slice(self, rank: int) -> tuple[int, int]:
        """Intermediate feature range [start, stop) of a rank."""
        if not 0 <= rank < self.tp:
            raise IndexError(f"rank {rank} out of range 0..{self.tp - 1}")
        return rank * self.shard_inter, (rank + 1) * self.shard_inter

    @cached_property  # read on every expert lookup: computed once
    def parts(self) -> tuple[Part, Part, Part]:
        i, h = self.shard_inter, self.hidden
        out, off = [], 0
        for name, shape in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i))):
            n = bfp.packed_size(shape, self.tile_format)
            out.append(Part(name, shape, (-(-shape[0] // TILE), -(-shape[1] // TILE)), off, n))
            off += n
        return tuple(out)

    @cached_property
    def shard_bytes(self) -> int:
        """Packed bytes of one rank's shard of one expert (w1, w3, w2 together), without the padding."""
        return sum(p.nbytes for p in self.parts)

    @cached_property
    def stride(self) -> int:
        """Bytes from one rank block to the next."""
        return align_up(self.shard_bytes, self.align)

    @cached_property
    def record_bytes(self) -> int:
        return self.tp * self.stride

    @property
    def search(self) -> bool:
        """Whether face rows take the lower-error shared exponent (formats.bfp `search`): bfp4_b only, where it
        takes FP4 experts from about 12 % to 7 % relative weight error; bfp8_b holds FP4 exactly already."""
        return self.tile_format == "bfp4_b"

    def pack(self, w) -> np.ndarray:
        """A float matrix (slice) -> its tiles as this store holds them."""
        return bfp.pack(w, self.tile_format, search=self.search)

    def w2_values(self, w2):
        """The values w2's rank shards are packed from. Where a face row (16 columns share one exponent) would
        straddle two ranks, shards packed alone would round differently at each TP degree: the whole matrix is
        rounded once instead, so every degree holds exactly the TP-1 values (re-packing them is exact)."""
        if self.shard_inter % FACE == 0:
            return w2
        return bfp.unpack(self.pack(w2), self.tile_format, tuple(w2.shape))

    def to_json(self) -> dict:
        return {
            "hidden_size": self.hidden,
            "moe_intermediate_size": self.inter,
            "alignment": self.align,
            "shard_bytes": self.shard_bytes,
            "stride": self.stride,
            "record_bytes": self.record_bytes,
            "parts": [p.to_json() for p in self.parts],
        }


def layer_file(prefix: str) -> str:
    """`layers.3.experts.bin`, `mtp.0.experts.bin`: named like the checkpoint tensors they come from."""
    return f"{prefix}.experts.bin"


# ---------------------------------------------------------------------------------------------- manifest


@dataclass
class LayerEntry:
    layer: int  # layer id; DSpark stage k is num_hidden_layers + k
    prefix: str  # checkpoint prefix: layers.{i} / mtp.{k}
    file: str
    experts: int
    nbytes: int  # file size
    crc32: list[list[int]]  # [expert][rank]: crc32 of each rank block

    def to_json(self, record_bytes: int) -> dict:
        head = {"layer": self.layer, "prefix": self.prefix, "file": self.file, "experts": self.experts,
                "bytes": self.nbytes}  # fmt: skip
        recs = [{"expert": e, "offset": e * record_bytes, "crc32": [f"{c:08x}" for c in cs]}
                for e, cs in enumerate(self.crc32)]  # fmt: skip
        return {**head, "records": recs}


@dataclass
class StoreManifest:
    """manifest.json: identity, geometry, and per layer its file, size, and per record offset and checksums."""

    model_id: str
    revision: str
    model_name: str
    geometry: Geometry
    layers: dict[int, LayerEntry] = field(default_factory=dict)  # finished layers only
    expected_layers: list[int] = field(default_factory=list)  # every MoE layer of the model
    format_version: int = FORMAT_VERSION
    # what the build that returned this manifest did (not stored): built / kept layer ids, bytes, seconds
    stats: dict = field(default_factory=dict, compare=False)

    @property
    def tp(self) -> int:
        return self.geometry.tp

    @property
    def tile_format(self) -> str:
        return self.geometry.tile_format

    @property
    def complete(self) -> bool:
        return set(self.layers) == set(self.expected_layers)

    def identity(self) -> dict:
        return {k: getattr(self, k) for k in IDENTITY_KEYS}

    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.layers.values())

    # ---- JSON (one record per line: readable, and diffs stay small)
    def to_json(self) -> str:
        head = {
            "format": FORMAT,
            **self.identity(),
            "model_name": self.model_name,
            "checksum": CHECKSUM,
            "complete": self.complete,
            "expected_layers": sorted(self.expected_layers),
            **self.geometry.to_json(),
        }
        lines = []
        for k, v in head.items():
            if k == "parts":
                inner = ",\n".join("    " + json.dumps(p) for p in v)
                lines.append(f'  "{k}": [\n{inner}\n  ]')
            else:
                lines.append(f"  {json.dumps(k)}: {json.dumps(v)}")
        text = "{\n" + ",\n".join(lines) + ',\n  "layers": ['
        rb = self.geometry.record_bytes
        entries = []
        for lid in sorted(self.layers):
            d = self.layers[lid].to_json(rb)
            recs = d.pop("records")
            body = ",\n".join("      " + json.dumps(r) for r in recs)
            entries.append("\n    " + json.dumps(d)[:-1] + ', "records": [\n' + body + "\n    ]}")
        return text + ",".join(entries) + ("\n  " if entries else "") + "]\n}\n"

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST) -> StoreManifest:
        try:
            d = json.loads(text)
            if d.get("format") != FORMAT:
                raise StoreCorrupt(f"{where} is not a dsflash expert store manifest (format {d.get('format')!r})")
            version = d["format_version"]
            if version != FORMAT_VERSION:
                raise StoreMismatch(
                    f"{where} has store format version {version!r}, this dsflash reads {FORMAT_VERSION}"
                )
            geom = Geometry(int(d["tp"]), d["tile_format"], int(d["hidden_size"]), int(d["moe_intermediate_size"]),
                            int(d["alignment"]))  # fmt: skip
            if geom.to_json() != {k: d[k] for k in geom.to_json()}:
                raise StoreCorrupt(f"{where}: the stated record layout does not follow from its shapes and format")
            layers = {}
            for L in d["layers"]:
                crcs = [[int(c, 16) for c in r["crc32"]] for r in L["records"]]
                entry = LayerEntry(int(L["layer"]), L["prefix"], L["file"], int(L["experts"]), int(L["bytes"]), crcs)
                _check_entry(entry, L["records"], geom, where)
                layers[entry.layer] = entry
            return cls(d["model_id"], d["revision"], d["model_name"], geom, layers, list(d["expected_layers"]), version)
        except (StoreCorrupt, StoreMismatch):
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StoreCorrupt(f"{where} is damaged ({type(e).__name__}: {e}); rebuild the store") from None

    @classmethod
    def read(cls, directory: Path) -> StoreManifest | None:
        path = Path(directory) / MANIFEST
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            raise StoreCorrupt(f"cannot read {path}: {e}") from None
        return cls.from_json(text, str(path))

    @staticmethod
    def read_identity(directory: Path) -> dict | None:
        """The identity keys of the manifest in a directory, whatever its format version; None without one."""
        path = Path(directory) / MANIFEST
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreCorrupt(f"{path} is damaged ({e}); rebuild the store") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise StoreCorrupt(f"{path} is not a dsflash expert store manifest")
        return {k: d.get(k) for k in IDENTITY_KEYS}

    def write(self, directory: Path) -> None:
        """Atomically: temporary file, fsync, rename, fsync of the directory."""
        write_atomic(Path(directory) / MANIFEST, self.to_json().encode())


def _check_entry(e: LayerEntry, records: list, geom: Geometry, where: str) -> None:
    rb = geom.record_bytes
    bad = None
    if e.nbytes != e.experts * rb or len(records) != e.experts:
        bad = f"size {e.nbytes} / {len(records)} records for {e.experts} experts of {rb} bytes"
    elif any(r["offset"] != i * rb or len(r["crc32"]) != geom.tp for i, r in enumerate(records)):
        bad = "record offsets or checksum counts do not follow the layout"
    elif "/" in e.file or e.file.startswith("."):
        bad = f"file name {e.file!r}"
    if bad:
        raise StoreCorrupt(f"{where}: layer {e.layer} ({e.prefix}) entry is inconsistent: {bad}")


def differences(have: dict, want: dict) -> list[str]:
    """Human-readable identity differences: 'TP degree 4 (store) vs 2 (requested)'."""
    return [
        f"{IDENTITY_WORDS[k]} {have.get(k)!r} (store) vs {want.get(k)!r} (requested)"
        for k in IDENTITY_KEYS
        if have.get(k) != want.get(k)
    ]


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + PARTIAL)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def geometry_for(config, tp: int, tile_format: str) -> Geometry:
    """Record layout of a ModelConfig's routed experts at a TP degree and tile format."""
    return Geometry(int(tp), tile_format, config.hidden_size, config.moe_intermediate_size)


def moe_layers(config) -> list:
    """LayerSpecs that own routed experts: every backbone block and DSpark stage."""
    return [spec for spec in config.layers() if spec.n_experts > 0]


def store_bytes(config, tile_format: str) -> int:
    """Bytes of a model's whole expert store in a tile format (TP 1; other degrees differ only by alignment)."""
    return geometry_for(config, 1, tile_format).record_bytes * sum(spec.n_experts for spec in moe_layers(config))


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_tile_format(requested: str, config, memory: int | None = None) -> str:
    """`auto` -> bfp8_b where the whole bfp8_b store fits in RAM_SHARE of the host's memory (small models: FP4
    experts exactly, no quantization beyond the checkpoint's), else bfp4_b (V4.1-Flash: 590 GB at bfp8_b, 313 GB at
    bfp4_b). Any other value is returned as it is."""
    if requested != AUTO:
        return requested
    memory = host_memory() if memory is None else memory
    return "bfp8_b" if store_bytes(config, "bfp8_b") <= RAM_SHARE * memory else "bfp4_b"


def store_identity(ckpt, tp: int, fmt: str) -> tuple[dict, Geometry, str]:
    """(the identity a store for `ckpt` at this TP degree and format must have, its record geometry, its name)"""
    model_id, revision = model_identity(ckpt.path)
    geom = geometry_for(ckpt.config, tp, fmt)
    want = {"format_version": FORMAT_VERSION, "model_id": model_id, "revision": revision, "tp": geom.tp,
            "tile_format": fmt}  # fmt: skip
    return want, geom, model_name(ckpt.path)


def layout_differences(m: StoreManifest, geom: Geometry, specs) -> str:
    if m.geometry != geom:
        return f"record layout {m.geometry.to_json()} (store) vs {geom.to_json()} (model)"
    if sorted(m.expected_layers) != [s.layer_id for s in specs]:
        return f"MoE layers {sorted(m.expected_layers)} (store) vs {[s.layer_id for s in specs]} (model)"
    experts = {s.layer_id: s.n_experts for s in specs}
    for lid, e in m.layers.items():
        if e.experts != experts[lid]:
            return f"layer {lid}: {e.experts} experts (store) vs {experts[lid]} (model)"
    return ""


def mismatch_message(directory: Path, diffs: list[str], action: str) -> str:
    fix = (
        "pass --rebuild to replace it" if action == "build" else "rebuild it with `dsflash store build MODEL --rebuild`"
    )
    return (
        f"the expert store in {directory} was built for something else: {'; '.join(diffs)}; {fix} "
        "(or use another --cache-dir)"
    )
