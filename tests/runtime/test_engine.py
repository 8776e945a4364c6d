"""The engine on the CPU reference: generation, sampling controls, cancellation, admission."""

import threading
import time

import pytest
import torch

from dsflash.errors import InvalidRequest, Overloaded
from dsflash.runtime.reference.runner import ModelRunner
from dsflash.runtime.scheduler.engine import Engine
from dsflash.runtime.scheduler.queue import GenerationRequest
from dsflash.runtime.scheduler.sampler import Sampler, SamplingParams
from tests.model.conftest import open_case


@pytest.fixture(scope="module")
def tiny():
    return open_case("tiny_a")


@pytest.fixture()
def engine(tiny):
    eng = Engine(ModelRunner(tiny.ref, max_len=256), eos_ids={1}, max_queue=2, prefill_chunk=32).start()
    yield eng
    eng.close()


def _tokens(handle):
    return [e.token for e in handle if e.token is not None]


def test_greedy_generation_matches_manual_argmax(tiny, engine):
    prompt = tiny.tokens[:40]
    got = _tokens(
        engine.submit(GenerationRequest(tuple(prompt), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    )
    state = tiny.ref.model.new_state(256)
    seq, want = list(prompt), []
    logits = tiny.run(seq, 0, state)[0, -1]
    for _ in range(12):
        want.append(int(logits.argmax()))
        logits = tiny.run([want[-1]], len(seq), state)[0, -1]
        seq.append(want[-1])
    assert got == want


def test_seed_reproduces_and_differs(tiny, engine):
    def run(seed):
        p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=seed, max_tokens=10, ignore_eos=True)
        return _tokens(engine.submit(GenerationRequest(tuple(tiny.tokens[:20]), p)))

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_logprobs_and_finish_reasons(tiny, engine):
    p = SamplingParams(temperature=0, max_tokens=3, logprobs=5, prompt_logprobs=2, ignore_eos=True)
    events = list(engine.submit(GenerationRequest(tuple(tiny.tokens[:10]), p)))
    assert [e.finish_reason for e in events] == [None, None, "length"]
    first = events[0]
    assert len(first.top) == 5 and first.top[0][0] == first.token and first.logprob == pytest.approx(first.top[0][1])
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == 10
    assert first.prompt_logprobs[1][0] == tiny.tokens[1]


def test_stop_token_ids(tiny, engine):
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    free = _tokens(engine.submit(GenerationRequest(tuple(tiny.tokens[:20]), p)))
    stop_at = free[3]
    p = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(stop_at,), ignore_eos=True)
    events = list(engine.submit(GenerationRequest(tuple(tiny.tokens[:20]), p)))
    assert events[-1].finish_reason == "stop" and events[-1].stop_token and events[-1].token == stop_at
    assert len(events) == free.index(stop_at) + 1


def test_cancel_frees_the_engine(tiny, engine):
    p = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    h = engine.submit(GenerationRequest(tuple(tiny.tokens[:20]), p))
    it = iter(h)
    next(it)
    h.cancel()
    rest = list(it)
    assert rest[-1].finish_reason == "cancelled" and len(rest) < 5
    t0 = time.perf_counter()
    _tokens(engine.submit(GenerationRequest((1, 2, 3), SamplingParams(temperature=0, max_tokens=1))))
    assert time.perf_counter() - t0 < 5


def test_admission(tiny, engine):
    # the context is the service's check (tests/server/test_generator.py); the engine only refuses to overrun it
    with pytest.raises(ValueError, match="exceed the runner's 256"):
        engine.submit(GenerationRequest(tuple(tiny.tokens[:10]), SamplingParams(max_tokens=250)))
    with pytest.raises(InvalidRequest):
        engine.submit(GenerationRequest((5000,), SamplingParams()))
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    handles = [engine.submit(GenerationRequest((1, 2), long))]
    handles[0].started.wait(5)
    handles += [engine.submit(GenerationRequest((1, 2), long)) for _ in range(2)]
    with pytest.raises(Overloaded) as e:
        engine.submit(GenerationRequest((1, 2), long))
    assert e.value.retry_after >= 1
    with pytest.raises(Overloaded, match="the request queue is full"):
        engine.admit()  # the same answer without a request
    for h in handles:
        h.cancel()
    for h in handles:
        list(h)


def test_sampler_filters():
    logits = torch.tensor([5.0, 4.0, 0.0, -1.0])
    for _ in range(20):
        assert Sampler(SamplingParams(top_k=2, seed=None))(logits).token in (0, 1)
        assert Sampler(SamplingParams(top_p=0.5))(logits).token == 0
        assert Sampler(SamplingParams(min_p=0.5))(logits).token == 0
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(logprobs=21)


def test_engine_thread_runs_requests_in_order(tiny, engine):
    order = []
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    handles = [engine.submit(GenerationRequest((1, 2, 3), p)) for _ in range(2)]

    def consume(i):
        list(handles[i])
        order.append(i)

    threads = [threading.Thread(target=consume, args=(i,)) for i in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert order == [0, 1]


class _ShortOfMemory:
    """A runner whose host runs out of memory on any pass past position 64 (as torch's CPU allocator says it)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, tokens, start_pos, all_logits):
        if start_pos + len(tokens) > 64:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory")
        return self.inner.forward(tokens, start_pos, all_logits)


def test_a_prefill_out_of_memory_fails_that_request_alone(tiny):
    """The request is told why and what to change (a 503 at the API); the next request runs as on a fresh engine."""
    from dsflash.errors import OutOfMemory
    from dsflash.server.errors import classify

    engine = Engine(_ShortOfMemory(ModelRunner(tiny.ref, max_len=256)), eos_ids={1}, prefill_chunk=32).start()
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        with pytest.raises(OutOfMemory) as err:
            _tokens(engine.submit(GenerationRequest(tuple(tiny.tokens[:100]), params)))
        assert "100-token prompt" in str(err.value) and "--prefill-chunk" in str(err.value)
        status, body, _ = classify(err.value)
        assert (
            status == 503
            and body["error"]["code"] == "out_of_memory"
            and "ran out of memory" in body["error"]["message"]
        )
        got = _tokens(engine.submit(GenerationRequest(tuple(tiny.tokens[:40]), params)))
    finally:
        engine.close()
    fresh = Engine(ModelRunner(tiny.ref, max_len=256), eos_ids={1}, prefill_chunk=32).start()
    try:
        assert got == _tokens(fresh.submit(GenerationRequest(tuple(tiny.tokens[:40]), params)))
    finally:
        fresh.close()
