"""Boot a model for serving, phase by phase: resolve -> inventory -> expert store -> dense weights -> slots and
caches -> warm-up. Each phase reports one progress row; the backend (what computes tokens) fills the middle three.

`make_backend` is the one place that decides which Runner serves: the engine (expert store + slot LRU + TP
ranks) or the CPU reference (every expert resident in RAM, the quality baseline).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from dsflash.errors import ConfigError
from dsflash.service.catalog import ModelChoice, cache_root
from dsflash.service.files import ModelFiles


@dataclass(frozen=True)
class BootOptions:
    backend: str = "engine"
    tp: int = 1
    expert_slots: int | None = None
    expert_format: str = "auto"  # bfp4_b | bfp8_b | auto (store.layout.resolve_tile_format, once the model is known)
    device: str = "auto"  # engine: cpu | cuda | auto (runtime.rank.resolve_device)
    cuda_graph: bool = True  # engine on CUDA: the decode step as CUDA graphs (runtime/cuda_graph.py)
    max_queue: int = 64
    max_model_len: int | None = None  # overrides the profile's context
    cache_dir: str | None = None
    rebuild_store: bool = False  # replace a store built for something else (the embedded model's always is)
    prefill_chunk: int = 512
    threads: int | None = None  # torch intra-op threads; None: chosen by the backend
    record_routing: str | None = None  # engine: append every MoE call's routing to this JSON-lines file


@dataclass
class Row:
    """One progress row: key, label, state (run | done | skip | fail), detail, seconds."""

    key: str
    label: str
    state: str = "run"
    detail: str = ""
    seconds: float = 0.0


Report = Callable[[Row], None]


@dataclass
class Booted:
    """What boot produced: an engine with its runner, the tokenizer and everything the ready card shows."""

    choice: ModelChoice
    files: ModelFiles
    engine: object
    max_len: int
    backend: Backend
    rows: list[Row] = field(default_factory=list)

    @property
    def tokenizer(self):
        return self.files.tokenizer

    def close(self) -> None:
        """Stop the engine thread, then the backend (TP worker processes, open store files)."""
        self.engine.close()
        self.backend.close()


class Backend(Protocol):
    """What a serving backend does in the boot phases; each method returns the row's (state,) detail text."""

    name: str

    def build_store(self, files: ModelFiles, cache: Path, rebuild: bool) -> str: ...

    def load_dense(self, files: ModelFiles, cache: Path, max_len: int) -> str: ...

    def allocate(self, max_len: int) -> str: ...

    def runner(self): ...

    def close(self) -> None: ...


def _threads(opts: BootOptions, files: ModelFiles) -> int | None:
    if opts.threads is None and files.ckpt.config.hidden_size <= 256:
        return 1  # a tiny model's ops are too small to split; extra threads only add contention
    return opts.threads


def _build_store(files: ModelFiles, cache: Path, tp: int, fmt: str, rebuild: bool) -> str:
    """Build the store on first boot (the packer self-checks first), reuse it after."""
    import sys

    from dsflash.errors import StoreMismatch
    from dsflash.store.build import build_store

    progress = sys.stderr.isatty()
    try:
        m = build_store(files.ckpt, cache, tp=tp, fmt=fmt, progress=progress)
    except StoreMismatch:
        if not rebuild:
            raise
        m = build_store(files.ckpt, cache, tp=tp, fmt=fmt, progress=progress, rebuild=True)
    st = m.stats
    what = "built after the packer self-check" if st["reason"] == "new" else f"rebuilt ({st['reason']})"
    what = what if st["built"] else "reused"
    return f"{what}: {len(m.layers)} MoE layers, {m.total_bytes() / 1e6:,.1f} MB {fmt}, TP {tp}"


