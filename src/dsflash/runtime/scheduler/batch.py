"""BatchEngine: continuous batching over a runner with several sequence slots (EngineSpec.max_num_seqs > 1).

Every engine step advances each decoding sequence by one token in one batched decode call (runner.decode), and
between two such steps the oldest admitted prompt gets one prefill pass, of at most the step's token budget minus
the decoding sequences (vLLM's max_num_batched_tokens): running streams keep streaming while a long prompt is
admitted. A request leaves the FIFO queue when a slot frees. Everything about a request is its own: its sampler
(seed), stop rules, logprobs and max_tokens; a cancelled sequence leaves at the next step; a sequence whose sampling
fails fails alone. A batched step that fails takes only the sequences in it (their states may be half-written),
unless the runner is gone (EngineDead), which ends the engine as before.

With a prefix cache, a sequence is restored into its slot on admission and snapshotted at the same points as in
the one-at-a-time engine (runtime/scheduler/engine.py); snapshots address the selected slot (runner.select).

An n-sequence request (submit_n: OpenAI's n / best_of) is one queue entry whose prompt is prefilled once, in its
first sequence's slot; the state is then copied into each sibling's slot (runner.snapshot, select, restore under a
private key) and every sibling starts from the same last logits, with its own sampler. Siblings take free slots
before the queue's next request; with one slot they run one after another from the same copy. A runner that keeps
no snapshots (the TP runner with the prefix cache off) has each sibling prefill the prompt itself."""

from __future__ import annotations

import logging
import math
import queue
import time
from dataclasses import dataclass, field, replace

import torch

from dsflash.errors import EngineDead
from dsflash.runtime.scheduler.engine import Engine, _prompt_logprobs, request_error
from dsflash.runtime.scheduler.queue import GenerationRequest, Handle, StepStats, TokenEvent
from dsflash.runtime.scheduler.sampler import Sampler, SamplingParams

log = logging.getLogger(__name__)


class Fork:
    """The consumer side of an n-sequence request: iterate (sequence index, TokenEvent) until every sequence
    ended; an error of any sequence is raised; cancel() cancels them all."""

    def __init__(self, request: GenerationRequest, params: list[SamplingParams]):
        self.request, self.events = request, queue.SimpleQueue()
        self.branches: list[Branch] = []
        self.params = params

    def make(self, request: GenerationRequest, owner) -> Branch:
        """The queue's handle factory: the first sequence is the one queued; its siblings wait in the engine."""
        self.branches = [Branch(replace(request, params=p), self, i) for i, p in enumerate(self.params)]
        self.branches[0]._owner = owner
        return self.branches[0]

    @property
    def started(self):
        return self.branches[0].started

    def cancel(self) -> None:
        for b in self.branches[1:]:
            b._cancel.set()
        first = self.branches[0]
        first.cancel()  # still queued: withdrawn and answered now, and so are the siblings
        if first.state == "withdrawn":
            for b in self.branches[1:]:
                b.put(TokenEvent(None, 0, finish_reason="cancelled"))
                b.close()

    def __iter__(self):
        open_ = len(self.branches)
        while open_:
            i, item = self.events.get()
            if item is Handle._DONE:
                open_ -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            yield i, item


class Branch(Handle):
    """One sequence of a Fork: its events go to the fork's one stream, tagged with its index."""

    def __init__(self, request: GenerationRequest, fork: Fork, index: int):
        super().__init__(request)
        self.fork, self.index = fork, index
        self._closed = False

    def put(self, item) -> None:
        if not self._closed:
            self.fork.events.put((self.index, item))

    def close(self, error: BaseException | None = None) -> None:
        if not self._closed:  # once: a fork's stream counts its sequences' endings
            self._closed = True
            self.fork.events.put((self.index, error if error is not None else Handle._DONE))


@dataclass
class _Group:
    """Where an n-sequence request's shared prompt stands in the engine: the siblings waiting for a slot, and once
    the prompt is prefilled, the snapshot key of its state (None: each prefills itself) and its last logits."""

    pending: list[Branch]
    ready: bool = False
    key: int | None = None
    last: torch.Tensor | None = None
    lps: list | None = None
    stats: StepStats | None = None
    cached: int = 0


