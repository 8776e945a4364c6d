"""Bounded FIFO of requests with cancellation handles; one sequence runs at a time."""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass, field

from dsflash.counters import ExpertCounters
from dsflash.errors import EngineDead, Overloaded
from dsflash.runtime.scheduler.sampler import SamplingParams

_ids = itertools.count(1)


@dataclass(frozen=True)
class GenerationRequest:
    prompt: tuple[int, ...]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    cache_salt: str | None = None  # prefixes match only requests with the same salt


@dataclass(frozen=True)
class StepStats:
    """What the runner counted up to an event, so that a consumer can tell one request's share."""

    experts_start: ExpertCounters  # the runner's counters when the request's prefill began
    experts: ExpertCounters  # ... after the step that produced this event
    ttft_s: float | None = None  # prefill seconds (on the first event)
    step_s: float | None = None  # the decode step's seconds (on later events)
    cached_tokens: int = 0  # prompt tokens restored from a prefix snapshot (on the first event)


@dataclass
class TokenEvent:
    """One generated token (or only a finish / prompt-logprob record when token is None)."""

    token: int | None
    index: int  # 0-based position in the completion
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None
    finish_reason: str | None = None  # stop | length | cancelled
    stop_token: bool = False  # the token is EOS / a stop id: counted, never rendered as text
    prompt_logprobs: list | None = None  # on the first event when asked: per prompt position (None for 0)
    stats: StepStats | None = None


class Handle:
    """The consumer side of one request: iterate TokenEvents, cancel between steps."""

    _DONE = object()

    def __init__(self, request: GenerationRequest, owner: RequestQueue | None = None):
        self.request = request
        self._events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self.started = threading.Event()
        self._owner = owner
        self.state = "queued"  # queued | taken | withdrawn; guarded by the owner's lock

    def cancel(self) -> None:
        self._cancel.set()
        if self._owner is not None:
            self._owner.withdraw(self)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def put(self, item) -> None:
        self._events.put(item)

    def close(self, error: BaseException | None = None) -> None:
        self._events.put(error if error is not None else self._DONE)

    def __iter__(self):
        while True:
            item = self._events.get()
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class RequestQueue:
    """FIFO bounded by max_size (full -> Overloaded with a retry hint)."""

    def __init__(self, max_size: int):
        self.max_size = max_size
        self._q: queue.Queue[Handle | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self.withdrawn = 0  # requests cancelled while they waited (never reach the engine)
        self.dead: BaseException | None = None

    def submit(self, request: GenerationRequest, make=None) -> Handle:
        """make(request, owner) -> the Handle to queue (default: a Handle; runtime/scheduler/batch.py queues the
        first sequence of an n-sequence request)."""
        with self._lock:  # fail_all holds it too: a request either sees the engine dead or is drained by it
            if self.dead is not None:
                raise EngineDead(f"the engine stopped: {self.dead}")
            self.check_room()
            self._waiting += 1
            handle = (make or Handle)(request, self)
            self._q.put(handle)
        return handle

    def check_room(self) -> None:
        """Overloaded (with a retry hint) when max_size requests already wait."""
        if self._waiting >= self.max_size:
            raise Overloaded(f"the request queue is full ({self.max_size} waiting)", retry_after=1)

    def take(self, timeout: float | None = None) -> Handle | None:
        while True:
            try:
                handle = self._q.get(timeout=timeout)
            except queue.Empty:
                return None
            if handle is None:
                return None
            with self._lock:
                if handle.state == "withdrawn":
                    continue  # cancelled while waiting: already answered and uncounted
                handle.state = "taken"
                self._waiting -= 1
            return handle

    def withdraw(self, handle: Handle) -> None:
        """A request cancelled while it waits leaves the queue now: its slot frees and its consumer is answered
        at once (a client that went away must not hold a place in a full queue until the engine reaches it)."""
        with self._lock:
            if handle.state != "queued":
                return
            handle.state = "withdrawn"
            self._waiting -= 1
            self.withdrawn += 1
        handle.put(TokenEvent(None, 0, finish_reason="cancelled"))
        handle.close()

    def wake(self) -> None:
        self._q.put(None)

    @property
    def depth(self) -> int:
        return self._waiting

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            self.dead = error
        while True:
            handle = self.take(timeout=0)
            if handle is None and self._q.empty():
                return
            if handle is not None:
                handle.close(error)
