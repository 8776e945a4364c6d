"""The captured decode step (runtime/cuda/graph.py) on the CPU: a recorder of torch operations stands in for CUDA
graphs. Like a graph, it runs the model's Python once, at capture, and a replay repeats only the recorded
operations on the same tensors: a value the step took from Python at capture (a position, a slot, a length) stays
what it was then. Replays that follow a dynamic prefill must give the reference's logits, with the stages between
the graphs (slot lookups with evictions, Engram rows from the host) run as on a GPU. On the CPU a copy between host
and device is no copy at all, so a second check captures the model on the meta device, where it is one. The real
graphs: test_cuda.py."""

import contextlib

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from dsflash.gates.compare import compare_logits, within_golden_tolerance
from dsflash.model.experts import expert_ffn
from dsflash.runtime.cuda.graph import GraphDecode
from dsflash.runtime.experts.slots import SlotPool
from tests.model.conftest import open_case


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "_local_scalar_dense" in func.__name__:
            raise AssertionError(f"{func} reads a device value on the host inside a captured graph")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class _Graph:
    def __init__(self):
        self.ops: list = []
        self.mode: _Recorder | None = None

    def replay(self) -> None:
        with torch.inference_mode():
            for func, args, kwargs, out in self.ops:
                _refresh(out, func(*args, **kwargs))


def _refresh(out, new) -> None:
    """The recorded output tensor takes the new values in place, as a graph's kernels write their buffers."""
    if isinstance(out, torch.Tensor):
        if out is not new:
            out.copy_(new)
    elif isinstance(out, list | tuple):
        for o, n in zip(out, new, strict=True):
            _refresh(o, n)


class RecordedGraphs:
    """runtime.cuda.graph.CudaGraphs on the CPU: capture records, replay repeats."""

    def graph(self) -> _Graph:
        return _Graph()

    def begin(self, graph: _Graph) -> None:
        graph.mode = _Recorder(graph.ops)
        graph.mode.__enter__()

    def end(self, graph: _Graph) -> None:
        graph.mode.__exit__(None, None, None)

    def capturing(self):
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype)


class TableExperts:
    """CachedExperts' interface over the reference's resident experts: a miss 'copies' an expert into a slot by
    writing its index into slot_expert, the slot memory the table-reading kernel sees."""

    def __init__(self, resident, n_slots: int):
        self.resident, self.limit, self.routing_log = resident, resident.limit, None
        self.pool = SlotPool(n_slots)
        keys = sorted(resident.weights)
        self.index = {k: i for i, k in enumerate(keys)}
        self.w = [torch.stack([resident.weights[k][j] for k in keys]) for j in range(3)]
        self.slots = torch.zeros(n_slots, dtype=torch.long)  # slot -> expert index
        self.device, self.layout, self.misses = self, None, 0

    def __call__(self, layer, x, ids, weights):  # the eager steps (warm-up, prefill)
        return self.resident(layer, x, ids, weights)

    def acquire_decode(self, layer: int, cols: list[int]) -> list[int]:
        out = []
        for e in cols:
            slot, hit = self.pool.acquire((layer, e))
            if not hit:
                self.slots[slot] = self.index[(layer, e)]
                self.misses += 1
            out.append(slot)
        return out

    def release(self, layer: int, cols: list[int]) -> None:
        for e in cols:
            self.pool.release((layer, e))

    def experts_by_table(self, slots, table, layout, x, w, limit):
        which = slots[table.long()]
        y = torch.zeros(x.shape, dtype=torch.float32)
        for i in range(table.shape[0]):
            w1, w3, w2 = (m.index_select(0, which[i : i + 1])[0] for m in self.w)
            y += expert_ffn(x, w1, w3, w2, limit, w[:, i : i + 1])
        return y


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_replayed_decode_is_the_reference(name):
    case = open_case(name)
    model, cfg, tokens = case.ref.model, case.ref.cfg, case.tokens[:41]  # odd: the last group is never complete
    state = model.new_state(len(tokens))
    full = model(torch.tensor([tokens]), 0, state, case.ref.experts)[0].numpy()
    experts = TableExperts(case.ref.experts, n_slots=max(s.n_active for s in cfg.layers()) + 1)
    graph = GraphDecode(model, state, experts, torch.device("cpu"), cuda=RecordedGraphs())
    moe = sum(1 for s in cfg.layers() if not s.is_dspark)
    assert graph.graphs == 1 + moe + len(cfg.engram_layer_ids)  # split at every slot lookup and Engram lookup
    assert state.length == 0 and not state.layers[0].window.any()  # the capture left no trace in the state
    split = 7
    first = model(torch.tensor([tokens[:split]]), 0, state, experts)[0].numpy()
    rows = [graph.step(t, p)[0, -1].numpy() for p, t in enumerate(tokens) if p >= split]
    assert state.length == len(tokens) and experts.misses > 0
    report = compare_logits(full, np.concatenate([first, np.stack(rows)]))
    assert within_golden_tolerance(report, case.golden["tolerance"]), report
    assert report["mean_abs"] < 1e-4, report


