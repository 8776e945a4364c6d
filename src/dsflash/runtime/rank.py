"""One tensor-parallel rank of the engine: its shard of the dense weights, its slot pool over its store shard,
and its decode state. Every rank runs the same forward calls; only rank 0 samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dsflash.checkpoint.index import Checkpoint
from dsflash.checkpoint.load import load_into
from dsflash.errors import ConfigError
from dsflash.model.block import Embedding
from dsflash.model.engram import EngramTable
from dsflash.model.parallel import TP
from dsflash.model.transformer import Transformer
from dsflash.runtime import fused, native
from dsflash.runtime.cached_experts import CachedExperts
from dsflash.runtime.dense import pack_dense
from dsflash.runtime.device import CpuDevice, Device
from dsflash.runtime.torchrun import local_rank, local_world
from dsflash.store.build import open_store

log = logging.getLogger(__name__)

DENSE_FORMATS = ("fp8", "bf16", "fp32")
MATMUL = {"bf16": torch.bfloat16, "fp32": torch.float32, "bf16x2": native.BF16X2}
PREFILL_MATMUL = ("auto", *MATMUL)


@dataclass(frozen=True)
class EngineOptions:
    """What every rank needs to build its part (picklable: sent to spawned worker ranks)."""

    model_dir: str
    max_len: int
    expert_slots: int | None = None  # None: DEFAULT_SLOTS, shrunk to fit memory (slot_count)
    expert_format: str = "bfp4_b"
    dense_format: str = "fp8"  # fp8 (where the checkpoint is FP8, bf16 elsewhere) | bf16 | fp32 (the reference's)
    cache_dir: str | None = None
    qat: bool = True
    dspark: bool = False
    threads: int | None = None  # torch / kernel threads per rank (default: cores / ranks)
    record_routing: str | None = None  # JSON-lines file for every MoE call's routing (rank 0; runtime.routing_log)
    # prefill products: fp32 (the BLAS; exact products), bf16x2 (AMX with x as two bf16 terms: ~16 bits of x, fp32
    # sums in a fixed order; 1.8-2.7x the fp32 BLAS here), bf16 (the BLAS in bf16 where a rank computes whole
    # outputs: x and outputs rounded to bf16, and the rounding depends on the BLAS blocking, so TP degrees differ by
    # a bf16 ulp); auto: bf16x2 where the CPU has AMX, else fp32. fp32 and bf16x2 keep TP degrees equal to fp32 noise.
    prefill_matmul: str = "auto"
    # where a rank computes: cpu, cuda (rank r on GPU r % count), or auto (cuda where torch sees a GPU)
    device: str = "auto"
    # the head's FP8 screen for decode (runtime.dense.ScreenedHead) under dense_format fp8: None where the head is
    # large enough to pay (dense.SCREEN_HEAD_MIN_BYTES a rank), True / False to force it
    screen_head: bool | None = None
    # replace a store from another revision or store version (torchrun: the other hosts' first ranks build theirs)
    rebuild_store: bool = False
    # how a CPU rank fills a slot on a miss: map (the store's page-cache pages mapped into the slot, runtime/filemap.py;
    # copies where the system cannot map) or copy (preadv into the slot's own memory)
    slot_fill: str = "map"
    # a CUDA rank captures its decode step as CUDA graphs at start (runtime/cuda_graph.py); False keeps it eager
    # (vLLM's --enforce-eager). Ranks that reach each other through host copies (gloo between GPUs) stay eager.
    cuda_graph: bool = True


DEFAULT_SLOTS = 4500  # the reference box's pool


def slot_count(requested: int | None, total: int, slot_bytes: int, budget: int) -> int:
    """Expert slots per rank: the request (None: DEFAULT_SLOTS) clipped to the model's routed experts (there is
    nothing else to cache). The default then shrinks to what `budget` bytes hold; an explicit count that does not
    fit is refused with the count that would, rather than allocated and killed for memory half-way."""
    want = max(1, min(DEFAULT_SLOTS if requested is None else requested, total))
    fit = budget // slot_bytes
    if want <= fit:
        return want
    if requested is None and fit >= 1:
        log.warning("expert slots: %d of %.1f MB fit in the %.1f GB free for them (not %d)", fit, slot_bytes / 1e6,
                    budget / 1e9, want)  # fmt: skip
        return fit
    hint = f"use --expert-slots {fit} or fewer" if fit >= 1 else "free some memory first"
    raise ConfigError(
        f"{want:,} expert slots of {slot_bytes / 1e6:.1f} MB need {want * slot_bytes / 1e9:.1f} GB per rank, but "
        f"{budget / 1e9:.1f} GB are free for slots (after the dense weights and the decode state); {hint}"
    )


def graph_slots_short(n_slots: int, cfg) -> int:
    """The most experts a token activates in one layer where n_slots cannot hold them all at once, else 0."""
    k = max((s.n_active for s in cfg.layers() if not s.is_dspark), default=0)
    return k if n_slots < k else 0


def _ranks_sharing(device: torch.device, tp: TP) -> int:
    """How many of this host's ranks take their slots from the same memory as this one."""
    local = local_world(tp.size)
    if device.type != "cuda":
        return local
    gpus, me = torch.cuda.device_count(), local_rank(tp.rank)
    return sum(1 for r in range(local) if r % gpus == me % gpus)  # rank_device's mapping


