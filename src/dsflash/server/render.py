"""Deltas -> OpenAI objects: one Iterator[Delta], two renderings (SSE chunks, or one folded response).

The role-only first chunk, the finish chunk, usage and both logprob shapes are each built by one function.
With n > 1 the Deltas of the choices interleave (Delta.index): each chunk carries its choice's index, usage counts
the prompt once and the completions summed (as vLLM), and with best_of the n choices of highest cumulative logprob
are returned.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from dsflash.service.api import Delta, PromptLogprob, TokenLogprob, Usage

LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for "very unlikely"; JSON has no -Infinity


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _lp(value: float | None) -> float | None:
    if value is None:
        return None
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN to the floor


def total_usage(usages: list[Usage]) -> Usage | None:
    """The choices' usages as the request's: the prompt once, the completions summed."""
    if not usages:
        return None
    u = usages[0]
    return Usage(u.prompt_tokens, sum(x.completion_tokens for x in usages),
                 sum(x.reasoning_tokens for x in usages), u.cached_tokens)  # fmt: skip


def usage_json(u: Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    }


def chat_logprobs(entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict:
    """Chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": null}."""
    content = [
        {
            "token": e.token,
            "logprob": _lp(e.logprob),
            "bytes": list(e.bytes),
            "top_logprobs": [
                {"token": t.token, "logprob": _lp(t.logprob), "bytes": list(t.bytes)} for t in e.top or ()
            ],
        }
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(entries) -> dict:
    """Completions shape: parallel lists; the sampled token is always among its position's top entries."""
    tops = []
    for e in entries:
        if e.top is None and e.logprob is None:
            tops.append(None)  # the first echoed prompt token has nothing before it
            continue
        top = {t.token: _lp(t.logprob) for t in e.top or ()}
        top.setdefault(e.token, _lp(e.logprob))
        tops.append(top)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [_lp(e.logprob) for e in entries],
        "top_logprobs": tops,
        "text_offset": [e.offset for e in entries],
    }


def prompt_logprobs_json(positions) -> list:
    """vLLM's shape: per prompt position None (the first) or {token id: {logprob, rank, decoded_token}}."""
    return [None if p is None else {str(e.token_id): _prompt_entry(e) for e in p} for p in positions]


def _prompt_entry(e: PromptLogprob) -> dict:
    return {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": e.token}


@dataclass
class Meta:
    """The fields every object of one response shares."""

    model: str
    kind: str  # chat | completion
    logprobs: bool = False
    include_usage: bool = False
    prompt_logprobs: bool = False
    n: int = 1  # choices returned (best_of generates more)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = self.id or new_id("chatcmpl" if self.kind == "chat" else "cmpl")

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}


# ---- streaming --------------------------------------------------------------------------------------------------
def stream_chat(deltas: Iterator[Delta], meta: Meta) -> Iterator[dict]:
    """chat.completion.chunk objects: role chunk at each choice's first token, deltas, its finish chunk, then the
    optional usage chunk."""
    started, prompt_lp, usages = set(), None, []
    for d in deltas:
        i = d.index
        if d.prompt_logprobs is not None:  # vLLM sends them at the top of the first chunk
            if not started:
                prompt_lp = prompt_logprobs_json(d.prompt_logprobs)
            continue
        if i not in started:
            first = _chat_chunk(meta, {"role": "assistant", "content": ""}, index=i)
            if prompt_lp is not None and not started:
                first["prompt_logprobs"] = prompt_lp
            started.add(i)
            yield first
            if d.kind == "start":
                continue
        if d.finish_reason is not None:
            yield _chat_chunk(meta, {}, d.finish_reason, d.logprobs, i)
            if d.usage is not None:
                usages.append(d.usage)
            continue
        if d.kind == "reasoning":
            yield _chat_chunk(meta, {"reasoning_content": d.text}, None, d.logprobs, i)
        elif d.kind == "content":
            yield _chat_chunk(meta, {"content": d.text}, None, d.logprobs, i)
        elif d.kind == "tool_call":
            yield _chat_chunk(meta, {"tool_calls": [d.tool_call.to_delta()]}, None, d.logprobs, i)
    if meta.include_usage and usages:
        yield {**meta.head("chat.completion.chunk"), "choices": [], "usage": usage_json(total_usage(usages))}


def _chat_chunk(meta: Meta, delta: dict, finish: str | None = None, logprobs=(), index: int = 0) -> dict:
    lp = chat_logprobs(logprobs) if meta.logprobs and logprobs else None
    out = {
        **meta.head("chat.completion.chunk"),
        "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}],
    }
    if meta.include_usage:
        out["usage"] = None
    return out


