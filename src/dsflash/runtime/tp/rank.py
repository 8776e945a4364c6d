"""One tensor-parallel rank of the engine: its shard of the dense weights, its slot pool over its store shard,
and its decode state, built in the boot's phases. Every rank runs the same forward calls; only rank 0 samples."""

from __future__ import annotations

import logging

import torch

from dsflash.checkpoint.index import Checkpoint
from dsflash.checkpoint.load import load_into
from dsflash.counters import ExpertCounters
from dsflash.errors import ConfigError
from dsflash.model.block import Embedding
from dsflash.model.dspark import Speculation, draft_sampler
from dsflash.model.engram import EngramTable
from dsflash.model.parallel import TP
from dsflash.model.transformer import Transformer
from dsflash.runtime.cpu import fused, native, rows
from dsflash.runtime.cpu.dense import pack_dense
from dsflash.runtime.experts.cached import CachedExperts
from dsflash.runtime.experts.device import CpuDevice, Device
from dsflash.runtime.prefix.identity import snapshot_identity
from dsflash.runtime.prefix.shelf import Shelf
from dsflash.runtime.spec import DEFAULT_SLOTS, EngineSpec, default_prefix_gb
from dsflash.runtime.tp.torchrun import local_rank, local_world
from dsflash.store.reader import open_store

log = logging.getLogger(__name__)

MATMUL = {"bf16": torch.bfloat16, "fp32": torch.float32, "bf16x2": native.BF16X2}


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


def rank_device(name: str, rank: int) -> torch.device:
    """The torch device of TP rank `rank` of a resolved spec's device: the GPU of its local rank (torchrun's
    LOCAL_RANK, else the rank)."""
    if name == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", local_rank(rank) % torch.cuda.device_count())


