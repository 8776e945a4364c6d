"""Types of the in-process API: typed requests in, Deltas out (the server and the CLI both speak these)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from dsflash.counters import ExpertCounters
from dsflash.text.chat import ChatOptions
from dsflash.text.tools import ToolCall

MAX_LOGPROBS = 20
# choices one request may ask for (n, best_of): each holds a sequence slot, or the queue's place, while it runs
MAX_CHOICES = 16
# new tokens a request that names no max_tokens may generate (the rest of the context where less is left): one
# request without a limit must not hold a one-sequence server for minutes (a chat at the full context ran 3.5 min)
MAX_TOKENS_DEFAULT = 2048
GAUGES = ("queue_depth", "requests_running")  # what Generator.gauges() reports (zero while nothing is attached)
# what Generator.step_histograms() reports: name -> help; the server exposes each as the histogram dsflash:<name>
STEP_HISTOGRAMS = {
    "batch_size": "Sequences each decode step advanced (continuous batching, --max-num-seqs).",
    "step_tokens": "Tokens each engine step computed (decode tokens plus the prefill joining them).",
}
# what Generator.prefix_stats() reports (zero while nothing is attached or reuse is off): name -> (kind, help);
# the server exposes each as dsflash:<name>
PREFIX_METRICS = {
    "prefix_cache_lookups_total": ("counter", "Prompts looked up in the prefix cache."),
    "prefix_cache_hit_tokens_total": ("counter", "Prompt tokens restored from a snapshot instead of prefilled."),
    "prefix_cache_evictions_total": ("counter", "Snapshots evicted from host memory or disk."),
    "prefix_cache_memory_bytes": ("gauge", "Bytes of sequence snapshots held in host memory."),
    "prefix_cache_disk_bytes": ("gauge", "Bytes of sequence snapshots on disk (--prefix-cache-dir)."),
}


@dataclass(frozen=True)
class GenerationOptions:
    """Sampling and stopping; validated by the caller (server/protocol.py), trusted here."""

    max_tokens: int | None = None  # None: the rest of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: off; k: the sampled token's logprob plus the top k alternatives
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens (vLLM's)
    prompt_logprobs: int | None = None  # None: off; k: each prompt token's logprob plus the top k alternatives
    n: int = 1  # choices returned
    best_of: int | None = None  # sequences generated, of which the n with the highest cumulative logprob return


@dataclass(frozen=True)
class JsonFormat:
    """Structured output: the content is JSON valid against `schema` (None: any JSON object)."""

    schema: Mapping | None = None


@dataclass(frozen=True)
class ChatRequest:
    messages: Sequence[Mapping]  # OpenAI messages; text/chat.py validates them while encoding
    options: GenerationOptions = GenerationOptions()
    chat: ChatOptions = ChatOptions()
    tools: Sequence[Mapping] | None = None
    # required: some call of `tools` is forced; function: a call of tool_name is forced
    tool_choice: Literal["auto", "none", "required", "function"] = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True  # a forced block may hold several calls
    response_format: JsonFormat | None = None
    request_id: str | None = None
    cache_salt: str | None = None  # prefixes match only requests with the same salt (vLLM's field)


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | tuple[int, ...]  # text (BOS is prepended) or token ids (used as they are)
    options: GenerationOptions = GenerationOptions()
    echo: bool = False
    request_id: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: tuple[int, ...]


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the chosen token and the best alternatives. logprob is None for the first echoed prompt token."""

    token: str
    logprob: float | None
    bytes: tuple[int, ...]
    top: tuple[TopLogprob, ...] | None
    offset: int  # character offset of this token's text in the completion text (echoed prompt included)


@dataclass(frozen=True)
class PromptLogprob:
    """One candidate at a prompt position (vLLM's prompt_logprobs): rank is 1 for the most likely token; None where
    the prompt's own token is not among the top k reported (its rank is not computed)."""

    token_id: int
    token: str
    logprob: float
    rank: int | None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache (usage.prompt_tokens_details)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class RequestStats:
    """What one request cost; the per-request log line and /metrics are made from it."""

    request_id: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None  # receipt -> first token (queue wait + prefill)
    decode_s: float = 0.0  # first token -> last token
    experts: ExpertCounters | None = None  # this request's share of the runner's expert counters
    finish_reason: str | None = None

    @property
    def tokens_per_s(self) -> float | None:
        n = self.completion_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else None

    @property
    def hit_rate(self) -> float | None:
        if self.experts is None or not self.experts.lookups:
            return None
        return self.experts.hit_rate


Kind = Literal["start", "prompt", "reasoning", "content", "tool_call"]


@dataclass(frozen=True)
class Delta:
    """A piece of the answer. `start` marks the first sampled token (it carries no text); `prompt` is the echoed
    prompt; the last Delta carries finish_reason (stop | length | tool_calls | cancelled) and usage."""

    kind: Kind
    text: str = ""
    tool_call: ToolCall | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    # on the first Delta when prompt_logprobs was asked: per prompt position (None for the first), the prompt's
    # token first, then the top k alternatives
    prompt_logprobs: tuple[tuple[PromptLogprob, ...] | None, ...] | None = None
    index: int = 0  # the choice it belongs to (n > 1)
    cumulative_logprob: float | None = None  # on the last Delta: the sum of the sampled tokens' logprobs