def test_a_failed_capture_reports_its_error_and_leaves_the_model_as_it_was(monkeypatch):
    case = open_case("tiny_a")
    model = case.ref.model
    experts = TableExperts(case.ref.experts, n_slots=4)

    def broken(*args):
        raise RuntimeError("not capturable")

    monkeypatch.setattr(experts, "experts_by_table", broken)
    with pytest.raises(RuntimeError, match="not capturable"):
        GraphDecode(model, model.new_state(16), experts, torch.device("cpu"), cuda=RecordedGraphs())
    assert _get_current_dispatch_mode() is None  # no capture left open
    tables = [m for m in model.modules() if type(m).__name__ == "EngramTable"]
    assert tables and all("forward" not in vars(t) for t in tables)  # the lookups are the tables' own again


class _Traffic(TorchDispatchMode):
    """Records every operation that mixes host tensors with device (meta) ones, or copies between the two: inside a
    capture that is a copy from pageable host memory or a wait for the GPU, neither of which a graph can hold (a
    0-dim host tensor is a scalar argument, as on a GPU)."""

    def __init__(self):
        super().__init__()
        self.capturing, self.seen = False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.capturing:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > 0]
            devices = {t.device.type for t in tensors}
            target = kwargs.get("device") or next((a for a in args[1:] if isinstance(a, torch.device)), None)
            if target is not None:
                devices.add(torch.device(target).type)
            if len(devices) > 1:
                self.seen.append((str(func), sorted(devices)))
        return func(*args, **kwargs)


class _MetaGraphs(RecordedGraphs):
    def __init__(self, traffic: _Traffic):
        self.traffic = traffic

    def begin(self, graph) -> None:
        self.traffic.capturing = True

    def end(self, graph) -> None:
        self.traffic.capturing = False


class _MetaExperts:
    """The expert back end's interface on the meta device (no values: only devices and shapes matter here)."""

    routing_log, layout, limit = None, None, None

    def __init__(self, traffic: _Traffic):
        self.slots, self.device, self.traffic, self.calls = torch.zeros(8, 16, device="meta"), self, traffic, []

    def __call__(self, layer, x, ids, weights):
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)

    def experts_by_table(self, slots, table, layout, x, w, limit):
        self.calls.append((self.traffic.capturing, table.dtype, table.shape, x.shape, w.shape))
        return slots[table.long()].sum() * x.float()


def _capture_on_meta(name: str) -> tuple[int, list, list]:
    model = open_case(name).ref.model
    model._apply(lambda t: t.to("meta"))  # the Engram tables too: on meta their lookup is no host stage to check
    traffic = _Traffic()
    experts = _MetaExperts(traffic)
    with traffic:
        state = model.new_state(64, device="meta")
        graph = GraphDecode(model, state, experts, torch.device("meta"), cuda=_MetaGraphs(traffic))
    return graph.graphs, traffic.seen, experts.calls


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_the_captured_step_moves_nothing_between_host_and_device(name):
    graphs, seen, calls = _capture_on_meta(name)
    assert graphs > 1 and seen == []
    # the expert kernels a capture launches were launched eagerly before it, with the same arguments' shapes
    captured = {c[1:] for c in calls if c[0]}
    assert captured and not calls[0][0] and captured <= {c[1:] for c in calls if not c[0]}


def test_a_host_copy_inside_the_capture_is_seen(monkeypatch):
    """The check above can fail: a constant copied from the host at every step, not once, is reported."""
    from dsflash.model.layers import Rope

    cis = Rope.cis
    monkeypatch.setattr(Rope, "cis", lambda self, pos: cis(self, pos) * torch.ones(1, 1).to(pos.device))
    _, seen, _ = _capture_on_meta("tiny_a")
    assert seen and all(devices == ["cpu", "meta"] for _, devices in seen)
