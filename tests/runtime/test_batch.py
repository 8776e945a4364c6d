"""Continuous batching is exact: each sequence of a batch (mixed prompt lengths, per-request sampling, stop ids and
max_tokens) gives the tokens it gives alone, its logits within 1e-4 of the solo run's at every position, on the
engine at TP 1 and TP 2 (real ranks); a sequence cancelled mid-stream or failing leaves the others unchanged, and
the prefix cache restores into a sequence's own slot.

"Alone" is the one-at-a-time Engine (the --max-num-seqs 1 path) over the same runner. Few tokens: a tiny model's
decode step costs tens of ms of Python on two shared cores."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from dsflash.runtime.prefix.cache import prefix_cache
from dsflash.runtime.scheduler.batch import BatchEngine, PrefillPacer
from dsflash.runtime.scheduler.engine import Engine
from dsflash.runtime.scheduler.queue import GenerationRequest
from dsflash.runtime.scheduler.sampler import SamplingParams
from dsflash.runtime.spec import EngineSpec
from dsflash.runtime.tp.launch import start_engine
from dsflash.service.files import open_dir
from tests.model.conftest import ROOT

CHUNK = 32  # prefill passes: the 40- and 60-token prompts take two
EOS = {1}


class Recording:
    """A runner that keeps the logits of every decode position by (sequence slot, position)."""

    def __init__(self, inner):
        self.inner, self.rows, self.slot = inner, {}, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def select(self, seq):
        self.slot = seq
        self.inner.select(seq)

    def forward(self, tokens, start_pos, all_logits):
        out = self.inner.forward(tokens, start_pos, all_logits)
        self.rows[(self.slot, start_pos + len(tokens) - 1)] = out[-1].clone()
        return out

    def decode(self, tokens, positions, seqs):
        out = self.inner.decode(tokens, positions, seqs)
        for i, (pos, seq) in enumerate(zip(positions, seqs, strict=True)):
            self.rows[(seq, pos)] = out[i].clone()
        return out


class Failing(BatchEngine):
    """Sampling of the request named "boom" fails at its third token (what a failing sequence looks like)."""

    def _emit(self, seq):
        if seq.handle.request.request_id == "boom" and seq.index == 2:
            raise RuntimeError("boom")
        super()._emit(seq)


@pytest.fixture(scope="module")
def files():
    return open_dir(ROOT / "tiny_a" / "model")


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def _prompt(i: int, n: int) -> tuple[int, ...]:
    return tuple((17 * i + 5 * k) % 900 + 3 for k in range(n))


def _solo(rec: Recording, requests, prefix=None):
    """Each request alone through the one-at-a-time engine -> [(events, rows by position)]."""
    engine = Engine(rec, EOS, prefill_chunk=CHUNK, prefix=prefix).start()
    out = []
    try:
        for req in requests:
            rec.rows = {}
            events = list(engine.submit(req))
            out.append((events, {pos: row for (_, pos), row in rec.rows.items()}))
    finally:
        engine.close()
    return out


def _batch(rec: Recording, requests, engine_cls=BatchEngine, prefix=None, cancel: int | None = None):
    """All requests queued before the engine starts (request i takes slot i) -> (events or the error of each, the
    batch sizes of the decode steps)."""
    rec.rows = {}
    engine = engine_cls(rec, EOS, prefill_chunk=CHUNK, prefix=prefix)
    handles = [engine.queue.submit(r) for r in requests]
    out: list = [None] * len(handles)

    def consume(i):
        got = []
        try:
            for e in handles[i]:
                got.append(e)
                if i == cancel and len(got) == 3:
                    handles[i].cancel()
            out[i] = got
        except Exception as e:
            out[i] = e

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(handles))]
    for t in threads:
        t.start()
    engine.start()
    for t in threads:
        t.join()
    engine.close()
    return out, engine.steps.batch_sizes


def _tokens(events):
    return [e.token for e in events if e.token is not None]


def _assert_rows_match(rec_rows, slot, solo_rows):
    rows = {pos: row for (s, pos), row in rec_rows.items() if s == slot}
    assert rows
    for pos, row in rows.items():
        diff = float((row - solo_rows[pos]).abs().max())
        assert diff <= 1e-4, (slot, pos, diff)


@pytest.mark.parametrize("tp", [1, 2])
def test_batched_sequences_equal_their_solo_runs(files, tmp_path_factory, tp):
    lengths = [3, 40, 17, 9, 60, 25, 5, 33] if tp == 1 else [3, 40, 9]
    gen = 6 if tp == 1 else 4  # (TP 2's steps cost three times TP 1's on two cores)
    spec = EngineSpec(tp=tp, cache_dir=str(tmp_path_factory.mktemp("stores")), max_num_seqs=len(lengths))
    runner = start_engine(files.ckpt, files.token_map, 256, spec)
    try:
        rec = Recording(runner)
        requests = [GenerationRequest(_prompt(i, n), _greedy(gen + i % 3)) for i, n in enumerate(lengths)]
        # per-request sampling: a seeded sampled sequence and one with its own stop id
        requests[1] = GenerationRequest(requests[1].prompt, SamplingParams(temperature=0.9, seed=5, max_tokens=gen))
        solo = _solo(rec, requests)
        want = [(_tokens(events), [e.finish_reason for e in events]) for events, _ in solo]
        # one sequence with a stop id of its own: alone it ends at that id's first occurrence
        stop_at = want[2][0][gen - 2]
        requests[2] = GenerationRequest(requests[2].prompt, _greedy(gen + 2, stop_token_ids=(stop_at,)))
        end = want[2][0].index(stop_at) + 1
        want[2] = (want[2][0][:end], [None] * (end - 1) + ["stop"])
        got, sizes = _batch(rec, requests)
        assert max(sizes) >= len(lengths) - 1, sizes  # all of them but the one stopping early decoded together
        for i, ((tokens, reasons), events, (_, rows)) in enumerate(zip(want, got, solo, strict=True)):
            assert (_tokens(events), [e.finish_reason for e in events]) == (tokens, reasons), i
            if i != 1:  # a sampled sequence's rows follow its own tokens: compared through them
                _assert_rows_match(rec.rows, i, rows)
        if tp == 2:
            _fork_copies_the_prompt_on_every_rank(rec, requests[0], want[0][0])
        if tp == 1:
            _cancel_and_fail(rec, requests, want)
            _close_while_decoding(rec, requests[0])
            _prefix_restores_into_each_slot(rec, runner, spec, requests, solo)
            _paced_admission(rec, requests, solo)
    finally:
        runner.close()


def _fork_copies_the_prompt_on_every_rank(rec, request, want):
    """Three sequences of one request (tests/runtime/test_fork.py at TP 1): the siblings' slots never run the prompt,
    and each gives the request's tokens alone."""
    rec.rows = {}
    engine = BatchEngine(rec, EOS, prefill_chunk=CHUNK).start()
    got: list[list[int]] = [[], [], []]
    try:
        for i, e in engine.submit_n(request, [request.params] * 3):
            if e.token is not None:
                got[i].append(e.token)
    finally:
        engine.close()
    assert got == [want] * 3
    assert not [pos for slot, pos in rec.rows if slot and pos < len(request.prompt)]


