"""The decode step on a GPU as CUDA graphs ("warm the decode traces"): captured once when a rank starts, replayed
for every generated token.

Eager, a decode step is hundreds of small kernels and the host's launches are its time. A static step
(attention.Step: the position a device tensor, every shape fixed) launches the same kernels at every position, so
it can be captured, except where it must ask the host: each MoE layer's routing decides which experts the slot LRU
makes resident (and which misses are copied in from the page cache), and each Engram layer's looked-up rows come
from tables mapped in host memory. The step is captured as one graph per stretch between those host stages: a
capture ends where the model calls the expert back end or an Engram table and the next one begins after it. A
replay runs the graphs in order and, between them, the stage: read the routing ids (the one wait for the GPU a MoE
layer costs), acquire the slots, copy the misses, write the slot table the next graph's expert kernels read
(CudaDevice.experts_by_table); or look the rows up on the host and copy them into the buffer the next graph reads.

All graphs share one memory pool and replay in the order they were captured; the inputs (token, position), the
stages' buffers and the logits are tensors the graphs own, valid for as long as the graphs live.
"""

from __future__ import annotations

import contextlib

import torch

from dsflash.model.engram import EngramTable


class CudaGraphs:
    """What GraphDecode asks of CUDA: graphs that share one memory pool, a side stream to capture on, pinned host
    buffers, and a wait for the stream. (Narrow so that the tests can put a recorder of torch operations in its
    place on a CPU, and another accelerator its own graphs.)"""

    def __init__(self, device: torch.device):
        self.device = device
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)

    def graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def begin(self, graph: torch.cuda.CUDAGraph) -> None:
        # thread_local: a CUDA call of another thread (the NCCL watchdog polling the warm-up's collectives) must not
        # invalidate this capture, as it would under "global"; this thread's own unsafe calls still fail it
        graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")

    def end(self, graph: torch.cuda.CUDAGraph) -> None:
        graph.capture_end()

    @contextlib.contextmanager
    def capturing(self):
        """Warm-up and capture on the side stream (a capture may not use the default one)."""
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield
            self._stream.synchronize()
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype).pin_memory()


class _ExpertStage:
    """Between graphs: one MoE layer's routing ids -> its slots, resident, in the table the next graph reads."""

    def __init__(self, layer: int, ids: torch.Tensor, table: torch.Tensor):
        self.layer = layer
        self.ids = ids  # [1, k] the router's choice, written by the graph before
        self.table = table  # [k] int32 slot numbers, read by the graph after
        self._host: tuple[torch.Tensor, torch.Tensor] | None = None  # pinned ids and table (not during a capture)

    def run(self, experts, cuda: CudaGraphs) -> None:
        if self._host is None:
            self._host = (cuda.pinned(self.ids), cuda.pinned(self.table))
        ids, table = self._host
        ids.copy_(self.ids, non_blocking=True)
        cuda.synchronize()  # the routing is the step's one wait per MoE layer
        if experts.routing_log is not None:
            experts.routing_log.moe(self.layer, ids)
        cols = ids[0].tolist()
        slots = experts.acquire_decode(self.layer, cols)
        try:
            table.numpy()[:] = slots  # in place: the pinned buffer the copy below reads
            self.table.copy_(table, non_blocking=True)
        finally:  # the copies above and the next graph queue on this stream: a later miss cannot overtake them
            experts.release(self.layer, cols)


class _EngramStage:
    """Between graphs: an Engram layer's hashed row ids -> the table rows, looked up on the host."""

    def __init__(self, table: EngramTable, ids: torch.Tensor, rows: torch.Tensor):
        self.table = table
        self.ids = ids  # device, written by the graph before
        self.rows = rows  # device bf16, read by the graph after
        self._host: torch.Tensor | None = None

    def run(self, experts, cuda: CudaGraphs) -> None:
        if self._host is None:
            self._host = cuda.pinned(self.rows)
        self._host.copy_(self.table(self.ids.cpu()))  # the ids' copy waits for the graph that wrote them
        self.rows.copy_(self._host, non_blocking=True)


