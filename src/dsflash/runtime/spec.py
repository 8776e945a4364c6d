"""The engine's options, defined once: `EngineSpec` holds every choice serve, gates, logits and the benchmarks make
about how the engine runs a model, each with its one default, and `resolve` is the one function that turns the
"auto" / None choices into what this machine and this model get. A resolved spec is what every rank builds from
(picklable: it travels to spawned and torchrun ranks as it is)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

from dsflash.errors import ConfigError

log = logging.getLogger(__name__)

AUTO = "auto"
EXPERT_FORMATS = (AUTO, "bfp4_b", "bfp8_b")
DENSE_FORMATS = ("fp8", "bf16", "fp32")
DEVICES = (AUTO, "cpu", "cuda")
PREFILL_MATMULS = (AUTO, "bf16", "fp32", "bf16x2")
SLOT_FILLS = ("map", "copy")
DEFAULT_SLOTS = 4500  # the reference box's pool
TINY_HIDDEN = 256  # at or below this width a model's ops are too small to split over threads


@dataclass(frozen=True)
class EngineSpec:
    """How the engine runs a model. Unresolved fields ("auto", None) are decided by `resolve`."""

    tp: int = 1  # tensor-parallel degree (ranks)
    # expert slots per rank; None: DEFAULT_SLOTS, clipped to the model and shrunk to fit memory (tp.rank.slot_count)
    expert_slots: int | None = None
    # tile format of the routed experts: bfp8_b holds FP4 experts exactly at twice the bytes, bfp4_b is lossy;
    # auto: bfp8_b where the whole store fits in a quarter of the host's memory (store.layout.resolve_tile_format)
    expert_format: str = AUTO
    dense_format: str = "fp8"  # fp8 (where the checkpoint is FP8, bf16 elsewhere) | bf16 | fp32 (the reference's)
    # where a rank computes: cpu, cuda (rank r on GPU r % count), or auto (cuda where torch sees a GPU)
    device: str = AUTO
    # prefill products: fp32 (the BLAS; exact products), bf16x2 (AMX with x as two bf16 terms: ~16 bits of x, fp32
    # sums in a fixed order), bf16 (the BLAS in bf16 where a rank computes whole outputs: x and outputs rounded to
    # bf16, and the rounding depends on the BLAS blocking, so TP degrees differ by a bf16 ulp); auto: bf16x2 where
    # the CPU has AMX, else fp32. fp32 and bf16x2 keep TP degrees equal to fp32 noise.
    prefill_matmul: str = AUTO
    prefill_chunk: int = 512  # prompt tokens per prefill pass (each pass streams the experts it touches once)
    # sequences decoded together, one token each per step (1: one at a time, as the engine always did); every rank
    # holds a decode state per sequence
    max_num_seqs: int = 1
    # tokens one engine step may compute with several sequences running: the decode tokens plus the prefill chunk
    # that joins between two decode steps; None: prefill_chunk + max_num_seqs (prefill passes as long as alone)
    max_num_batched_tokens: int | None = None
    # while sequences decode, a step's prefill share is cut so the step takes about this many times its decode call
    # (the running streams' gaps stay short while a long prompt is admitted, which then takes longer); 0: the token
    # budget alone
    prefill_step_factor: float = 2.0
    threads: int | None = None  # torch / kernel threads per rank; None: 1 for a tiny model, else cores / local ranks
    qat: bool = True  # the model's activation fake-quant points (DeepSeek's inference code has them on)
    dspark: bool = False  # load the DSpark draft stages (speculative needs them: it turns this on)
    # speculative decoding: None (off) or "dspark" (the model's DSpark head drafts, one target forward verifies;
    # runtime/scheduler/speculative.py); one sequence at a time
    speculative: str | None = None
    num_speculative_tokens: int | None = None  # drafts per verify; None: the head's block size
    # the head's FP8 screen for decode (runtime.cpu.dense.ScreenedHead) under dense_format fp8: None where the head
    # is large enough to pay (dense.SCREEN_HEAD_MIN_BYTES a rank), True / False to force it
    screen_head: bool | None = None
    # how a CPU rank fills a slot on a miss: map (the store's page-cache pages mapped into the slot,
    # runtime/experts/filemap.py; copies where the system cannot map) or copy (preadv into the slot's own memory)
    slot_fill: str = "map"
    # a CUDA rank captures its decode step as CUDA graphs at start (runtime/cuda/graph.py); False keeps it eager
    # (vLLM's --enforce-eager). Ranks that reach each other through host copies (gloo between GPUs) stay eager.
    cuda_graph: bool = True
    record_routing: str | None = None  # JSON-lines file for every MoE call's routing (rank 0; experts.routing_log)
    cache_dir: str | None = None  # the cache root (dsflash.paths.cache_root): expert stores live under it
    # replace a store from another revision or store version (torchrun: the other hosts' first ranks build theirs)
    rebuild_store: bool = False
    # prefix reuse (runtime/prefix): snapshots of the decode state by the tokens they hold; a prompt that extends
    # one prefills only the rest
    prefix_cache: bool = True
    prefix_cache_gb: float | None = None  # host memory for snapshots, every rank's together; None: default_prefix_gb()
    prefix_cache_dir: str | None = None  # also keep snapshots on disk here: a restarted server reuses them
    prefix_cache_disk_gb: float = 32.0  # the most bytes of snapshot files in prefix_cache_dir

    def __post_init__(self):
        if type(self.tp) is not int or self.tp < 1:
            raise ConfigError(f"--tp must be a positive integer, got {self.tp}")
        if self.expert_slots is not None and self.expert_slots < 1:
            raise ConfigError(f"--expert-slots must be at least 1, got {self.expert_slots}")
        if self.prefill_chunk < 1:
            raise ConfigError("--prefill-chunk must be >= 1")
        if type(self.max_num_seqs) is not int or self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be a positive integer, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= self.max_num_seqs:
            raise ConfigError(
                f"--max-num-batched-tokens {self.max_num_batched_tokens} must exceed --max-num-seqs "
                f"{self.max_num_seqs}: a step's budget holds every running sequence's token and some prefill"
            )
        if not (self.prefill_step_factor == 0 or self.prefill_step_factor > 1):
            raise ConfigError(f"--prefill-step-factor must be 0 (off) or above 1, got {self.prefill_step_factor}")
        if (self.prefix_cache_gb is not None and self.prefix_cache_gb < 0) or self.prefix_cache_disk_gb < 0:
            raise ConfigError("--prefix-cache-gb and --prefix-cache-disk-gb must be >= 0")
        if self.speculative not in (None, "dspark"):
            raise ConfigError(f"--speculative {self.speculative!r}: the only method is dspark")
        if self.speculative and not self.dspark:
            object.__setattr__(self, "dspark", True)  # the draft head's stages must be loaded
        if self.num_speculative_tokens is not None and (
            self.speculative is None or type(self.num_speculative_tokens) is not int or self.num_speculative_tokens < 1
        ):
            raise ConfigError("--num-speculative-tokens needs --speculative dspark and a positive integer")
        if self.speculative and self.max_num_seqs > 1:
            raise ConfigError(
                f"--speculative dspark runs one sequence at a time; it cannot be combined with --max-num-seqs "
                f"{self.max_num_seqs}"
            )
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {self.threads}")
        for name, value, choices in (
            ("expert format", self.expert_format, EXPERT_FORMATS),
            ("dense format", self.dense_format, DENSE_FORMATS),
            ("device", self.device, DEVICES),
            ("prefill matmul", self.prefill_matmul, PREFILL_MATMULS),
            ("slot fill", self.slot_fill, SLOT_FILLS),
        ):
            if value not in choices:
                raise ConfigError(f"{name} {value!r}: choose one of {', '.join(choices)}")

    @property
    def batched_tokens(self) -> int:
        """max_num_batched_tokens with its default applied."""
        n = self.max_num_batched_tokens
        return n if n is not None else self.prefill_chunk + self.max_num_seqs

    @property
    def resolved(self) -> bool:
        return AUTO not in (self.expert_format, self.device, self.prefill_matmul) and self.threads is not None


def resolve(spec: EngineSpec, config=None, memory: int | None = None) -> EngineSpec:
    """The one place where "auto" and None become concrete: for this machine the device and the prefill products,
    and, given the model (`config`: its ModelConfig), the expert tile format and the threads per rank. A device this
    machine lacks is refused here, before anything loads (a TP degree the model cannot be split by: check_tp, where
    ranks are built). Resolving a resolved spec changes nothing."""
    from dsflash.runtime.tp.torchrun import local_world
    from dsflash.store.layout import resolve_tile_format

    spec = replace(spec, device=resolve_device(spec.device), prefill_matmul=_prefill_matmul(spec.prefill_matmul))
    if spec.prefix_cache_gb is None:
        spec = replace(spec, prefix_cache_gb=default_prefix_gb())
    if config is None:
        return spec
    threads = spec.threads
    if threads is None:
        tiny = config.hidden_size <= TINY_HIDDEN  # extra threads only add contention there
        threads = 1 if tiny else max(1, (os.cpu_count() or 1) // local_world(spec.tp))
    return replace(spec, expert_format=resolve_tile_format(spec.expert_format, config, memory), threads=threads)


def default_prefix_gb(memory: int | None = None) -> float:
    """Host memory for prefix snapshots: an eighth of the host's, at most 8 GB (a 4k-token V4.1-Flash snapshot is
    ~37 MB: a few hundred turns of agents fit, and slots and page cache keep the rest)."""
    if memory is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return round(min(8e9, memory / 8) / 1e9, 3)


def check_tp(config, world: int) -> None:
    """Refuse a degree the attention cannot be split by (heads are the unit); everything else pads."""
    if world < 1:
        raise ConfigError(f"tensor-parallel degree must be a positive integer, got {world}")
    if config.num_attention_heads % world:
        raise ConfigError(
            f"tensor-parallel degree {world} does not divide this model's {config.num_attention_heads} attention "
            f"heads; use one of {[d for d in (1, 2, 4, 8) if config.num_attention_heads % d == 0]}"
        )


def resolve_device(name: str) -> str:
    """auto -> cuda where torch sees a GPU, else cpu; cuda without a GPU is refused."""
    import torch

    if name not in DEVICES:
        raise ConfigError(f"device {name!r}: choose one of {', '.join(DEVICES)}")
    if name == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this torch build sees no CUDA GPU")
    return name


def _prefill_matmul(mode: str) -> str:
    """auto picks bf16x2 where AMX works, else fp32; bf16x2 without AMX falls back to fp32 with a warning."""
    from dsflash.runtime.cpu import native

    if mode in (AUTO, "bf16x2") and not native.amx_ready():
        if mode == "bf16x2":
            log.warning("prefill matmul bf16x2 needs AMX-BF16 and the native kernels: using fp32")
        return "fp32"
    return "bf16x2" if mode == AUTO else mode
