"""Decoding after a prefill of any length, or prefilling in chunks, equals one long prefill."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsflash.errors import ContextTooLong, UnsupportedInput
from dsflash.gates.compare import compare_logits, within_golden_tolerance


@pytest.fixture(scope="module")
def full(case):
    state = case.ref.model.new_state(len(case.tokens))
    return case.run(case.tokens, 0, state)[0].numpy()


def _assert_same(case, got, want):
    report = compare_logits(want, got)
    assert within_golden_tolerance(report, case.golden["tolerance"]), report
    assert report["mean_abs"] < 1e-4, report


@pytest.mark.parametrize("split,steps", [(3, None), (1, 24), (16, 24), (17, 24), (40, 24)])
def test_decode_after_any_prefill(case, full, split, steps):
    """Split points off the compression ratio and the candidate block. One split decodes to the end (the window ring
    wraps); the others hand prefill over to decode at another point and check the steps that follow it."""
    end = len(case.tokens) if steps is None else split + steps
    state = case.ref.model.new_state(len(case.tokens))
    first = case.run(case.tokens[:split], 0, state)[0].numpy()
    rows = [case.run([case.tokens[p]], p, state)[0, -1].numpy() for p in range(split, end)]
    _assert_same(case, np.concatenate([first, np.stack(rows)]), full[:end])


@pytest.mark.parametrize("chunks", [[5, 27, 1, 33], [64, 64], [7] * 10])
def test_chunked_prefill(case, full, chunks):
    state = case.ref.model.new_state(len(case.tokens))
    out, pos = [], 0
    for n in chunks + [len(case.tokens)]:
        n = min(n, len(case.tokens) - pos)
        if n <= 0:
            break
        out.append(case.run(case.tokens[pos : pos + n], pos, state)[0].numpy())
        pos += n
    _assert_same(case, np.concatenate(out), full)


def test_state_reset_between_sequences(case, full):
    """A second sequence on a used state gives the same logits as on a fresh one."""
    state = case.ref.model.new_state(len(case.tokens))
    other = list(reversed(case.tokens))
    case.run(other[:50], 0, state)
    case.run([other[50]], 50, state)
    state.reset()
    np.testing.assert_array_equal(case.run(case.tokens, 0, state)[0].numpy(), full)


def test_bad_input_is_refused(case):
    model, experts = case.ref.model, case.ref.experts
    state = model.new_state(8)
    vocab = case.ref.cfg.vocab_size
    with pytest.raises(UnsupportedInput, match="outside the vocabulary"):
        model(torch.tensor([[1, vocab]]), 0, state, experts)
    with pytest.raises(ContextTooLong):
        model(torch.tensor([[1] * 9]), 0, state, experts)
    model(torch.tensor([[1, 2]]), 0, state, experts)
    with pytest.raises(ValueError, match="does not continue"):
        model(torch.tensor([[1]]), 5, state, experts)


class _NoHostReads(TorchDispatchMode):
    """Fails on any operation that reads a tensor's value back to the host (item, tolist, bool) or whose output
    shape depends on values (nonzero, unique, masked_select): neither can run inside a captured graph. The expert
    back end and the Engram table lookup are the step's host stages and run with the check paused."""

    FORBIDDEN = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "item")

    def __init__(self):
        super().__init__()
        self.paused, self.seen = False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and any(f in func.__name__ for f in self.FORBIDDEN):
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))

    def host_stage(self, fn):
        def run(*a, **kw):
            self.paused = True
            try:
                return fn(*a, **kw)
            finally:
                self.paused = False

        return run


def test_static_decode_steps(case, full, monkeypatch):
    """Decode steps whose position is a tensor (every shape fixed, the window ring and the compressed caches read
    whole with masks) equal the dynamic steps: across compression group ends, the window ring's wrap and the
    indexer's top-k filling up, after a dynamic prefill and before dynamic steps that continue the sequence. The
    step reads nothing back to the host outside its host stages (the experts, the Engram table)."""
    model, split, back, end = case.ref.model, 5, 30, 40
    state = model.new_state(len(case.tokens))
    first = case.run(case.tokens[:split], 0, state)[0].numpy()
    mode = _NoHostReads()
    experts = mode.host_stage(case.ref.experts)
    for layer in model.layers:
        if hasattr(layer, "engram"):
            monkeypatch.setattr(layer.engram.embed, "forward", mode.host_stage(layer.engram.embed.forward))
    rows = []
    for p in range(split, back):
        with mode:
            logits = model(torch.tensor([[case.tokens[p]]]), torch.tensor([p]), state, experts)
        state.length = p + 1
        rows.append(logits[0, -1].numpy())
    assert mode.seen == []
    rows += [case.run([t], p, state)[0, -1].numpy() for p, t in enumerate(case.tokens[:end]) if p >= back]
    _assert_same(case, np.concatenate([first, np.stack(rows)]), full[:end])
