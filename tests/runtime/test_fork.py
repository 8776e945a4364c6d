"""n sequences of one prompt (BatchEngine.submit_n): the prompt is prefilled once and every sequence continues a
copy of its state (at TP 2: tests/runtime/test_batch.py); each gives the tokens the same request gives alone with
its own seed, batched (3 slots) or one after another (1 slot); a runner that cannot copy states has each prefill the
prompt, with the same tokens; cancelling the request ends every sequence, and one failing fails the request."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dsflash.runtime.scheduler.batch import BatchEngine
from dsflash.runtime.scheduler.engine import Engine
from dsflash.runtime.scheduler.queue import GenerationRequest
from dsflash.runtime.scheduler.sampler import SamplingParams
from dsflash.runtime.spec import EngineSpec
from dsflash.runtime.tp.launch import start_engine
from dsflash.service.files import open_dir
from tests.model.conftest import ROOT

CHUNK = 16  # the 40-token prompt takes three prefill passes
EOS = {1}
PROMPT = tuple((7 * k) % 900 + 3 for k in range(40))


class Counting:
    """A runner that counts the prompt tokens its forward passes compute and can claim fewer slots."""

    def __init__(self, inner, n_seqs: int):
        self.inner, self.n_seqs, self.prefilled = inner, n_seqs, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, tokens, start_pos, all_logits):
        if start_pos < len(PROMPT):
            self.prefilled += len(tokens)
        return self.inner.forward(tokens, start_pos, all_logits)


class Failing(BatchEngine):
    """Sequence 1 of a request fails at its second token."""

    def _emit(self, seq):
        if getattr(seq.handle, "index", 0) == 1 and seq.index == 1:
            raise RuntimeError("boom")
        super()._emit(seq)


def _start(tmp_path_factory, tp: int):
    files = open_dir(ROOT / "tiny_a" / "model")
    spec = EngineSpec(tp=tp, cache_dir=str(tmp_path_factory.mktemp("stores")), max_num_seqs=3)
    return start_engine(files.ckpt, files.token_map, 128, spec)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    r = _start(tmp_path_factory, 1)
    yield r
    r.close()


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 4, "ignore_eos": True, **kw})


def _solo(runner, params: list[SamplingParams]) -> list[list[int]]:
    engine = Engine(runner, EOS, prefill_chunk=CHUNK).start()
    try:
        return [[e.token for e in engine.submit(GenerationRequest(PROMPT, p)) if e.token is not None] for p in params]
    finally:
        engine.close()


def _forked(runner, params, slots: int, engine_cls=BatchEngine, cancel_after: int | None = None, fork=True):
    """-> (tokens of each sequence, finish reasons, prompt tokens computed, the error raised or None)."""
    counting = Counting(runner, slots)
    engine = engine_cls(counting, EOS, prefill_chunk=CHUNK)
    engine.can_fork = fork
    engine.start()
    tokens, reasons, error = [[] for _ in params], [None] * len(params), None
    try:
        fork = engine.submit_n(GenerationRequest(PROMPT, params[0]), params)
        seen = 0
        for i, ev in fork:
            if ev.token is not None:
                tokens[i].append(ev.token)
                seen += 1
            if ev.finish_reason is not None:
                reasons[i] = ev.finish_reason
            if seen == cancel_after:
                fork.cancel()
    except RuntimeError as e:
        error = e
        fork.cancel()
    finally:
        engine.close()
    return tokens, reasons, counting.prefilled, error


def test_sequences_share_one_prefill_and_answer_as_alone(runner):
    greedy = [_params(temperature=0)] * 3
    seeded = [_params(temperature=1.0, seed=11 + i) for i in range(3)]
    want_greedy, want_seeded = _solo(runner, greedy[:1])[0], _solo(runner, seeded)
    assert len({tuple(t) for t in want_seeded}) > 1  # the seeds draw different sequences
    for slots in (3, 1):  # batched, and one after another from the same copy
        tokens, reasons, prefilled, _ = _forked(runner, greedy, slots)
        assert tokens == [want_greedy] * 3 and reasons == ["length"] * 3, slots
        assert prefilled == len(PROMPT), slots  # the prompt once, never per sequence
    assert _forked(runner, seeded, 3)[0] == want_seeded
    tokens, _, prefilled, _ = _forked(runner, greedy, 3, fork=False)
    assert tokens == [want_greedy] * 3 and prefilled == 3 * len(PROMPT)


def test_cancel_ends_every_sequence_and_a_failure_fails_the_request(runner):
    params = [_params(temperature=0, max_tokens=40)] * 3
    tokens, reasons, _, _ = _forked(runner, params, 3, cancel_after=4)
    assert reasons == ["cancelled"] * 3 and all(len(t) < 40 for t in tokens)
    _, _, _, error = _forked(runner, [replace(p, max_tokens=4) for p in params], 3, engine_cls=Failing)
    assert str(error) == "boom"
