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
from dsflash.paths import embedded_dir
from dsflash.runtime.spec import EngineSpec
from dsflash.service.api import MAX_TOKENS_DEFAULT
from dsflash.service.catalog import ModelChoice
from dsflash.service.files import ModelFiles


@dataclass(frozen=True)
class BootOptions:
    """What a boot needs beyond the engine's own options (`engine`, runtime.spec.EngineSpec)."""

    engine: EngineSpec = field(default_factory=EngineSpec)
    backend: str = "engine"
    max_queue: int = 64
    max_model_len: int | None = None  # overrides the profile's context
    allow_long_context: bool = False  # a max_model_len past the model's max_position_embeddings is not an error
    max_tokens_default: int = MAX_TOKENS_DEFAULT  # a request without max_tokens gets this many at most
    max_tokens_limit: int | None = None  # the most any request may ask for; None: what the context leaves

    def __post_init__(self):
        if self.max_queue < 0:
            raise ConfigError("--max-queue must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("--max-model-len must be at least 2")
        if self.max_tokens_default < 1 or (self.max_tokens_limit is not None and self.max_tokens_limit < 1):
            raise ConfigError("--max-tokens-default and --max-tokens-limit must be at least 1")
        if self.max_tokens_limit is not None and self.max_tokens_default > self.max_tokens_limit:
            raise ConfigError(
                f"--max-tokens-default {self.max_tokens_default} is above --max-tokens-limit {self.max_tokens_limit}"
            )


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
    opts: BootOptions = field(default_factory=BootOptions)

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

    def build_store(self, files: ModelFiles, rebuild: bool) -> str: ...

    def load_dense(self, files: ModelFiles, max_len: int) -> str: ...

    def allocate(self, max_len: int) -> str: ...

    def runner(self): ...

    def close(self) -> None: ...


class ReferenceBackend:
    """The CPU reference: fp32 dense weights, every routed expert resident in RAM, one process."""

    name = "reference (CPU, fp32, experts resident)"

    def __init__(self, opts: BootOptions):
        spec = opts.engine
        if spec.tp != 1:
            raise ConfigError(f"--tp {spec.tp}: the reference backend runs in one CPU process; use --tp 1")
        if spec.record_routing:
            raise ConfigError("--record-routing needs the engine backend (it records the expert slot path)")
        self.spec = spec
        self.loaded = None
        self._runner = None

    def build_store(self, files: ModelFiles, rebuild: bool) -> str:
        note = "; --expert-slots is ignored" if self.spec.expert_slots is not None else ""
        return f"skipped: the reference keeps every expert resident{note}"

    def load_dense(self, files: ModelFiles, max_len: int) -> str:
        import torch

        from dsflash.runtime.reference.loader import load_reference
        from dsflash.runtime.spec import resolve

        torch.set_num_threads(resolve(self.spec, files.ckpt.config).threads)
        self.path = files.ckpt.path
        # DSpark only with --speculative (off by default: drafts must pay for their verify, docs/performance.md)
        self.loaded = load_reference(files.ckpt, files.token_map, dspark=self.spec.speculative is not None)
        params = sum(p.numel() for p in self.loaded.model.parameters())
        return f"{params / 1e6:,.1f} M dense parameters on the CPU (fp32), {torch.get_num_threads()} thread(s)"

    def allocate(self, max_len: int) -> str:
        from dsflash.runtime.prefix.identity import snapshot_identity
        from dsflash.runtime.reference.runner import ModelRunner

        identity = snapshot_identity(self.path, self.spec, backend="reference")
        self._runner = ModelRunner(self.loaded, max_len, identity, self.spec.prefix_cache_dir,
                                   speculative=self.spec.speculative is not None)  # fmt: skip
        return f"decode state for {max_len:,} tokens; no expert slots (experts resident)"

    def runner(self):
        return self._runner

    def close(self) -> None:
        pass


class EngineBackend:
    """The engine: dense weights per TP rank, routed experts streamed from the store into an LRU of expert slots.
    Its phases are the steps of runtime.tp.launch, the path every engine is built by."""

    def __init__(self, opts: BootOptions):
        from dsflash.runtime.spec import resolve

        self.spec = resolve(opts.engine)  # the machine's part now: a device this machine lacks fails before boot
        self._runner = None

    @property
    def name(self) -> str:
        s = self.spec
        return f"engine (expert slot LRU over the {s.expert_format} store, TP {s.tp}, {s.device.upper()} device)"

    def build_store(self, files: ModelFiles, rebuild: bool) -> str:
        import sys
        from dataclasses import replace

        from dsflash.runtime.spec import resolve
        from dsflash.runtime.tp.launch import prepare_store

        # the model's part of the spec; the other hosts' ranks (torchrun) decide the same rebuild for their copies
        self.spec = resolve(replace(self.spec, rebuild_store=rebuild), files.ckpt.config)
        m = prepare_store(files.ckpt, self.spec, progress=sys.stderr.isatty())
        st, s = m.stats, self.spec
        what = "built after the packer self-check" if st["reason"] == "new" else f"rebuilt ({st['reason']})"
        what = what if st["built"] else "reused"
        return f"{what}: {len(m.layers)} MoE layers, {m.total_bytes() / 1e6:,.1f} MB {s.expert_format}, TP {s.tp}"

    def load_dense(self, files: ModelFiles, max_len: int) -> str:
        from dsflash.runtime.tp.launch import start_dense

        self._runner = start_dense(files.ckpt, files.token_map, max_len, self.spec)
        return f"{self.spec.tp} rank(s) hold their dense shard ({self.spec.dense_format})"

    def allocate(self, max_len: int) -> str:
        from dsflash.runtime.tp.launch import allocate

        allocate(self._runner)
        slots = self._runner.rank0.experts.pool.n_slots  # the request, clipped to the model and to memory
        seqs = self.spec.max_num_seqs
        states = f"decode state for {max_len:,} tokens" + (f" x {seqs} sequences" if seqs > 1 else "")
        return f"{slots:,} expert slots per rank over the open store; {states}"

    def runner(self):
        return self._runner

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()


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

        emb = ensure_embedded(embedded_dir(ctx.opts.engine.cache_dir), ctx.choice.slug)
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
    # only an asked-for length: a profile's context is the bundle's own choice (the directory default, 9216, is past
    # the 4096 many small test configs declare)
    asked = ctx.opts.max_model_len
    if asked is not None and asked > cfg.max_position_embeddings and not ctx.opts.allow_long_context:
        raise ConfigError(
            f"--max-model-len {asked} is beyond this model's max_position_embeddings "
            f"({cfg.max_position_embeddings}); lower it, or pass --allow-long-context to serve it anyway"
        )
    n = len(ctx.files.ckpt.names())
    return f"{n:,} tensors match config.json; tokenizer with {tok.vocab_size:,} ids"


def _store(ctx: _Ctx) -> str:
    # a store built from an older revision or format of our own models (generated, or packaged: a release's new demo
    # weights) is rebuilt; a real model's only with --rebuild (it may take tens of minutes), else it is refused with
    # that fix
    rebuild = ctx.choice.ours or ctx.opts.engine.rebuild_store
    return ctx.backend.build_store(ctx.files, rebuild=rebuild)


def _dense(ctx: _Ctx) -> str:
    return ctx.backend.load_dense(ctx.files, ctx.max_len)


def _allocate(ctx: _Ctx) -> str:
    return ctx.backend.allocate(ctx.max_len)


def _warm(ctx: _Ctx) -> str:
    from dsflash.runtime.prefix.cache import prefix_cache
    from dsflash.runtime.scheduler.batch import BatchEngine
    from dsflash.runtime.scheduler.engine import Engine

    runner = ctx.backend.runner()
    tok = ctx.files.tokenizer
    t0 = time.perf_counter()
    warm = [tok.bos_id or 0, *tok.encode("Hello")][: max(1, ctx.max_len - 2)]
    last = runner.forward(warm, 0, False)
    runner.forward([int(last[-1].argmax())], len(warm), False)
    runner.reset()
    step = time.perf_counter() - t0
    spec = ctx.opts.engine
    prefix = prefix_cache(runner, spec)
    common = dict(max_queue=ctx.opts.max_queue, prefill_chunk=spec.prefill_chunk, prefix=prefix)
    if getattr(runner, "n_seqs", 1) > 1:
        ctx.engine = BatchEngine(runner, tok.eos_ids, max_num_batched_tokens=spec.batched_tokens,
                                 prefill_step_factor=spec.prefill_step_factor, **common)  # fmt: skip
    else:
        k = (spec.num_speculative_tokens or 0) if spec.speculative else None
        ctx.engine = Engine(runner, tok.eos_ids, num_speculative_tokens=k, **common)
    ctx.engine.start()
    return f"prefill + one decode step in {step * 1000:.0f} ms; engine thread started; {_prefix_line(prefix)}"


def _prefix_line(prefix) -> str:
    if prefix is None:
        return "prefix reuse off"
    disk = f", {len(prefix.entries)} snapshot(s) found in {prefix.directory}" if prefix.directory else ""
    return f"prefix reuse on ({prefix.memory_cap / 1e9:.1f} GB of memory{disk})"


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
    return Booted(choice, ctx.files, ctx.engine, ctx.max_len, ctx.backend, rows, opts)