class Slow(Recording):
    """Prefill 30 ms a token, a decode call 30 ms on top of the model: a pass beside a decode step costs its
    tokens, as on a large model."""

    def forward(self, tokens, start_pos, all_logits):
        time.sleep(0.03 * len(tokens))
        return super().forward(tokens, start_pos, all_logits)

    def decode(self, tokens, positions, seqs):
        time.sleep(0.03)
        return super().decode(tokens, positions, seqs)


def _paced_admission(rec, requests, solo):
    """With --prefill-step-factor, a 60-token prompt admitted beside a decoding stream joins its steps a few
    tokens at a time (the token budget alone would let 32-token passes in); both give their solo tokens."""
    slow = Slow(rec.inner)
    stream = GenerationRequest(requests[0].prompt, _greedy(40))
    want = _tokens(_solo(slow, [stream])[0][0])
    engine = BatchEngine(slow, EOS, prefill_chunk=CHUNK, prefill_step_factor=2.0)
    beside = []  # prompt tokens of each pass that ran while the stream was decoding
    plain = engine._prefill_pass

    def prefill_pass():
        decoding = any(s.token is not None for s in engine.seqs)
        done = plain()
        if decoding and done:
            beside.append(done)
        return done

    engine._prefill_pass = prefill_pass
    handles = [engine.queue.submit(r) for r in (stream, requests[4])]
    engine.start()
    try:
        got = [_tokens(h) for h in handles]
    finally:
        engine.close()
    assert got == [want, _tokens(solo[4][0])]
    assert len(beside) >= 10 and max(beside) <= 4, beside