class ReferenceBackend:
    """The CPU reference: fp32 dense weights, every routed expert resident in RAM, one process."""

    name = "reference (CPU, fp32, experts resident)"

    def __init__(self, opts: BootOptions):
        if opts.tp != 1:
            raise ConfigError(f"--tp {opts.tp}: the reference backend runs in one CPU process; use --tp 1")
        if opts.record_routing:
            raise ConfigError("--record-routing needs the engine backend (it records the expert slot path)")
        self.opts = opts
        self.loaded = None
        self._runner = None

    def build_store(self, files: ModelFiles, cache: Path, rebuild: bool) -> str:
        note = "; --expert-slots is ignored" if self.opts.expert_slots is not None else ""
        return f"skipped: the reference keeps every expert resident{note}"

    def load_dense(self, files: ModelFiles, cache: Path, max_len: int) -> str:
        import torch

        from dsflash.runtime.loader import load_reference

        threads = _threads(self.opts, files)
        if threads:
            torch.set_num_threads(threads)
        # DSpark (speculative decoding) is off in serving: it loses when experts are the bottleneck (seed.md)
        self.loaded = load_reference(files.ckpt, files.token_map, dspark=False)
        params = sum(p.numel() for p in self.loaded.model.parameters())
        return f"{params / 1e6:,.1f} M dense parameters on the CPU (fp32), {torch.get_num_threads()} thread(s)"

    def allocate(self, max_len: int) -> str:
        from dsflash.runtime.reference_runner import ModelRunner

        self._runner = ModelRunner(self.loaded, max_len)
        return f"decode state for {max_len:,} tokens; no expert slots (experts resident)"

    def runner(self):
        return self._runner

    def close(self) -> None:
        pass


class EngineBackend:
    """The engine: dense weights per TP rank, routed experts streamed from the store into an LRU of expert slots."""

    def __init__(self, opts: BootOptions):
        if opts.tp < 1:
            raise ConfigError(f"--tp must be at least 1, got {opts.tp}")
        if opts.expert_slots is not None and opts.expert_slots < 1:
            raise ConfigError(f"--expert-slots must be at least 1, got {opts.expert_slots}")
        from dsflash.runtime.rank import resolve_device

        self.opts, self.fmt, self.rebuild = opts, opts.expert_format, False
        self.where = resolve_device(opts.device).upper()
        self._runner = None

    @property
    def name(self) -> str:
        return f"engine (expert slot LRU over the {self.fmt} store, TP {self.opts.tp}, {self.where} device)"

    def build_store(self, files: ModelFiles, cache: Path, rebuild: bool) -> str:
        from dsflash.store.layout import resolve_tile_format

        self.fmt = resolve_tile_format(self.opts.expert_format, files.ckpt.config)
        self.rebuild = rebuild  # the other hosts' ranks (torchrun) decide the same for their copies
        return _build_store(files, cache, self.opts.tp, self.fmt, rebuild)

    def load_dense(self, files: ModelFiles, cache: Path, max_len: int) -> str:
        from dsflash.runtime.rank import EngineOptions
        from dsflash.runtime.workers import TPRunner

        eng = EngineOptions(
            str(files.path),
            max_len,
            expert_slots=self.opts.expert_slots,
            expert_format=self.fmt,
            cache_dir=str(cache),
            threads=_threads(self.opts, files),
            record_routing=self.opts.record_routing,
            device=self.opts.device,
            cuda_graph=self.opts.cuda_graph,
            rebuild_store=self.rebuild,
        )
        cfg = files.ckpt.config
        # one call builds every rank: its dense shard, its store shard's slot pool, its decode state
        runner = TPRunner(eng, self.opts.tp, files.token_map, cfg.vocab_size)
        self._runner = _SlotCounters(runner, self.opts.tp)
        self.slots = runner.rank0.experts.pool.n_slots  # the request, clipped to the model and to memory
        return f"{self.opts.tp} rank(s) hold their dense shard ({eng.dense_format}); the store is open"

    def allocate(self, max_len: int) -> str:
        return f"{self.slots:,} expert slots per rank; decode state for {max_len:,} tokens"

    def runner(self):
        return self._runner

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()


class _SlotCounters:
    """The TP runner, with its slot counters named as the service reads them (rank 0 counts for every rank: slot
    choices are a function of the routing, so all ranks stream their equal shards of the same experts)."""

    def __init__(self, runner, world: int):
        self.inner, self.world = runner, world
        self.max_len, self.vocab_size = runner.max_len, runner.vocab_size

    def reset(self) -> None:
        self.inner.reset()

    def forward(self, tokens, start_pos: int, all_logits: bool):
        return self.inner.forward(tokens, start_pos, all_logits)

    def counters(self) -> dict:
        c = self.inner.counters()
        return {
            "expert_hits": c["hits"],
            "expert_misses": c["misses"],
            "bytes_streamed": c["bytes_copied"] * self.world,
        }

    def close(self) -> None:
        self.inner.close()