class PrefillPacer:
    """How many prompt tokens join a step beside decoding sequences so that the step takes about `factor` times
    its decode call: the prefill share gets (factor - 1) decode calls' time, of which a pass is sized to fill
    SAFETY at the prompt's measured cost per token. That cost follows a slower pass at once and a faster one
    gradually (a small pass's cost varies with the experts its tokens happen to touch), and the room grows at most
    1.5x a pass (at least one token, at most the budget); the first pass beside running streams is one token, so a
    long prompt's admission never opens with one long gap. Pass boundaries then depend on timing; each pass's
    products are the same math, so outputs agree with a solo run as batched ones do."""

    SAFETY = 0.75

    def __init__(self, factor: float, budget: int):
        self.share, self.budget = factor - 1.0, budget
        self.room = 1
        self.decode_s: float | None = None
        self.per_token: float | None = None

    def decoded(self, seconds: float) -> None:
        self.decode_s = seconds if self.decode_s is None else 0.7 * self.decode_s + 0.3 * seconds

    def prefilled(self, tokens: int, seconds: float) -> None:
        if self.decode_s is None or seconds <= 0 or tokens <= 0:
            return
        per = seconds / tokens
        slower = self.per_token is None or per > self.per_token
        self.per_token = per if slower else 0.8 * self.per_token + 0.2 * per
        fits = math.floor(self.SAFETY * self.share * self.decode_s / self.per_token)
        self.room = max(1, min(self.budget, fits, max(self.room + 1, math.ceil(1.5 * self.room))))


@dataclass
class Seq:
    """One running request: its slot (decode state on every rank) and where it stands."""

    handle: Handle
    slot: int
    sampler: Sampler
    experts_start: object
    t0: float
    pos: int = 0  # tokens its state holds
    cached: int = 0  # of them restored from a snapshot
    lps: list | None = None  # prompt logprobs so far (asked for)
    last: torch.Tensor | None = None  # logits [V] the next token is sampled from
    token: int | None = None  # the sampled token the next decode step feeds
    index: int = 0  # tokens generated
    fed: list[int] = field(default_factory=list)
    stats: StepStats | None = None
    group: _Group | None = None  # the first sequence of an n-sequence request (its siblings wait on its prefill)

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.handle.request.prompt

    @property
    def prefilling(self) -> bool:
        return self.last is None and self.token is None


class StepLog:
    """What the engine's steps did, for /metrics, as cumulative counts (bounded, read from any thread): decode
    steps by how many sequences they advanced, engine steps by how many tokens they computed."""

    def __init__(self):
        self.batch_sizes: dict[int, int] = {}
        self.step_tokens: dict[int, int] = {}

    def add(self, batch: int, tokens: int) -> None:
        if batch:
            self.batch_sizes[batch] = self.batch_sizes.get(batch, 0) + 1
        if tokens:
            self.step_tokens[tokens] = self.step_tokens.get(tokens, 0) + 1

    def histograms(self) -> dict[str, dict[int, int]]:
        return {"batch_size": dict(self.batch_sizes), "step_tokens": dict(self.step_tokens)}