def test_the_pacer_sizes_prefill_passes_to_the_decode_steps_time():
    pacer = PrefillPacer(2.0, budget=40)
    assert pacer.room == 1  # the first pass beside running streams: one token
    pacer.prefilled(1, 0.1)  # nothing decoded yet: no measure to size by
    assert pacer.room == 1
    pacer.decoded(1.0)
    rooms = []
    for _ in range(8):  # 0.1 s a token beside 1 s decode steps: 0.75 x (2 - 1) x 1 s holds 7 tokens
        pacer.prefilled(pacer.room, 0.1 * pacer.room)
        rooms.append(pacer.room)
    assert rooms[:5] == [2, 3, 5, 7, 7] and set(rooms[4:]) == {7}  # grows at most 1.5x a pass, then settles
    pacer.prefilled(7, 2.5)  # a pass 3.5x too slow: the next is sized at that cost at once
    assert pacer.room == 2
    pacer.prefilled(2, 100.0)
    assert pacer.room == 1  # never below one token: a prompt always progresses
    for _ in range(60):  # cheap passes again: the cost estimate comes back down, gradually
        pacer.prefilled(pacer.room, 0.1 * pacer.room)
    assert pacer.room == 7
    for _ in range(20):
        pacer.decoded(100.0)
        pacer.prefilled(pacer.room, 0.001 * pacer.room)
    assert pacer.room == 40  # never above the token budget


def _cancel_and_fail(rec, requests, want):
    """One sequence cancelled after its third token and one whose sampling fails: the others are unchanged."""
    requests = list(requests)
    requests[4] = replace(requests[4], request_id="boom")
    got, _ = _batch(rec, requests, engine_cls=Failing, cancel=0)
    assert got[0][-1].finish_reason == "cancelled"
    assert _tokens(got[0]) == want[0][0][: len(_tokens(got[0]))] and len(_tokens(got[0])) >= 3
    assert isinstance(got[4], RuntimeError)
    for i in (1, 2, 3, 5, 6, 7):
        assert _tokens(got[i]) == want[i][0], i


def _close_while_decoding(rec, request):
    """Shutting the engine down ends a running sequence's stream with "cancelled" (its consumer never hangs)."""
    engine = BatchEngine(rec, EOS, prefill_chunk=CHUNK).start()
    handle = engine.submit(replace(request, params=_greedy(200)))
    events = iter(handle)
    next(events)
    engine.close()
    assert [e.finish_reason for e in events][-1] == "cancelled"


def _prefix_restores_into_each_slot(rec, runner, spec, requests, solo):
    """The next turn of three of the conversations, batched with a prefix cache: each restores its own state, as
    the one-at-a-time engine with its own cache does (a state built by decode steps is not bit for bit the plain
    prefill's, so reuse is compared with reuse)."""
    picked = [3, 6]
    turns = [
        GenerationRequest(requests[i].prompt + tuple(_tokens(solo[i][0])) + _prompt(i + 50, 6), _greedy(4))
        for i in picked
    ]
    alone = prefix_cache(rec, replace(spec, prefix_cache_gb=1.0))
    want = [_solo(rec, [requests[i], turn], prefix=alone)[1] for i, turn in zip(picked, turns, strict=True)]
    cache = prefix_cache(rec, replace(spec, prefix_cache_gb=1.0))
    for i in picked:  # the first turns, each alone in the batch engine
        _batch(rec, [requests[i]], prefix=cache)
    got, _ = _batch(rec, turns, prefix=cache)
    for k, events in enumerate(got):
        assert events[0].stats.cached_tokens == want[k][0][0].stats.cached_tokens > 0, k
        assert _tokens(events) == _tokens(want[k][0]), k
        _assert_rows_match(rec.rows, k, want[k][1])
    # the first turns again (a regenerate): each prompt is held whole with its last logits, so nothing is prefilled
    again, _ = _batch(rec, [requests[i] for i in picked], prefix=cache)
    for k, i in enumerate(picked):
        assert again[k][0].stats.cached_tokens == len(requests[i].prompt), k
        assert _tokens(again[k]) == _tokens(solo[i][0]), k
        # the slot computed decode positions only (a prefill's last position would be the prompt's last)
        assert min(pos for slot, pos in rec.rows if slot == k) == len(requests[i].prompt), k


def test_a_decode_step_keeps_every_row_on_the_gemv_kernels():
    """Where prefill's matrix kernels win from few rows (AMX, the fp32 panel kernel), a batched decode step still
    multiplies its rows as GEMVs: each row's sums then do not depend on the batch (the exactness above)."""
    from dsflash.runtime.cpu import dense, native, rows
    from dsflash.runtime.experts import device

    with rows.decoding():
        for mode in (native.BF16X2, torch.float32, torch.bfloat16):
            assert device.gemv_rows(mode) == device.GEMV_MAX_ROWS
            assert dense._gemv_rows(mode, "bf16") == dense.GEMV_MAX_ROWS
            assert dense._gemv_rows(mode, "fp8") == native.fp8_gemv_max_rows(dense.GEMV_MAX_ROWS)
    assert not rows.is_decoding()