class GraphDecode:
    """A rank's decode step, captured: step(token, pos) -> logits [1, 1, V] (a fresh tensor)."""

    def __init__(self, model: torch.nn.Module, state, experts, device: torch.device, cuda=None, warm: int = 2):
        """experts: the rank's CachedExperts (on a CudaDevice: its experts_by_table). warm: eager static steps
        before the capture (they initialise the libraries' workspaces, which a capture may not allocate, compile
        the kernels it launches, and copy the model's constant tables to the device once); the decode state is
        reset after them. cuda: CudaGraphs (the default) or a stand-in of the same shape."""
        self.model, self.state, self.experts, self.device = model, state, experts, device
        self.cuda = cuda or CudaGraphs(device)
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self._inputs = self.cuda.pinned(torch.zeros(2, dtype=torch.long))
        self._segments: list[tuple[object, _ExpertStage | _EngramStage | None]] = []
        with self.cuda.capturing():
            for _ in range(warm):
                model(self.token, self.pos, state, experts, last_only=True)
            self._warm_table_kernels()
            self.logits = self._capture()
        state.reset()

    def _warm_table_kernels(self) -> None:
        """The captured step's expert call once, eagerly, on the rank's own slot pool and layout: the eager warm-up
        steps above take the experts' other path, and a capture may not compile the kernels it launches. (Slot 0's
        bytes, whatever they hold; the result is dropped.)"""
        e, cfg, dev = self.experts, self.model.cfg, self.device
        for k in sorted({s.n_active for s in cfg.layers() if not s.is_dspark}):
            table = torch.zeros(k, dtype=torch.int32, device=dev)
            x, w = torch.zeros(1, cfg.hidden_size, device=dev), torch.zeros(1, k, device=dev)
            e.device.experts_by_table(e.slots, table, e.layout, x, w, e.limit)

    def _capture(self) -> torch.Tensor:
        cuda, pending = self.cuda, [self.cuda.graph()]

        def split(stage) -> None:  # the graph so far ends here; the stage runs before the next one
            cuda.end(pending[0])
            self._segments.append((pending[0], stage))
            pending[0] = cuda.graph()
            cuda.begin(pending[0])

        def experts(layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            # zeros, not empty: a slot number the capture may read is in range on a device that runs while capturing
            table = torch.zeros(ids.shape[1], dtype=torch.int32, device=self.device)
            split(_ExpertStage(layer, ids, table))
            e = self.experts
            return e.device.experts_by_table(e.slots, table, e.layout, x.float(), weights, e.limit)

        def lookup(table: EngramTable):
            def forward(ids: torch.Tensor) -> torch.Tensor:
                rows = torch.zeros(*ids.shape, table.weight.shape[1], dtype=torch.bfloat16, device=self.device)
                split(_EngramStage(table, ids, rows))
                return rows

            return forward

        with contextlib.ExitStack() as undo:
            for t in (m for m in self.model.modules() if isinstance(m, EngramTable)):
                t.forward = lookup(t)  # an instance attribute shadows the class's forward for the capture only
                undo.callback(delattr, t, "forward")
            cuda.synchronize()
            cuda.begin(pending[0])
            try:
                logits = self.model(self.token, self.pos, self.state, experts, last_only=True)
            except BaseException:
                with contextlib.suppress(Exception):  # the capture's own error is the one to report
                    cuda.end(pending[0])
                raise
            cuda.end(pending[0])
            self._segments.append((pending[0], None))
        return logits

    @property
    def graphs(self) -> int:
        return len(self._segments)

    @torch.inference_mode()  # the stages write buffers the capture made inside the model's inference mode
    def step(self, token: int, pos: int) -> torch.Tensor:
        self._inputs[0], self._inputs[1] = token, pos
        self.token.view(1).copy_(self._inputs[0:1], non_blocking=True)
        self.pos.copy_(self._inputs[1:2], non_blocking=True)
        for graph, stage in self._segments:
            graph.replay()
            if stage is not None:
                stage.run(self.experts, self.cuda)
        self.state.length = pos + 1
        return self.logits.clone()