class BatchEngine(Engine):
    """Engine with up to runner.n_seqs sequences at once; submit / admit / close as Engine."""

    def __init__(self, runner, eos_ids, max_queue: int = 64, prefill_chunk: int = 512, prefix=None,
                 max_num_batched_tokens: int | None = None, prefill_step_factor: float | None = None):  # fmt: skip
        super().__init__(runner, eos_ids, max_queue, prefill_chunk, prefix)
        self.max_num_seqs = runner.n_seqs
        self.budget = max_num_batched_tokens or prefill_chunk + self.max_num_seqs
        if self.budget <= self.max_num_seqs:
            raise ValueError(f"a step's {self.budget} tokens leave no room for prefill beside {self.max_num_seqs}")
        self.pacer = PrefillPacer(prefill_step_factor, self.budget) if prefill_step_factor else None
        self.seqs: list[Seq] = []  # admission order: the oldest prompt is prefilled first
        self.steps = StepLog()
        self._selected: int | None = None
        self._groups: list[_Group] = []  # n-sequence requests with siblings still waiting, oldest first
        self._fork_keys = 0
        # a state copy between slots goes through the runner's snapshots (a TP runner keeps none without the cache)
        self.can_fork = getattr(runner, "snapshot_identity", None) is not None

    def submit_n(self, request: GenerationRequest, params: list[SamplingParams]) -> Fork:
        """len(params) sequences continuing one prompt, sequence i sampled with params[i] -> their Fork."""
        self._check_running()
        self.validate(request)
        fork = Fork(request, params)
        self.queue.submit(request, make=fork.make)
        return fork

    @property
    def running(self) -> int:
        return len(self.seqs)

    def step_histograms(self) -> dict[str, dict[int, int]]:
        return self.steps.histograms()

    def close(self, cancel_running: bool = True) -> None:
        if cancel_running:
            for s in list(self.seqs):
                s.handle.cancel()
        super().close(cancel_running)

    # ---- the engine thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._admit()
                if not self.seqs:
                    continue
                self._reap_cancelled()
                prefilled = self._prefill_pass()
                decoded = self._decode_step()
                self.steps.add(decoded, decoded + prefilled)
            for seq in list(self.seqs):  # shut down (close() cancelled them): each consumer gets its ending
                self._finish(seq.handle, TokenEvent(None, seq.index, finish_reason="cancelled"))
                self._leave(seq)
            for g in self._groups:
                for b in g.pending:
                    self._finish(b, TokenEvent(None, 0, finish_reason="cancelled"))
            self._groups = []
        except BaseException as e:  # the thread itself is going down: fail everyone, never hang them
            log.error("engine thread stopped: %s", e)
            dead = e if isinstance(e, EngineDead) else EngineDead(f"the engine failed: {e}")
            self.queue.fail_all(dead)
            for s in self.seqs:
                s.handle.close(dead)
            for g in self._groups:
                for b in g.pending:
                    b.close(dead)
            self.seqs, self._groups = [], []

    def _admit(self) -> None:
        """Take waiting siblings of admitted requests, then waiting requests, into free slots (FIFO); block briefly
        only when nothing runs."""
        self._admit_siblings()
        while len(self.seqs) < self.max_num_seqs and not self._groups:
            handle = self.queue.take(timeout=0 if self.seqs else 0.5)
            if handle is None:
                return
            self.counters["requests"] += 1
            siblings = handle.fork.branches[1:] if isinstance(handle, Branch) else []
            if handle.cancelled:
                for h in (handle, *siblings):
                    self._finish(h, TokenEvent(None, 0, finish_reason="cancelled"))
                continue
            handle.started.set()
            seq = self._seat(handle)
            if siblings:
                seq.group = _Group(list(siblings))
                self._groups.append(seq.group)
            self._guard(seq, self._begin, seq)

    def _seat(self, handle: Handle) -> Seq:
        used = {s.slot for s in self.seqs}
        slot = min(set(range(self.max_num_seqs)) - used)
        seq = Seq(handle, slot, Sampler(handle.request.params), self.runner.counters(), time.perf_counter())
        self.seqs.append(seq)
        return seq

    def _admit_siblings(self) -> None:
        """Siblings whose shared prompt is prefilled start in free slots from its copy (cancelled ones end)."""
        for g in list(self._groups):
            for b in [b for b in g.pending if b.cancelled]:
                g.pending.remove(b)
                self._finish(b, TokenEvent(None, 0, finish_reason="cancelled"))
            while g.ready and g.pending and len(self.seqs) < self.max_num_seqs:
                seq = self._seat(g.pending.pop(0))
                seq.t0 = time.perf_counter()
                self._guard(seq, self._fork_begin, seq, g)
            if not g.pending:
                self._groups.remove(g)
                if g.key is not None:
                    self.runner.drop(g.key, memory=True, disk=False)

    def _fork_begin(self, seq: Seq, g: _Group) -> None:
        """The slot's state set to the shared prompt's copy; the first token sampled from the shared logits."""
        if g.key is None:  # no copy to start from: this sequence prefills the prompt itself
            return self._begin(seq)
        self._select(seq.slot)
        if not self.runner.restore(g.key, len(seq.prompt), False, True):
            raise RuntimeError("the shared prompt's state copy is gone")
        seq.pos, seq.cached, seq.lps, seq.stats = len(seq.prompt), g.cached, g.lps, g.stats
        seq.last = g.last
        self._emit(seq)

    def _share_prompt(self, seq: Seq, last: torch.Tensor) -> None:
        """The first sequence's prompt is prefilled: keep its state and logits for the siblings."""
        g = seq.group
        g.last, g.lps, g.stats, g.cached, g.ready = last, seq.lps, seq.stats, seq.cached, True
        if self.can_fork:
            self._fork_keys += 1
            key = -self._fork_keys  # prefix keys are hashes >= 0: a private key never meets one
            self.runner.snapshot(key, True, False, seq.prompt, "")
            g.key = key

    def _begin(self, seq: Seq) -> None:
        """The slot's state set to the deepest cached prefix of the prompt (prompt logprobs: none), else reset."""
        self._select(seq.slot)
        asked = seq.handle.request.params.prompt_logprobs
        seq.pos, held = self._restore(seq.handle.request) if asked is None else (0, None)
        seq.cached = seq.pos
        if not seq.pos:
            self.runner.reset()
        seq.lps = [None] if asked is not None else None
        if held is not None:  # the whole prompt, with its last logits: nothing to prefill
            self._prefilled(seq, held)

    def _select(self, slot: int) -> None:
        if self._selected != slot:
            self.runner.select(slot)
            self._selected = slot

    def _guard(self, seq: Seq, fn, *args) -> None:
        """fn(*args) for one sequence: its failure fails that sequence alone (EngineDead ends the engine)."""
        try:
            fn(*args)
        except EngineDead:
            raise
        except Exception as e:
            self._fail(seq, e)

    def _fail(self, seq: Seq, e: Exception) -> None:
        log.exception("request %s failed", seq.handle.request.request_id, exc_info=e)
        self.counters["failed"] += 1
        e = request_error(e, seq.handle.request)
        seq.handle.close(e)
        self._leave(seq)
        self._orphan(seq, lambda b: b.close(e))

    def _orphan(self, seq: Seq, end) -> None:
        """The first sequence of a request left before its prompt was shared: its waiting siblings end with it."""
        g = seq.group
        if g is not None and not g.ready:
            for b in g.pending:
                end(b)
            g.pending = []
            self._groups.remove(g)

    def _leave(self, seq: Seq) -> None:
        if seq in self.seqs:
            self.seqs.remove(seq)

    def _reap_cancelled(self) -> None:
        for seq in [s for s in self.seqs if s.handle.cancelled]:
            self._guard(seq, self._cancel, seq)

    def _cancel(self, seq: Seq) -> None:
        self._finish(seq.handle, TokenEvent(None, seq.index, finish_reason="cancelled"))
        self._end(seq)
        self._orphan(seq, lambda b: self._finish(b, TokenEvent(None, 0, finish_reason="cancelled")))

    def _end(self, seq: Seq) -> None:
        """The sequence leaves its slot; its state (prompt + the tokens fed) is snapshotted first."""
        self._leave(seq)
        if seq.fed:
            self._select(seq.slot)
            self._save(seq.handle.request, seq.prompt + tuple(seq.fed))

    # ---- prefill ----
    def _prefill_pass(self) -> int:
        """Prefill passes for the sequences still prefilling, oldest first, within the step's budget -> tokens.
        The oldest always gets one (cut to the budget); a later one only where its whole pass fits."""
        decoding = sum(1 for s in self.seqs if s.token is not None)
        room = self.budget - decoding
        if self.pacer is not None and decoding:
            room = min(room, self.pacer.room)
        done, t = 0, time.perf_counter()
        for seq in [s for s in self.seqs if s.prefilling]:
            n = self._pass_end(seq, room) - seq.pos
            if done and n < self._pass_end(seq, len(seq.prompt)) - seq.pos:
                break
            pos = seq.pos
            self._guard(seq, self._prefill_chunk, seq, room)
            room -= seq.pos - pos
            done += seq.pos - pos
            if room <= 0:
                break
        if self.pacer is not None and decoding and done:
            self.pacer.prefilled(done, time.perf_counter() - t)
        return done

    def _pass_end(self, seq: Seq, room: int) -> int:
        # passes end where the one-at-a-time engine's do (chunk multiples, cache blocks): the same products
        pos = seq.pos
        end = min(len(seq.prompt), (pos // self.prefill_chunk + 1) * self.prefill_chunk, pos + room)
        if self.prefix is not None:
            end = min(end, (pos // self.prefix.block + 1) * self.prefix.block)
        return end

    def _prefill_chunk(self, seq: Seq, room: int) -> None:
        prompt, req = list(seq.prompt), seq.handle.request
        asked = req.params.prompt_logprobs
        pos, end = seq.pos, self._pass_end(seq, room)
        self._select(seq.slot)
        logits = self.runner.forward(prompt[pos:end], pos, asked is not None)
        seq.pos = end
        if seq.lps is not None:
            seq.lps += _prompt_logprobs(logits, prompt, pos, asked)
        if end < len(prompt):
            if self.prefix is not None and end % self.prefix.block == 0:
                self._save(req, prompt[:end])
            return
        self._prefilled(seq, logits[-1])

    def _prefilled(self, seq: Seq, last: torch.Tensor) -> None:
        """The prompt is in the slot's state (prefilled or restored whole) and `last` its last logits."""
        prompt, req = list(seq.prompt), seq.handle.request
        self.counters["prompt_tokens"] += len(prompt)
        self.counters["cached_tokens"] += seq.cached
        if seq.lps is not None:
            seq.lps = seq.lps[: len(prompt)]
        seq.last = last
        seq.stats = StepStats(seq.experts_start, self.runner.counters(), ttft_s=time.perf_counter() - seq.t0,
                              cached_tokens=seq.cached)  # fmt: skip
        if req.params.max_tokens == 0:  # only the prompt was scored (echo + logprobs)
            event = TokenEvent(None, 0, finish_reason="length", prompt_logprobs=seq.lps, stats=seq.stats)
            for h in (seq.handle, *(seq.group.pending if seq.group else ())):
                self._finish(h, replace(event))
            if seq.group is not None:
                seq.group.pending = []
                self._groups.remove(seq.group)
            self._leave(seq)
            self._save(req, prompt, last)
            return
        if seq.group is not None:
            self._share_prompt(seq, seq.last)
        self._emit(seq)

    # ---- decode ----
    def _decode_step(self) -> int:
        """Every sequence with a token to feed advances by one, in one batched call -> how many."""
        batch = [s for s in self.seqs if s.token is not None]
        if not batch:
            return 0
        t = time.perf_counter()
        try:
            if len(batch) == 1:  # the one-sequence step, as the one-at-a-time engine takes it
                self._select(batch[0].slot)
                logits = self.runner.forward([batch[0].token], batch[0].pos, False)[-1:]
            else:
                logits = self.runner.decode([s.token for s in batch], [s.pos for s in batch], [s.slot for s in batch])
        except EngineDead:
            raise
        except Exception as e:  # the step's states may be half-written: its sequences end, the others go on
            for s in batch:
                self._fail(s, e)
            return 0
        dt = time.perf_counter() - t
        if self.pacer is not None:
            self.pacer.decoded(dt)
        counters = self.runner.counters()
        for i, s in enumerate(batch):
            s.fed.append(s.token)
            s.pos += 1
            s.token, s.last = None, logits[i]
            s.stats = StepStats(s.experts_start, counters, step_s=dt)
            self._guard(s, self._emit, s)
        return len(batch)

    def _emit(self, seq: Seq) -> None:
        """Sample the sequence's next token from its last logits and send it; it finishes or waits to be fed."""
        req, params = seq.handle.request, seq.handle.request.params
        s, index, first = seq.sampler(seq.last), seq.index, seq.last
        seq.last = None
        stop = (s.token in self.eos_ids and not params.ignore_eos) or s.token in params.stop_token_ids
        done = "stop" if stop else ("length" if index + 1 == params.max_tokens else None)
        event = TokenEvent(s.token, index, s.logprob, s.top, done, stop_token=stop, stats=seq.stats)
        if index == 0:
            event.prompt_logprobs = seq.lps
        self.counters["tokens"] += 1
        seq.index += 1
        if done:
            self._finish(seq.handle, event)
            if index == 0:
                self._leave(seq)
                self._select(seq.slot)
                self._save(req, req.prompt, first)
            else:
                self._end(seq)
            return
        seq.handle.put(event)
        if index == 0:  # after the first token went out: TTFT does not wait for the copy (nor for the logits')
            self._select(seq.slot)
            self._save(req, req.prompt, first)
        if seq.handle.cancelled:
            self._finish(seq.handle, TokenEvent(None, index + 1, finish_reason="cancelled"))
            self._end(seq)
            return
        seq.token = s.token