class RankRuntime:
    """Built in steps, each a phase of the boot: `load_dense` (the model, its dense shard in device formats, the
    kernel hooks), then `allocate` (the decode state, the slot pool over the store shard, the CUDA graphs)."""

    def __init__(self, model_dir: str, max_len: int, spec: EngineSpec, tp: TP, token_map, device: Device | None = None):
        self.model_dir, self.max_len, self.spec, self.tp, self.token_map = model_dir, max_len, spec, tp, token_map
        self.slot_device = device  # None: the rank's own (CpuDevice or CudaDevice)
        self.device = rank_device(spec.device, tp.rank)
        self.model = self.state = self.experts = self.graph = self.routing_log = self.shelf = None
        self.speculation: Speculation | None = None  # --speculative: every forward seeds the DSpark head
        self.states: list = []  # one decode state per sequence slot (spec.max_num_seqs); `state` is the selected one
        self.dense_bytes = 0
        self._ckpt = None

    @classmethod
    def build(cls, model_dir: str, max_len: int, spec: EngineSpec, tp: TP, token_map) -> RankRuntime:
        rt = cls(model_dir, max_len, spec, tp, token_map)
        rt.load_dense()
        rt.allocate()
        return rt

    def load_dense(self) -> None:
        """The model with this rank's shard of the checkpoint, its dense weights packed for the device."""
        spec, tp = self.spec, self.tp
        self._ckpt = ckpt = Checkpoint.open(self.model_dir)
        self.cfg = cfg = ckpt.config
        self.matmul = MATMUL[spec.prefill_matmul]
        self.model = Transformer(cfg, tp=tp, token_map=self.token_map, qat=spec.qat, dspark=spec.dspark)
        load_into(self.model, ckpt)
        on_gpu = self.device.type == "cuda"
        if on_gpu or spec.dense_format != "fp32":
            for m in self.model.modules():  # embedding rows are only gathered: bf16 halves them for free
                if isinstance(m, Embedding):
                    m.weight.data = m.weight.data.bfloat16()
        sinkhorn = None
        if on_gpu:
            from dsflash.runtime.cuda import device as cuda
            from dsflash.runtime.cuda import triton_linear, triton_mhc

            torch.cuda.set_device(self.device)
            self.dense_bytes = cuda.pack_dense(self.model, self.device, ckpt, spec.dense_format)
            to_device(self.model, self.device)
            self.slot_device = self.slot_device or cuda.CudaDevice(self.device)
            triton_linear.warm_up(self.device, ("bf16", "fp8", spec.expert_format), cfg.fp8_block)  # dense, experts
            sinkhorn = triton_mhc.sinkhorn
        elif spec.dense_format != "fp32":
            screen = spec.screen_head
            self.dense_bytes = pack_dense(self.model, ckpt, spec.dense_format, self.matmul, screen_head=screen)
        fused.fill(self.model, sinkhorn)
        self.model.eval()

    def allocate(self) -> None:
        """The decode state for max_len tokens, then as many expert slots as the memory left holds (every rank the
        same count), the slot pool over this rank's store shard, and the decode step's CUDA graphs."""
        spec, tp, cfg = self.spec, self.tp, self.cfg
        store = open_store(self._ckpt, spec.cache_dir, tp=tp.size, fmt=spec.expert_format)
        self._ckpt.close()  # dense weights are copied: drop the checkpoint's mappings (Engram tables stay mapped)
        self._ckpt = None
        device = self.slot_device or CpuDevice(self.matmul, spec.slot_fill)
        self.routing_log = _routing_log(spec, tp, cfg)
        # before the slots take what is left: one state per sequence that may run at once
        self.states = [self.model.new_state(self.max_len, device=self.device) for _ in range(spec.max_num_seqs)]
        self.state = self.states[0]
        if spec.prefix_cache:
            self.shelf = Shelf(self.state, snapshot_identity(self.model_dir, spec), tp.rank, tp.size,
                               spec.prefix_cache_dir)  # fmt: skip
        # every rank gets the same count: the smallest budget decides (ranks of a host share its memory). CPU slots
        # leave the prefix cache its host memory (snapshots grow into it after the slots are placed), up to a
        # quarter of theirs: on a host short of memory the slots come first and the cache's cap is only a cap
        free = device.slot_budget()
        reserve = min(prefix_reserve(spec), free // 4) if self.device.type == "cpu" else 0
        budget = tp.agree_min((free - reserve) // _ranks_sharing(self.device, tp))
        total = sum(s.n_experts for s in cfg.layers())
        n_slots = slot_count(spec.expert_slots, total, store.geometry.stride, budget)  # stride: >= a device's slot
        self.experts = CachedExperts(store, device, n_slots, tp.rank, cfg.swiglu_limit, self.routing_log)
        # the decode step as CUDA graphs (runtime/cuda/graph.py); not where collectives go through host copies
        graphs = self.device.type == "cuda" and spec.cuda_graph and not tp.host_staging
        if spec.speculative:
            self.speculation = Speculation(self.model, self.experts)
            if graphs:  # a captured step computes no DSpark taps
                log.warning("decode runs without CUDA graphs: --speculative seeds the draft head on every step")
                graphs = False
        if graphs and spec.max_num_seqs > 1:  # a captured step reads one state's tensors; batches run eagerly
            log.warning("decode runs without CUDA graphs: --max-num-seqs %d batches sequences", spec.max_num_seqs)
            graphs = False
        short = graph_slots_short(n_slots, cfg)
        if graphs and short:
            log.warning("decode runs without CUDA graphs: %d expert slots hold fewer than the %d experts a token "
                        "activates, which a captured step needs resident together (eager decode takes them in "
                        "waves)", n_slots, short)  # fmt: skip
            graphs = False
        if graphs:
            from dsflash.runtime.cuda.graph import GraphDecode

            try:
                self.graph = GraphDecode(self.model, self.state, self.experts, self.device)
            except Exception as e:  # a capture that fails leaves nothing worth keeping: say how to run without one
                raise ConfigError(
                    f"capturing the decode step as CUDA graphs failed on rank {tp.rank} ({type(e).__name__}: {e}); "
                    "--enforce-eager runs it without graphs"
                ) from e
            self.experts.zero_counters()  # the warm-up steps before the capture are not a request's

    def select(self, seq: int) -> None:
        """The sequence slot that reset / forward / snapshots apply to from now on."""
        self.state = self.states[seq]
        if self.shelf is not None:
            self.shelf.state = self.state

    def decode(self, tokens: list[int], positions: list[int], seqs: list[int]) -> torch.Tensor:
        """One batched decode step: token i continues sequence slot seqs[i] at positions[i] -> fp32 logits [B, V]
        (every rank gets them gathered). Not recorded by --record-routing (its lines describe one sequence)."""
        with rows.decoding():  # every row on the GEMV kernels: each sequence gets its solo bits
            return self.model.decode_batch(tokens, positions, [self.states[i] for i in seqs], self.experts)

    def reset(self) -> None:
        self.state.reset()
        if self.speculation is not None:
            self.speculation.reset()
        if self.routing_log is not None:
            self.routing_log.reset()

    def forward(self, tokens: torch.Tensor, start_pos: int, last_only: bool = False, verify: bool = False):
        """tokens [1, s] -> fp32 logits [1, s, V], or [1, 1, V] with last_only (every rank gets them gathered),
        on this rank's device; verify: the positions stay revocable until accept()."""
        if self.routing_log is None:
            return self._forward(tokens, start_pos, last_only, verify)
        self.routing_log.begin(start_pos, tokens.shape[1])
        try:
            return self._forward(tokens, start_pos, last_only, verify)
        finally:
            self.routing_log.end()

    def _forward(self, tokens: torch.Tensor, start_pos: int, last_only: bool, verify: bool = False) -> torch.Tensor:
        if self.speculation is not None:
            return self.speculation.forward(tokens.to(self.device), start_pos, self.state, last_only, verify)
        if self.graph is not None and tokens.shape[1] == 1:  # a decode step: the captured graphs
            self.model.check_input(tokens, start_pos, self.state)  # on the host: the graphs check nothing
            return self.graph.step(int(tokens[0, 0]), start_pos)
        return self.model(tokens.to(self.device), start_pos, self.state, self.experts, last_only=last_only)

    # ---- speculative decoding: the same calls on every rank (runtime/tp/workers.py sends them) ----
    def verify(self, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        """tokens [1, s]: a forward whose positions stay revocable until accept() -> logits [1, s, V]. Its few
        positions are decode rows: every product takes the decode kernels, so each position's products have the
        bits a plain decode step gives them."""
        with rows.decoding():
            return self.forward(tokens, start_pos, verify=True)

    def accept(self, n_keep: int) -> None:
        self.speculation.accept(self.state, n_keep)

    def draft(self, token: int, pos: int, k: int, sampling: tuple):
        """-> (ids [k], logits [k, V], confidence [k]) on every rank, or None; sampling: dspark.draft_sampler's
        arguments."""
        with rows.decoding():  # a block of k decode rows
            return self.speculation.draft(token, pos, k, self.state, draft_sampler(*sampling))

    def counters(self) -> ExpertCounters:
        return self.experts.counters()

    def close(self) -> None:
        if self.experts is not None:
            self.experts.close()
        if self._ckpt is not None:
            self._ckpt.close()


def prefix_reserve(spec: EngineSpec) -> int:
    """Host bytes the prefix cache may take on this host (every rank's snapshots; one host's share under torchrun)."""
    if not spec.prefix_cache:
        return 0
    gb = spec.prefix_cache_gb if spec.prefix_cache_gb is not None else default_prefix_gb()
    return int(gb * 1e9) * local_world(spec.tp) // spec.tp


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


def _routing_log(spec: EngineSpec, tp: TP, cfg):
    """The --record-routing recorder on rank 0 (every rank routes the same), else None."""
    if not spec.record_routing or tp.rank != 0:
        return None
    from dsflash.runtime.experts.routing_log import RoutingLog

    moe = [s for s in cfg.layers() if not s.is_dspark and s.n_experts]
    return RoutingLog(spec.record_routing, [s.layer_id for s in moe], moe[0].n_experts, moe[0].n_active)
