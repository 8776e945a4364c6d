"""Generator: a chat or completion request -> prompt ids -> engine -> text stream tools -> Deltas; the service a
server talks to (admission, gauges and the model's facts included), never to the engine itself.

Runs on the caller's thread (an HTTP worker), never on the engine thread: the engine sees token ids only.
The one check of prompt + max_tokens against the context is here, where the prompt's length is known.
Text order per token: detokenizer -> `</think>` split (chat, when the prompt opened `<think>`) -> DSML tool calls
(chat with tools) -> stop strings (content only; a match cancels the engine's handle).

n > 1 (and best_of) are several sequences of one prompt: one text pipeline and one seed each (the request's seed
+ i, as vLLM derives them); the engine prefills the prompt once where it can fork it (runtime/scheduler/batch.py's
submit_n), else the sequences run one after another as plain requests. Deltas carry their choice's index.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

from dsflash.errors import ContextTooLong, InvalidRequest, Overloaded
from dsflash.runtime.scheduler.queue import GenerationRequest, Handle, StepStats, TokenEvent
from dsflash.runtime.scheduler.sampler import SamplingParams
from dsflash.service.api import (
    PREFIX_METRICS,
    ChatRequest,
    CompletionRequest,
    Delta,
    GenerationOptions,
    PromptLogprob,
    RequestStats,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from dsflash.text.chat import encode_chat
from dsflash.text.detokenizer import Detokenizer, token_text
from dsflash.text.grammar import Grammar, GrammarCache
from dsflash.text.reasoning import REASONING, ReasoningParser
from dsflash.text.stops import StopMatcher
from dsflash.text.tokenizer import BOS, Tokenizer
from dsflash.text.tools import ToolCall, ToolCallParser

if TYPE_CHECKING:
    from dsflash.runtime.scheduler.engine import Engine
    from dsflash.service.boot import Booted

# Retry-After bounds: under 1 s a client's retry comes back before anything moved; the openai client honours at most
# 60 s (it falls back to its own backoff above), and a longer hint only keeps a client away from a queue that may
# drain sooner than the estimate
RETRY_MIN_S, RETRY_MAX_S = 1, 60
RECENT = 16  # requests whose service time the queue's expected wait is estimated from


class Generator:
    """Requests in, Iterator[Delta] out, over a started runtime.scheduler.engine.Engine."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        max_len: int,
        release: str = "v41",
        clock=time.perf_counter,
        max_tokens_default: int | None = None,
        max_tokens_limit: int | None = None,
    ):
        """max_tokens_default: what a request without max_tokens may generate at most (None: the rest of the
        context); max_tokens_limit: the most a request may ask for (None: what the context leaves)."""
        self.engine, self.tokenizer, self.max_len, self.release = engine, tokenizer, max_len, release
        self.clock = clock
        self.max_tokens_default, self.max_tokens_limit = max_tokens_default, max_tokens_limit
        self.recent_s: deque[float] = deque(maxlen=RECENT)  # engine time (prefill + decode) of recent requests
        self.grammars = GrammarCache(tokenizer)

    @classmethod
    def serving(cls, booted: Booted) -> Generator:
        """The service over what boot produced."""
        o = booted.opts
        return cls(booted.engine, booted.tokenizer, booted.max_len, booted.files.ckpt.config.model_type,
                   max_tokens_default=o.max_tokens_default, max_tokens_limit=o.max_tokens_limit)  # fmt: skip

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    # ---- admission and gauges -----------------------------------------------------------------------------------
    def check_admission(self) -> None:
        """Before any text work: NotReady (the engine is not started), EngineDead, or Overloaded (the queue is
        full; the server's 429 with Retry-After, the queue's expected wait)."""
        try:
            self.engine.admit()
        except Overloaded as e:
            raise Overloaded(str(e), retry_after=self.expected_wait()) from None

    def expected_wait(self) -> int:
        """Seconds until a place in the queue is likely free: every request ahead (waiting and running) at the
        recent mean engine time each; within [RETRY_MIN_S, RETRY_MAX_S]."""
        if not self.recent_s:
            return RETRY_MIN_S
        # sequences run max_num_seqs at a time: the queue drains that many times faster
        ahead = self.engine.queue.depth + self.engine.running
        wait = ahead * sum(self.recent_s) / len(self.recent_s) / self.engine.max_num_seqs
        return max(RETRY_MIN_S, min(RETRY_MAX_S, math.ceil(wait)))

    def tokenizer_info(self) -> dict:
        """The tokenizer's facts a client needs to count tokens without downloading it (GET /tokenizer_info)."""
        tok = self.tokenizer
        name = {i: tok.id_to_token(i) for i in (tok.bos_id, tok.eos_id) if i is not None}
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": self.max_len,
            "vocab_size": tok.vocab_size,
            "bos_token": name.get(tok.bos_id),
            "eos_token": name.get(tok.eos_id),
            "bos_token_id": tok.bos_id,
            "eos_token_id": tok.eos_id,
            "pad_token": name.get(tok.eos_id),  # DeepSeek pads with EOS
            "add_bos_token": tok.bos_id is not None,
            "chat_template": None,  # the chat format is code (text/chat.py); POST /tokenize with messages renders it
            "tokenizer_source": "POST /tokenize, POST /detokenize",
        }

    def gauges(self) -> dict[str, int]:
        """What /metrics shows of the engine now; the keys are api.GAUGES."""
        spec = getattr(self.engine, "speculative_stats", dict)()  # speculative decoding's counters, when it is on
        return {"queue_depth": self.engine.queue.depth, "requests_running": self.engine.running, **spec}

    def step_histograms(self) -> dict[str, dict[int, int]]:
        """Cumulative counts by value of each of api.STEP_HISTOGRAMS."""
        return self.engine.step_histograms()

    def prefix_stats(self) -> dict[str, float]:
        """The prefix cache's counters and sizes now; the keys are api.PREFIX_METRICS."""
        cache = getattr(self.engine, "prefix", None)
        return cache.stats() if cache is not None else dict.fromkeys(PREFIX_METRICS, 0)

    # ---- prompts ------------------------------------------------------------------------------------------------
    def chat_prompt(self, req: ChatRequest) -> list[int]:
        tools = list(req.tools) if req.tools else None
        return encode_chat(
            self.tokenizer, req.messages, tools, max_prompt_tokens=self.max_len, release=self.release, options=req.chat
        )

    def text_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids; BOS first (as vLLM's DeepSeek tokenizer does) unless the text already starts with it."""
        ids = self.tokenizer.encode(text)
        bos = self.tokenizer.bos_id
        if add_special_tokens and bos is not None and not text.startswith(BOS):
            ids = [bos, *ids]
        return ids

    def detokenize(self, ids: list[int]) -> str:
        bad = [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise InvalidRequest(f"token ids must be in 0..{self.tokenizer.vocab_size - 1}; got {bad[0]}", "tokens")
        return self.tokenizer.decode(ids)

    # ---- generation ---------------------------------------------------------------------------------------------
    def open_chat(self, req: ChatRequest) -> Stream:
        t0 = self.clock()
        ids = self.chat_prompt(req)
        thinking = bool(ids) and ids[-1] == self.tokenizer.think_open_id  # the output starts inside reasoning
        tools = bool(req.tools) and req.tool_choice != "none"
        grammar = self.chat_grammar(req)
        if grammar is not None and thinking:  # the reasoning is free; the grammar holds from `</think>` on
            grammar = grammar.starting_after(self.tokenizer.think_close_id)

        def pipe():
            return _Pipeline(self.tokenizer, req.options, reasoning=thinking, tools=tools)

        return self._submit(ids, req.options, pipe, req.request_id, t0, param="messages", salt=req.cache_salt,
                            constraint=grammar)  # fmt: skip

    def chat_grammar(self, req: ChatRequest) -> Grammar | None:
        """The grammar a chat request's output must follow: a forced tool call (which wins), a JSON format, or None.
        Compiled here, on the caller's thread (a schema llguidance cannot do is the client's 400)."""
        if req.tools and req.tool_choice in ("required", "function"):
            name = req.tool_name if req.tool_choice == "function" else None
            return self.grammars.tool_call(req.tools, name, req.parallel_tool_calls, self.release)
        if req.response_format is not None:
            return self.grammars.json_schema(req.response_format.schema)
        return None

    def open_completion(self, req: CompletionRequest) -> Stream:
        t0 = self.clock()
        ids = self.text_prompt(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)

        def pipe():
            return _Pipeline(self.tokenizer, req.options, echo=req.echo)

        return self._submit(ids, req.options, pipe, req.request_id, t0, param="prompt", salt=req.cache_salt)

    def _max_tokens(self, asked: int | None, n: int) -> int:
        """What a request with an n-token prompt may generate: the server's default where it names none (never
        more than the context leaves), what it asks for within the server's limit otherwise."""
        if asked is None:
            left = self.max_len - n
            return left if self.max_tokens_default is None else min(left, self.max_tokens_default)
        if self.max_tokens_limit is not None and asked > self.max_tokens_limit:
            raise InvalidRequest(
                f"max_tokens is {asked}; this server allows at most {self.max_tokens_limit} a request",
                param="max_tokens",
            )
        return asked

    def stream(self, req: ChatRequest | CompletionRequest) -> Iterator[Delta]:
        return iter(self.open_chat(req) if isinstance(req, ChatRequest) else self.open_completion(req))

    def _submit(self, ids, opts: GenerationOptions, pipe: Callable[[], _Pipeline], request_id, t0: float, param: str,
                salt: str | None = None, constraint: Grammar | None = None) -> Stream:  # fmt: skip
        n = len(ids)
        if n >= self.max_len:
            raise ContextTooLong(f"the prompt is {n} tokens; this model's context is {self.max_len} tokens", param)
        max_tokens = self._max_tokens(opts.max_tokens, n)
        if n + max_tokens > self.max_len:
            raise ContextTooLong(
                f"this model's context is {self.max_len} tokens; the prompt has {n} and max_tokens is {max_tokens} "
                f"(at most {self.max_len - n} fit)",
                param="max_tokens",
            )
        total = max(opts.n, opts.best_of or 0)
        pipes = [pipe() for _ in range(total)]  # one text pipeline a sequence
        # the engine scores the prompt once, with the most alternatives anyone here wants
        wants = [k for k in (opts.logprobs if pipes[0].echo else None, opts.prompt_logprobs) if k is not None]
        # best_of ranks the sequences by their tokens' cumulative logprob: the sampler must report each one's
        ranked = total > opts.n
        prompt_lp = max(wants) if wants else None
        params = SamplingParams(
            temperature=opts.temperature,
            top_p=opts.top_p,
            top_k=opts.top_k,
            min_p=opts.min_p,
            seed=None if opts.seed is None else opts.seed % (1 << 63),
            max_tokens=max_tokens,
            stop_token_ids=opts.stop_token_ids,
            ignore_eos=opts.ignore_eos,
            logprobs=0 if ranked and opts.logprobs is None else opts.logprobs,
            prompt_logprobs=prompt_lp,
            min_tokens=min(opts.min_tokens, max_tokens),
            eos_ids=() if opts.ignore_eos else tuple(self.tokenizer.eos_ids),
            constraint=constraint,
        )
        request = GenerationRequest(tuple(ids), params, cache_salt=salt)
        if request_id is not None:
            request = replace(request, request_id=request_id)
        seed = params.seed
        each = [replace(params, seed=None if seed is None else (seed + i) % (1 << 63)) for i in range(total)]
        try:
            if total == 1:
                source = _Single(self.engine.submit(request))
            elif hasattr(self.engine, "submit_n"):
                source = _Forked(self.engine.submit_n(request, each))
            else:
                source = _OneAfterAnother(self.engine, [replace(request, params=p) for p in each])
        except Overloaded as e:  # the queue filled between admission and now
            raise Overloaded(str(e), retry_after=self.expected_wait()) from None
        stats = RequestStats(request.request_id, prompt_tokens=n)
        return Stream(self, source, ids, pipes, stats, t0)


class _Single:
    """A one-sequence request's events, as (choice 0, event)."""

    def __init__(self, handle: Handle):
        self.handle = handle

    @property
    def started(self) -> bool:
        return self.handle.started.is_set()

    def cancel(self, index: int | None = None) -> None:
        self.handle.cancel()

    def __iter__(self):
        return ((0, ev) for ev in self.handle)


class _Forked:
    """An n-sequence request the engine forks after one prefill (runtime/scheduler/batch.Fork)."""

    def __init__(self, fork):
        self.fork = fork
        self.handle = fork.branches[0]

    @property
    def started(self) -> bool:
        return self.fork.started.is_set()

    def cancel(self, index: int | None = None) -> None:
        if index is None:
            self.fork.cancel()
        else:
            self.fork.branches[index].cancel()

    def __iter__(self):
        return iter(self.fork)


class _OneAfterAnother:
    """An n-sequence request on an engine that cannot fork a prompt: each sequence a request, submitted when the one
    before it ended (it holds one place in the queue at a time; the prefix cache shares what it holds of the
    prompt)."""

    def __init__(self, engine: Engine, requests: list[GenerationRequest]):
        self.engine, self.requests = engine, requests
        self.handle = engine.submit(requests[0])
        self._index, self._cancelled = 0, False

    @property
    def started(self) -> bool:
        return self.handle.started.is_set()

    def cancel(self, index: int | None = None) -> None:
        if index is None:
            self._cancelled = True
            self.handle.cancel()
        elif index == self._index:
            self.handle.cancel()

    def __iter__(self):
        for i, req in enumerate(self.requests):
            if i:
                if self._cancelled:
                    return
                self.handle, self._index = self.engine.submit(req), i
            for ev in self.handle:
                yield i, ev


class Stream:
    """One submitted request: iterate for Deltas (once), cancel() from any thread. With n > 1 the choices' Deltas
    interleave, each with its index; stats add up every choice's tokens."""

    def __init__(self, gen: Generator, source, prompt: list[int], pipes: list[_Pipeline], stats, t0: float):
        self.gen, self.source, self.prompt, self.stats, self.t0 = gen, source, prompt, stats, t0
        self.choices = [_Choice(i, p) for i, p in enumerate(pipes)]
        self._t_first: float | None = None
        self._prefill_s = 0.0

    @property
    def handle(self) -> Handle:
        """The engine's handle of the (first) sequence."""
        return self.source.handle

    @property
    def pipe(self) -> _Pipeline:
        return self.choices[0].pipe

    @property
    def request_id(self) -> str:
        return self.stats.request_id

    @property
    def started(self) -> bool:
        """The engine has taken it (it no longer waits in the queue)."""
        return self.source.started

    def cancel(self) -> None:
        self.source.cancel()

    def __iter__(self) -> Iterator[Delta]:
        tok, left = self.gen.tokenizer, len(self.choices)
        try:
            for i, ev in self.source:
                c = self.choices[i]
                if c.finish is not None:  # ended by a stop string: the engine's "cancelled" that followed
                    continue
                for d in self._on_event(c, ev, tok):
                    yield replace(d, index=i) if i else d
                if c.finish is not None:
                    left -= 1
                    if not left:
                        break
        finally:
            if self.stats.finish_reason is None:  # the consumer went away or an error ended the stream
                self.source.cancel()

    def _on_event(self, c: _Choice, ev: TokenEvent, tok: Tokenizer) -> Iterator[Delta]:
        now, pipe = self.gen.clock(), c.pipe
        if not c.prompt_sent:  # the first event carries the prompt's logprobs when they were asked for
            c.prompt_sent = True
            yield Delta("prompt", prompt_logprobs=pipe.prompt_logprobs(self.prompt, ev.prompt_logprobs))
        if pipe.echo and not pipe.echoed:
            yield from pipe.echo_prompt(self.prompt, ev.prompt_logprobs)
        if ev.stats is not None and ev.stats.ttft_s is not None:
            self._prefill_s = ev.stats.ttft_s
        self._read_counters(ev.stats)
        if ev.token is not None:
            if self._t_first is None:
                self._t_first, self.stats.ttft_s = now, now - self.t0
            if not c.started:
                c.started = True
                yield Delta("start")
            self.stats.decode_s = now - self._t_first
            self.stats.completion_tokens += 1
            c.tokens += 1
            if ev.logprob is not None:
                c.logprob += ev.logprob
            if pipe.in_reasoning:
                self.stats.reasoning_tokens += 1
                c.reasoning += 1
            if not ev.stop_token:
                yield from pipe.feed_token(ev.token, ev.logprob, ev.top)
        if pipe.stops.stopped:
            self.source.cancel(c.index)  # the engine learns only "cancelled"; the client sees a normal stop
            yield from self._finish(c, "stop")
        elif ev.finish_reason is not None:
            yield from self._finish(c, ev.finish_reason)

    def _finish(self, c: _Choice, reason: str) -> Iterator[Delta]:
        pipe = c.pipe
        yield from pipe.finish()
        if reason == "stop" and pipe.tool_calls:
            reason = "tool_calls"
        c.finish = reason
        st = self.stats
        if all(x.finish is not None for x in self.choices):
            # the request's outcome: cancelled when any sequence was (the client did not get all it asked for)
            reasons = [x.finish for x in self.choices]
            st.finish_reason = "cancelled" if "cancelled" in reasons else reasons[0]
            if st.finish_reason != "cancelled":
                self.gen.recent_s.append(self._prefill_s + st.decode_s)
        usage = Usage(st.prompt_tokens, c.tokens, c.reasoning, st.cached_tokens)
        yield Delta("content", logprobs=pipe.take_logprobs(), finish_reason=reason, usage=usage,
                    cumulative_logprob=c.logprob)  # fmt: skip

    def _read_counters(self, stats: StepStats | None) -> None:
        if stats is not None:
            self.stats.experts = stats.experts - stats.experts_start
            if stats.ttft_s is not None:  # the first event's: how much of the prompt a snapshot held
                self.stats.cached_tokens = stats.cached_tokens


class _Choice:
    """Where one sequence of a request stands: its text pipeline, tokens and cumulative logprob."""

    def __init__(self, index: int, pipe: _Pipeline):
        self.index, self.pipe = index, pipe
        self.prompt_sent = pipe.opts.prompt_logprobs is None
        self.started = False
        self.finish: str | None = None
        self.tokens = self.reasoning = 0
        self.logprob = 0.0


class _Pipeline:
    """Per-request text state: ids -> text -> reasoning / content / tool calls, stop strings, logprob entries."""

    def __init__(self, tok: Tokenizer, opts: GenerationOptions, reasoning=False, tools=False, echo=False):
        self.tok, self.opts, self.echo = tok, opts, echo
        self.detok = Detokenizer(tok, skip_special_tokens=opts.skip_special_tokens)
        self.reasoning = ReasoningParser(thinking=True) if reasoning else None
        self.tools = ToolCallParser() if tools else None
        self.stops = StopMatcher(opts.stop, opts.include_stop_str_in_output)
        self.tool_calls: list[ToolCall] = []
        self.echoed = False
        self._offset0 = 0  # length of the echoed prompt text: completion offsets count from there
        self._pending: list[TokenLogprob] = []

    @property
    def in_reasoning(self) -> bool:
        return self.reasoning is not None and self.reasoning.in_reasoning

    def echo_prompt(self, prompt: list[int], prompt_lp: list | None) -> Iterator[Delta]:
        if not self.echo or self.echoed:
            return
        self.echoed = True
        detok = Detokenizer(self.tok, skip_special_tokens=self.opts.skip_special_tokens)
        pieces = detok.feed_many(prompt)
        text = "".join(p.text for p in pieces) + detok.finish()
        self._offset0 = len(text)
        entries = ()
        k = self.opts.logprobs
        if prompt_lp is not None and k is not None:
            entries = tuple(
                self._entry(p.token_id, None if lp is None else lp[1], None if lp is None else lp[2][:k], p.offset)
                for p, lp in zip(pieces, prompt_lp)
            )
        yield Delta("prompt", text, logprobs=entries)

    def prompt_logprobs(self, prompt: list[int], scored: list | None) -> tuple:
        """The engine's (token, logprob, top) per prompt position -> vLLM's entries: the prompt's token, then the top
        k alternatives (the prompt's token appears once)."""
        k = self.opts.prompt_logprobs or 0
        out: list = [None]
        for lp in (scored or [None])[1:]:
            token, logprob, top = lp
            top = top[:k]
            ranks = {t: i + 1 for i, (t, _) in enumerate(top)}
            first = PromptLogprob(token, token_text(self.tok, token), logprob, ranks.get(token))
            alts = [PromptLogprob(t, token_text(self.tok, t), v, i + 1) for i, (t, v) in enumerate(top) if t != token]
            out.append((first, *alts))
        return tuple(out[: len(prompt)])

    def feed_token(self, token: int, logprob: float | None, top) -> Iterator[Delta]:
        piece = self.detok.feed(token)
        if self.opts.logprobs is not None:
            self._pending.append(self._entry(token, logprob, top, self._offset0 + piece.offset))
        yield from self._text(piece.text)

    def finish(self) -> Iterator[Delta]:
        if self.stops.stopped:
            return
        yield from self._text(self.detok.finish())
        segments = self.reasoning.finish() if self.reasoning is not None else []
        for seg in segments:
            yield from self._segment(seg.kind, seg.text)
        if self.tools is not None:
            yield from self._content(self.tools.finish())
        tail = self.stops.finish()
        if tail:
            yield self._attach(Delta("content", tail))

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        out, self._pending = tuple(self._pending), []
        return out

    # ---- internals ----------------------------------------------------------------------------------------------
    def _text(self, text: str) -> Iterator[Delta]:
        if not text or self.stops.stopped:
            return
        if self.reasoning is None:
            yield from self._segment("content", text)
            return
        for seg in self.reasoning.feed(text):
            yield from self._segment(seg.kind, seg.text)

    def _segment(self, kind: str, text: str) -> Iterator[Delta]:
        if self.stops.stopped:
            return
        if kind == REASONING:
            yield self._attach(Delta("reasoning", text))
        elif self.tools is not None:
            yield from self._content(self.tools.feed(text))
        else:
            yield from self._content([text])

    def _content(self, items: list) -> Iterator[Delta]:
        for item in items:
            if self.stops.stopped:
                return
            if isinstance(item, ToolCall):
                self.tool_calls.append(item)
                yield self._attach(Delta("tool_call", tool_call=item))
                continue
            text = self.stops.feed(item)
            if text:
                yield self._attach(Delta("content", text))

    def _attach(self, delta: Delta) -> Delta:
        return replace(delta, logprobs=self.take_logprobs()) if self._pending else delta

    def _entry(self, token: int, logprob: float | None, top, offset: int) -> TokenLogprob:
        alts = None
        if top is not None:
            alts = tuple(TopLogprob(token_text(self.tok, t), lp, tuple(self.tok.token_bytes(t))) for t, lp in top)
        return TokenLogprob(token_text(self.tok, token), logprob, tuple(self.tok.token_bytes(token)), alts, offset)