BACKENDS = {"engine": EngineBackend, "reference": ReferenceBackend}


def make_backend(opts: BootOptions) -> Backend:
    """The one switch between backends."""
    if opts.backend not in BACKENDS:
        raise ConfigError(f"unknown backend {opts.backend!r} (available: {', '.join(BACKENDS)})")
    return BACKENDS[opts.backend](opts)


@dataclass
class _Ctx:
    choice: ModelChoice
    opts: BootOptions
    backend: Backend
    path: Path | None = None
    files: ModelFiles | None = None
    engine: object = None
    max_len: int = 0


def _resolve(ctx: _Ctx) -> str:
    if ctx.choice.embedded:
        from dsflash.service.embedded import ensure_embedded

        emb = ensure_embedded(cache_root(ctx.opts.cache_dir) / "embedded", ctx.choice.slug)
        ctx.path = emb.path
        verb = "generated" if emb.generated else "reused"
        return f"{verb} {emb.path} ({emb.nbytes / 1e6:.0f} MB)"
    from dsflash.checkpoint.source import resolve_model_dir

    ctx.path = resolve_model_dir(ctx.choice.source)
    return str(ctx.path)


def _inventory(ctx: _Ctx) -> str:
    from dsflash.service.files import open_dir

    ctx.files = open_dir(ctx.path)
    cfg, tok = ctx.files.ckpt.config, ctx.files.tokenizer
    if tok.vocab_size > cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} ids but the model only {cfg.vocab_size}")
    n = len(ctx.files.ckpt.names())
    return f"{n:,} tensors match config.json; tokenizer with {tok.vocab_size:,} ids"


def _store(ctx: _Ctx) -> str:
    # a store of an older format of our own generated model is rebuilt; a real model's only with --rebuild (it may
    # take tens of minutes), else it is refused with that fix
    rebuild = ctx.choice.embedded or ctx.opts.rebuild_store
    return ctx.backend.build_store(ctx.files, cache_root(ctx.opts.cache_dir), rebuild=rebuild)


def _dense(ctx: _Ctx) -> str:
    return ctx.backend.load_dense(ctx.files, cache_root(ctx.opts.cache_dir), ctx.max_len)


def _allocate(ctx: _Ctx) -> str:
    return ctx.backend.allocate(ctx.max_len)


def _warm(ctx: _Ctx) -> str:
    from dsflash.runtime.engine import Engine

    runner = ctx.backend.runner()
    tok = ctx.files.tokenizer
    t0 = time.perf_counter()
    warm = [tok.bos_id or 0, *tok.encode("Hello")][: max(1, ctx.max_len - 2)]
    last = runner.forward(warm, 0, False)
    runner.forward([int(last[-1].argmax())], len(warm), False)
    runner.reset()
    step = time.perf_counter() - t0
    ctx.engine = Engine(runner, tok.eos_ids, max_queue=ctx.opts.max_queue, prefill_chunk=ctx.opts.prefill_chunk)
    ctx.engine.start()
    return f"prefill + one decode step in {step * 1000:.0f} ms; engine thread started"


# the boot pipeline; a backend that needs more phases (e.g. a packer self-check) adds rows here
PHASES: list[tuple[str, str, Callable[[_Ctx], str]]] = [
    ("resolve", "checkpoint", _resolve),
    ("inventory", "inventory", _inventory),
    ("store", "expert store", _store),
    ("dense", "dense weights", _dense),
    ("slots", "slots and caches", _allocate),
    ("warmup", "warm-up", _warm),
]


def boot(choice: ModelChoice, opts: BootOptions, report: Report = lambda row: None, backend=None) -> Booted:
    """Run every phase in order, reporting each row as it starts and ends; an error ends boot with a failed row."""
    ctx = _Ctx(choice, opts, backend or make_backend(opts), max_len=opts.max_model_len or choice.profile.context)
    rows = []
    for key, label, phase in PHASES:
        row = Row(key, label)
        rows.append(row)
        report(row)
        t0 = time.perf_counter()
        try:
            out = phase(ctx)
        except BaseException as e:
            row.state, row.detail, row.seconds = "fail", str(e) or type(e).__name__, time.perf_counter() - t0
            report(row)
            raise
        row.state, row.detail = "done", out
        row.seconds = time.perf_counter() - t0
        report(row)
    return Booted(choice, ctx.files, ctx.engine, ctx.max_len, ctx.backend, rows)