def prefill_matmul(mode: str) -> str:
    """The prefill product mode this process runs: auto picks bf16x2 where AMX works, else fp32."""
    if mode not in PREFILL_MATMUL:
        raise ValueError(f"prefill matmul {mode!r}: choose one of {', '.join(PREFILL_MATMUL)}")
    if mode in ("auto", "bf16x2") and not native.amx_ready():
        if mode == "bf16x2":
            log.warning("prefill matmul bf16x2 needs AMX-BF16 and the native kernels: using fp32")
        return "fp32"
    return "bf16x2" if mode == "auto" else mode


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> str:
    """auto -> cuda where torch sees a GPU, else cpu; cuda without a GPU is refused."""
    if name not in DEVICES:
        raise ConfigError(f"device {name!r}: choose one of {', '.join(DEVICES)}")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this torch build sees no CUDA GPU")
    return name


def rank_device(name: str, rank: int) -> torch.device:
    """The torch device of TP rank `rank`: the GPU of its local rank (torchrun's LOCAL_RANK, else the rank)."""
    if resolve_device(name) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", local_rank(rank) % torch.cuda.device_count())


class RankRuntime:
    def __init__(self, opts: EngineOptions, tp: TP, token_map, device: Device | None = None):
        self.opts, self.tp = opts, tp
        ckpt = Checkpoint.open(opts.model_dir)
        cfg = ckpt.config
        self.cfg = cfg
        matmul = MATMUL[prefill_matmul(opts.prefill_matmul)]
        self.device = rank_device(opts.device, tp.rank)
        self.model = Transformer(cfg, tp=tp, token_map=token_map, qat=opts.qat, dspark=opts.dspark)
        load_into(self.model, ckpt)
        on_gpu = self.device.type == "cuda"
        # the decode step as CUDA graphs (runtime/cuda_graph.py); not where collectives go through host copies
        graphs = on_gpu and opts.cuda_graph and not tp.host_staging
        if on_gpu or opts.dense_format != "fp32":
            for m in self.model.modules():  # embedding rows are only gathered: bf16 halves them for free
                if isinstance(m, Embedding):
                    m.weight.data = m.weight.data.bfloat16()
        if on_gpu:
            from dsflash.runtime import cuda, triton_linear

            torch.cuda.set_device(self.device)
            self.dense_bytes = cuda.pack_dense(self.model, self.device, ckpt, opts.dense_format)
            to_device(self.model, self.device)
            device = device or cuda.CudaDevice(self.device)
            triton_linear.warm_up(self.device, ("bf16", "fp8", opts.expert_format), cfg.fp8_block)  # dense, experts
        elif opts.dense_format != "fp32":
            self.dense_bytes = pack_dense(self.model, ckpt, opts.dense_format, matmul, screen_head=opts.screen_head)
        fused.fill(self.model, on_gpu)
        self.model.eval()
        store = open_store(ckpt, opts.cache_dir, tp=tp.size, fmt=opts.expert_format)
        ckpt.close()  # dense weights are copied: drop the checkpoint's mappings (Engram tables stay mapped)
        device = device or CpuDevice(matmul, opts.slot_fill)
        self.routing_log = _routing_log(opts, tp, cfg)
        self.state = self.model.new_state(opts.max_len, device=self.device)  # before the slots take what is left
        # every rank gets the same count: the smallest budget decides (ranks of a host share its memory)
        budget = tp.agree_min(device.slot_budget() // _ranks_sharing(self.device, tp))
        total = sum(s.n_experts for s in cfg.layers())
        n_slots = slot_count(opts.expert_slots, total, store.geometry.stride, budget)  # stride: >= a device's slot
        self.experts = CachedExperts(store, device, n_slots, tp.rank, cfg.swiglu_limit, self.routing_log)
        self.graph = None
        short = graph_slots_short(n_slots, cfg)
        if graphs and short:
            log.warning("decode runs without CUDA graphs: %d expert slots hold fewer than the %d experts a token "
                        "activates, which a captured step needs resident together (eager decode takes them in "
                        "waves)", n_slots, short)  # fmt: skip
            graphs = False
        if graphs:
            from dsflash.runtime.cuda_graph import GraphDecode

            try:
                self.graph = GraphDecode(self.model, self.state, self.experts, self.device)
            except Exception as e:  # a capture that fails leaves nothing worth keeping: say how to run without one
                raise ConfigError(
                    f"capturing the decode step as CUDA graphs failed on rank {tp.rank} ({type(e).__name__}: {e}); "
                    "--enforce-eager runs it without graphs"
                ) from e
            self.experts.zero_counters()  # the warm-up steps before the capture are not a request's

    def reset(self) -> None:
        self.state.reset()
        if self.routing_log is not None:
            self.routing_log.reset()

    def forward(self, tokens: torch.Tensor, start_pos: int, last_only: bool = False) -> torch.Tensor:
        """tokens [1, s] -> fp32 logits [1, s, V], or [1, 1, V] with last_only (every rank gets them gathered),
        on this rank's device."""
        if self.routing_log is None:
            return self._forward(tokens, start_pos, last_only)
        self.routing_log.begin(start_pos, tokens.shape[1])
        try:
            return self._forward(tokens, start_pos, last_only)
        finally:
            self.routing_log.end()

    def _forward(self, tokens: torch.Tensor, start_pos: int, last_only: bool) -> torch.Tensor:
        if self.graph is not None and tokens.shape[1] == 1:  # a decode step: the captured graphs
            self.model.check_input(tokens, start_pos, self.state)  # on the host: the graphs check nothing
            return self.graph.step(int(tokens[0, 0]), start_pos)
        return self.model(tokens.to(self.device), start_pos, self.state, self.experts, last_only=last_only)

    def counters(self) -> dict:
        return self.experts.counters()

    def close(self) -> None:
        self.experts.close()


def to_device(model: torch.nn.Module, device: torch.device) -> None:
    """Parameters and buffers onto the device, except the Engram tables: they stay mapped on the host and only
    the looked-up rows travel (model/engram.py)."""
    for m in model.modules():
        if isinstance(m, EngramTable):
            continue
        for p in m._parameters.values():
            if p is not None:
                p.data = p.data.to(device)
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.to(device)


def _routing_log(opts: EngineOptions, tp: TP, cfg):
    """The --record-routing recorder on rank 0 (every rank routes the same), else None."""
    if not opts.record_routing or tp.rank != 0:
        return None
    from dsflash.runtime.routing_log import RoutingLog

    moe = [s for s in cfg.layers() if not s.is_dspark and s.n_experts]
    return RoutingLog(opts.record_routing, [s.layer_id for s in moe], moe[0].n_experts, moe[0].n_active)