def stream_completion(deltas: Iterator[Delta], meta: Meta) -> Iterator[dict]:
    """text_completion chunks: the echoed prompt, one per text delta, each choice's finish chunk, then the optional
    usage chunk."""
    prompt_lp, usages = {}, []
    for d in deltas:
        if d.prompt_logprobs is not None:  # on the choice of its first chunk, as vLLM
            prompt_lp[d.index] = prompt_logprobs_json(d.prompt_logprobs)
            continue
        if d.kind == "start":
            continue
        if d.finish_reason is None and not d.text and not d.logprobs:
            continue
        chunk = _completion_chunk(meta, d.text, d.finish_reason, d.logprobs, d.index)
        if d.index in prompt_lp:
            chunk["choices"][0]["prompt_logprobs"] = prompt_lp.pop(d.index)
        yield chunk
        if d.finish_reason is not None and d.usage is not None:
            usages.append(d.usage)
    if meta.include_usage and usages:
        yield {**meta.head("text_completion"), "choices": [], "usage": usage_json(total_usage(usages))}


def _completion_chunk(meta: Meta, text: str, finish: str | None, logprobs, index: int = 0) -> dict:
    lp = completion_logprobs(logprobs) if meta.logprobs else None
    out = {
        **meta.head("text_completion"),
        "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish}],
    }
    if meta.include_usage:
        out["usage"] = None
    return out


# ---- one response -----------------------------------------------------------------------------------------------
def _by_choice(deltas: Iterator[Delta]) -> list[list[Delta]]:
    """The Deltas of each choice, in index order."""
    out: dict[int, list[Delta]] = {}
    for d in deltas:
        out.setdefault(d.index, []).append(d)
    return [out[i] for i in sorted(out)] or [[]]


def _best(choices: list[list[Delta]], n: int) -> list[list[Delta]]:
    """best_of: the n choices whose sampled tokens have the highest cumulative logprob, best first (as vLLM)."""
    if len(choices) <= n:
        return choices

    def score(ds: list[Delta]) -> float:
        last = next((d.cumulative_logprob for d in reversed(ds) if d.finish_reason is not None), None)
        return last if last is not None else float("-inf")

    return sorted(choices, key=score, reverse=True)[:n]


def full_chat(deltas: Iterator[Delta], meta: Meta) -> dict:
    """The same deltas folded into one chat.completion."""
    choices, usages, prompt_lp = [], [], None
    for i, ds in enumerate(_by_choice(deltas)):
        choice, usage, lp = _chat_choice(ds, meta, i)
        choices.append(choice)
        usages += [usage] if usage is not None else []
        prompt_lp = prompt_lp if prompt_lp is not None else lp
    usage = total_usage(usages)
    out = {**meta.head("chat.completion"), "choices": choices, "usage": usage_json(usage) if usage else None}
    if prompt_lp is not None:
        out["prompt_logprobs"] = prompt_lp
    return out


def _chat_choice(deltas: list[Delta], meta: Meta, index: int) -> tuple[dict, Usage | None, list | None]:
    reasoning, content, calls, entries = [], [], [], []
    finish, usage, prompt_lp = None, None, None
    saw_reasoning = False
    for d in deltas:
        entries.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            prompt_lp = prompt_logprobs_json(d.prompt_logprobs)
        if d.kind == "reasoning":
            saw_reasoning = True
            reasoning.append(d.text)
        elif d.kind == "content":
            content.append(d.text)
        elif d.kind == "tool_call":
            calls.append(d.tool_call.to_message())
        if d.finish_reason is not None:
            finish, usage = d.finish_reason, d.usage
    text = "".join(content)
    message = {
        "role": "assistant",
        "content": text if text or not calls else None,
        "reasoning_content": "".join(reasoning) if saw_reasoning else None,
    }
    if calls:
        message["tool_calls"] = calls
    choice = {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(entries) if meta.logprobs else None,
        "finish_reason": finish,
    }
    return choice, usage, prompt_lp


def full_completion(deltas: Iterator[Delta], meta: Meta) -> dict:
    """The same deltas folded into one text_completion (echoed prompt first); of best_of sequences the n best."""
    choices, usages = [], []
    for i, ds in enumerate(_best(_by_choice(deltas), meta.n)):
        choice, usage = _completion_choice(ds, meta, i)
        choices.append(choice)
        usages += [usage] if usage is not None else []
    usage = total_usage(usages)
    return {**meta.head("text_completion"), "choices": choices, "usage": usage_json(usage) if usage else None}


def _completion_choice(deltas: list[Delta], meta: Meta, index: int) -> tuple[dict, Usage | None]:
    text, entries = [], []
    finish, usage, prompt_lp = None, None, None
    for d in deltas:
        entries.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            prompt_lp = prompt_logprobs_json(d.prompt_logprobs)
        if d.kind in ("prompt", "content"):
            text.append(d.text)
        if d.finish_reason is not None:
            finish, usage = d.finish_reason, d.usage
    lp = completion_logprobs(entries) if meta.logprobs else None
    choice = {"index": index, "text": "".join(text), "logprobs": lp, "finish_reason": finish}
    if prompt_lp is not None:
        choice["prompt_logprobs"] = prompt_lp
    return choice, usage
