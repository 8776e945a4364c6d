"""Engine: one sequence at a time on one thread; prefill in chunks, then decode steps; yields TokenEvents.

With a prefix cache (runtime/prefix/cache.py) a prompt starts from the deepest snapshot of a prefix of it, and the
engine snapshots at every cache block boundary of a prefill, at the prompt's end and at the request's end."""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

import torch

from dsflash.counters import ExpertCounters
from dsflash.errors import EngineDead, InvalidRequest, NotReady, OutOfMemory
from dsflash.runtime.prefix.cache import salt_digest
from dsflash.runtime.scheduler import speculative as spec_decode
from dsflash.runtime.scheduler.queue import GenerationRequest, Handle, RequestQueue, StepStats, TokenEvent
from dsflash.runtime.scheduler.sampler import Sampler, top_logprobs

log = logging.getLogger(__name__)


class Runner(Protocol):
    """What the engine drives: a model with its per-sequence state on some device(s)."""

    max_len: int
    vocab_size: int

    def reset(self) -> None: ...

    def forward(self, tokens: list[int], start_pos: int, all_logits: bool) -> torch.Tensor:
        """fp32 logits [s, V] (all positions) or [1, V] (last)."""
        ...

    def counters(self) -> ExpertCounters: ...


class Engine:
    max_num_seqs = 1  # sequences at once (runtime/scheduler/batch.py runs more)

    """submit(request) -> Handle. The engine thread owns the runner; nothing else touches it."""

    def __init__(self, runner: Runner, eos_ids: set[int], max_queue: int = 64, prefill_chunk: int = 512, prefix=None,
                 num_speculative_tokens: int | None = None):  # fmt: skip
        """prefix: a runtime.prefix.cache.PrefixCache over this runner, or None (every prompt prefilled whole);
        num_speculative_tokens: decode speculatively with the runner's DSpark head, this many drafts per verify
        (0: the head's block size; None: off). The runner must be built speculative."""
        self.runner, self.eos_ids = runner, set(eos_ids)
        self.prefill_chunk, self.prefix = prefill_chunk, prefix
        self.queue = RequestQueue(max_queue)
        self.current: Handle | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.counters = {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0, "tokens": 0, "prompt_tokens": 0,
                         "cached_tokens": 0}  # fmt: skip
        self.speculative, self.costs = None, spec_decode.Costs()
        if num_speculative_tokens is not None:
            block = runner.draft_block
            k = num_speculative_tokens or block
            if not 1 <= k <= block:
                raise ValueError(f"--num-speculative-tokens {k}: the DSpark head drafts 1..{block} tokens a pass")
            self.speculative = spec_decode.Speculative(k)
            self.counters.update(spec_decode.stats_keys())

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="dsflash-engine", daemon=True)
        self._thread.start()
        return self

    def close(self, cancel_running: bool = True) -> None:
        self._stop.set()
        if cancel_running and self.current is not None:
            self.current.cancel()
        self.queue.wake()
        if self._thread is not None:
            self._thread.join()
        self.queue.fail_all(EngineDead("the engine was shut down"))

    @property
    def running(self) -> int:
        """Sequences being prefilled or decoded now."""
        return int(self.current is not None)

    def step_histograms(self) -> dict[str, dict[int, int]]:
        """Decode steps by sequences advanced and steps by tokens computed (runtime/scheduler/batch.py keeps
        them; one sequence at a time every decode step is one token)."""
        return {"batch_size": {}, "step_tokens": {}}

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, request: GenerationRequest) -> Handle:
        self._check_running()
        self.validate(request)
        return self.queue.submit(request)

    def admit(self) -> None:
        """Raise what submit() would for any request now (NotReady, EngineDead, Overloaded) without queueing one, so
        that a caller learns it before its own costly work (templating a prompt)."""
        self._check_running()
        self.queue.check_room()

    def _check_running(self) -> None:
        if self._thread is None:
            raise NotReady("the engine is still loading")
        if self.queue.dead is not None:
            raise EngineDead(f"the engine stopped: {self.queue.dead}")
        if not self.alive:
            raise EngineDead("the engine thread is not running")

    def validate(self, request: GenerationRequest) -> None:
        n = len(request.prompt)
        if n == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if any(not 0 <= t < self.runner.vocab_size for t in request.prompt):
            raise InvalidRequest(f"prompt token ids must be in 0..{self.runner.vocab_size - 1}", param="prompt")
        # the caller (service.generator) checks prompt + max_tokens against the context and tells the client; this
        # only keeps a caller that did not from running the sequence past the runner's state
        if n + request.params.max_tokens > self.runner.max_len:
            raise ValueError(
                f"{n} prompt + {request.params.max_tokens} new tokens exceed the runner's {self.runner.max_len}"
            )

    # ---- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        handle = None
        try:
            while not self._stop.is_set():
                handle = self.queue.take(timeout=0.5)
                if handle is None:
                    continue
                self.current = handle
                try:
                    self._run(handle)
                except EngineDead as e:  # the runner is gone (a rank died): no later request can run either
                    self.counters["failed"] += 1
                    handle.close(e)
                    handle = None
                    raise
                except Exception as e:  # one request's failure (e.g. in sampling) must not stop the engine
                    log.exception("request %s failed", handle.request.request_id)
                    self.counters["failed"] += 1
                    handle.close(request_error(e, handle.request))
                finally:
                    self.current = None
                handle = None
        except BaseException as e:  # the thread itself is going down: fail everyone, never hang them
            log.error("engine thread stopped: %s", e)
            self.queue.fail_all(e if isinstance(e, EngineDead) else EngineDead(f"the engine failed: {e}"))
            if handle is not None:
                handle.close(EngineDead(f"the engine failed: {e}"))

    def _run(self, handle: Handle) -> None:
        req, params = handle.request, handle.request.params
        self.counters["requests"] += 1
        if handle.cancelled:
            return self._finish(handle, TokenEvent(None, 0, finish_reason="cancelled"))
        handle.started.set()
        t0, experts_start = time.perf_counter(), self.runner.counters()
        prompt = list(req.prompt)
        logits = self._prefill(handle, prompt, params.prompt_logprobs)
        if logits is None:
            return self._finish(handle, TokenEvent(None, 0, finish_reason="cancelled"))
        last, prompt_lp, cached = logits
        self.counters["prompt_tokens"] += len(prompt)
        self.counters["cached_tokens"] += cached
        # experts_start lets the consumer turn the runner's cumulative counters into this request's share
        stats = StepStats(experts_start, self.runner.counters(), ttft_s=time.perf_counter() - t0, cached_tokens=cached)
        fed: list[int] = []  # generated tokens the runner consumed (the last sampled one never is)
        decode = self._decode if self.speculative is None else self._decode_speculative
        decode(handle, last, prompt_lp, stats, fed)
        if fed:  # the state holds prompt + fed (not after a failure: a forward may have stopped half-way)
            self._save(req, prompt + fed)

    def _decode(self, handle: Handle, last, prompt_lp, stats: StepStats, fed: list[int]) -> None:
        req, params = handle.request, handle.request.params
        sampler, experts_start = Sampler(params), stats.experts_start
        pos, first = len(req.prompt), last  # the prompt-end snapshot keeps the prompt's last logits
        for index in range(params.max_tokens):
            s = sampler(last)
            stop = (s.token in self.eos_ids and not params.ignore_eos) or s.token in params.stop_token_ids
            done = "stop" if stop else ("length" if index + 1 == params.max_tokens else None)
            event = TokenEvent(s.token, index, s.logprob, s.top, done, stop_token=stop, stats=stats)
            if index == 0:
                event.prompt_logprobs = prompt_lp
            self.counters["tokens"] += 1
            if done:
                self._finish(handle, event)
                if index == 0:
                    self._save(req, req.prompt, first)
                return
            handle.put(event)
            if index == 0:  # after the first token went out: TTFT does not wait for the copy
                self._save(req, req.prompt, first)
            if handle.cancelled:
                return self._finish(handle, TokenEvent(None, index + 1, finish_reason="cancelled"))
            t = time.perf_counter()
            last = self.runner.forward([s.token], pos, False)[-1]
            fed.append(s.token)
            pos += 1
            stats = StepStats(experts_start, self.runner.counters(), step_s=time.perf_counter() - t)
        # max_tokens == 0: only the prompt was scored (echo + logprobs)
        self._finish(handle, TokenEvent(None, 0, finish_reason="length", prompt_logprobs=prompt_lp, stats=stats))
        self._save(req, req.prompt, first)

    def _decode_speculative(self, handle: Handle, last, prompt_lp, stats: StepStats, fed: list[int]) -> None:
        spec_decode.decode(self, handle, last, prompt_lp, stats, fed)

    def speculative_stats(self) -> dict[str, float]:
        """What /metrics shows of speculation (empty when it is off): counters and the mean accepted per verify."""
        if self.speculative is None:
            return {}
        c = {k: self.counters[k] for k in spec_decode.stats_keys()}
        c["spec_mean_accepted"] = c["spec_accepted_tokens"] / c["spec_verifies"] if c["spec_verifies"] else 0.0
        return c

    def _prefill(self, handle: Handle, prompt: list[int], prompt_logprobs: int | None):
        """Chunked prefill from the deepest snapshot of a prefix (none where every position's logits are asked
        for) -> (last logits [V], prompt logprobs or None, tokens restored), or None when cancelled."""
        start, held = self._restore(handle.request) if prompt_logprobs is None else (0, None)
        if held is not None:  # the whole prompt, with its last logits: nothing to prefill
            return held, None, start
        if not start:
            self.runner.reset()
        lps = [None] if prompt_logprobs is not None else None
        logits, pos = None, start
        while pos < len(prompt):
            if handle.cancelled:
                return None
            # passes end on multiples of the chunk, as a prefill from 0 does: after a restore the passes line up
            # with a plain prefill's again (the products' rounding depends on their shapes), and on the cache's
            # block boundaries, where snapshots are taken
            end = min(len(prompt), (pos // self.prefill_chunk + 1) * self.prefill_chunk)
            if self.prefix is not None:
                end = min(end, (pos // self.prefix.block + 1) * self.prefix.block)
            logits = self.runner.forward(prompt[pos:end], pos, prompt_logprobs is not None)
            if lps is not None:
                lps += _prompt_logprobs(logits, prompt, pos, prompt_logprobs)
            if self.prefix is not None and end < len(prompt) and end % self.prefix.block == 0:
                self._save(handle.request, prompt[:end])
            pos = end
        return logits[-1], (lps[: len(prompt)] if lps is not None else None), start

    def _restore(self, req: GenerationRequest) -> tuple[int, torch.Tensor | None]:
        """The runner's state set to the deepest cached prefix of the prompt -> (its length, 0: none; the logits
        after it where that is the whole prompt, else None)."""
        if self.prefix is None:
            return 0, None
        salt = salt_digest(req.cache_salt)
        while (entry := self.prefix.lookup(salt, req.prompt)) is not None:
            logits = entry.logits
            restored = self.prefix.restore(entry)  # 0: a bad file, now forgotten: the next deepest is tried
            if restored:
                return restored, (logits if restored == len(req.prompt) else None)
        return 0, None

    def _save(self, req: GenerationRequest, tokens, logits: torch.Tensor | None = None) -> None:
        if self.prefix is not None:
            self.prefix.save(salt_digest(req.cache_salt), tokens, logits)

    def _finish(self, handle: Handle, event: TokenEvent) -> None:
        key = {"cancelled": "cancelled"}.get(event.finish_reason, "completed")
        self.counters[key] += 1
        handle.put(event)
        handle.close()


def request_error(e: Exception, request: GenerationRequest) -> Exception:
    """What a failed request is told: an allocation that failed (host MemoryError, torch's CPU allocator or CUDA out
    of memory) becomes OutOfMemory with its cause and what to change; anything else as it was. The next request
    starts from a reset (or restored) state, so nothing of the failed one stays."""
    text = str(e)
    if isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())
    ):
        return OutOfMemory(
            f"this request ran out of memory ({len(request.prompt):,}-token prompt): send a shorter prompt, or start "
            "the server with a smaller --prefill-chunk or --max-model-len"
        )
    return e


def _prompt_logprobs(logits: torch.Tensor, prompt: list[int], start: int, k: int) -> list:
    """Logprob of each next prompt token under the logits before it, with the top k alternatives."""
    out = []
    lp = torch.log_softmax(logits.float(), dim=-1)
    for i in range(logits.shape[0]):
        nxt = start + i + 1
        if nxt >= len(prompt):
            break
        out.append((prompt[nxt], float(lp[i, prompt[nxt]]), top_logprobs(lp[i], k)))
    return out
