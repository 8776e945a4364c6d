"""Request bodies -> frozen, validated requests (the only place that reads raw dicts and applies defaults).

Policy: wrong types and out-of-range values are a 400 naming the parameter (prompt + max_tokens against the context
is the service's check, after templating); parameters we know but cannot honour
(n > 1, penalties, logit_bias, structured output, forced tool choice) are a 400 rather than silently ignored;
fields we do not know are ignored and reported back to the caller for the request log line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from dsflash.errors import InvalidRequest, ModelSourceError
from dsflash.service.api import MAX_LOGPROBS, ChatRequest, CompletionRequest, GenerationOptions
from dsflash.text.chat import ChatOptions, chat_options

INT64 = 1 << 63
MAX_STOPS = 64

_COMMON = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "n",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "user",
    "logprobs",
}
CHAT_FIELDS = _COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "chat_template_kwargs",
    "reasoning_effort",
    "thinking",
    "functions",
    "function_call",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the served id, its aliases, the context, the vocabulary."""

    model_id: str
    aliases: tuple[str, ...]
    max_len: int
    vocab_size: int
    chat_defaults: ChatOptions = ChatOptions()

    def check(self, body: Mapping) -> None:
        name = body.get("model")
        if name is None:
            return
        if not isinstance(name, str):
            raise InvalidRequest("model must be a string", param="model")
        if name != self.model_id and name not in self.aliases:
            raise ModelSourceError(f"the model {name!r} does not exist; this server serves {self.model_id!r}")


@dataclass(frozen=True)
class Stream:
    """How to answer: SSE or one JSON object, and whether a usage chunk ends the stream."""

    stream: bool = False
    include_usage: bool = False


def unknown_fields(body: Mapping, known: set[str]) -> list[str]:
    return sorted(k for k in body if k not in known)


# ---- value readers ----------------------------------------------------------------------------------------------
def _get(body: Mapping, key: str, default=None):
    value = body.get(key, default)
    return default if value is None else value


def _bool(body: Mapping, key: str, default: bool = False) -> bool:
    value = _get(body, key, default)
    if not isinstance(value, bool):
        raise InvalidRequest(f"{key} must be true or false", param=key)
    return value


def _is_int(value) -> bool:
    """An integer as JSON Schema counts them: 3 and 3.0 (not true, not 3.5)."""
    return type(value) is int or (type(value) is float and value.is_integer())


def _int(body: Mapping, key: str, lo: int, hi: int, default: int | None = None) -> int | None:
    value = _get(body, key, default)
    if value is None:
        return None
    if not _is_int(value):
        raise InvalidRequest(f"{key} must be an integer", param=key)
    value = int(value)
    if not lo <= value <= hi:
        raise InvalidRequest(f"{key} must be in {lo}..{hi}; got {value}", param=key)
    return value


def _num(body: Mapping, key: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    value = _get(body, key, default)
    if type(value) not in (int, float) or not math.isfinite(value):
        raise InvalidRequest(f"{key} must be a number", param=key)
    if not (lo < value if lo_open else lo <= value) or value > hi:
        raise InvalidRequest(f"{key} must be in {'(' if lo_open else '['}{lo}, {hi}]; got {value}", param=key)
    return float(value)


def _no_logit_bias(body: Mapping) -> None:
    value = body.get("logit_bias")
    if value is not None and not isinstance(value, Mapping):
        raise InvalidRequest("logit_bias must be an object", param="logit_bias")
    if value:
        raise InvalidRequest("logit_bias is not supported by this server", param="logit_bias")


def _unsupported_unless(body: Mapping, key: str, neutral, what: str) -> None:
    value = body.get(key)
    if value is None:
        return
    if type(value) not in (int, float) or not math.isfinite(value):
        raise InvalidRequest(f"{key} must be a number", param=key)
    if value != neutral:
        raise InvalidRequest(f"{key} is not supported by this server ({what}; send {neutral} or leave it out)", key)


def _stops(body: Mapping) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidRequest("stop must be a string or an array of strings", param="stop")
    if len(value) > MAX_STOPS:
        raise InvalidRequest(f"stop takes at most {MAX_STOPS} strings", param="stop")
    return tuple(s for s in value if s)


def _token_ids(value, key: str, vocab: int, allow_empty: bool = True) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise InvalidRequest(f"{key} must be an array of integers", param=key)
    if not value and not allow_empty:
        raise InvalidRequest(f"{key} must not be empty", param=key)
    bad = next((t for t in value if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"{key}: token ids must be in 0..{vocab - 1}; got {bad}", param=key)
    return tuple(int(t) for t in value)


def _stream(body: Mapping) -> Stream:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return Stream(stream)
    if not isinstance(opts, Mapping):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    if not stream:
        raise InvalidRequest("stream_options is only allowed with stream: true", param="stream_options")
    return Stream(stream, _bool(opts, "include_usage"))


def _options(body: Mapping, served: ServedModel, max_tokens: int | None, logprobs: int | None) -> GenerationOptions:
    n = _int(body, "n", 1, 1 << 31, 1)
    if n != 1:
        raise InvalidRequest("n > 1 is not supported: this server runs one sequence at a time", param="n")
    _unsupported_unless(body, "presence_penalty", 0, "no repetition penalties")
    _unsupported_unless(body, "frequency_penalty", 0, "no repetition penalties")
    _unsupported_unless(body, "repetition_penalty", 1, "no repetition penalties")
    _no_logit_bias(body)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise InvalidRequest("user must be a string", param="user")
    top_k = _int(body, "top_k", -1, 1 << 31, 0)
    stop_ids = body.get("stop_token_ids")
    return GenerationOptions(
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_num(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
        top_k=max(top_k, 0),  # -1 and 0 both mean off (vLLM spells it -1)
        min_p=_num(body, "min_p", 0.0, 1.0, 0.0),
        seed=_int(body, "seed", -INT64, INT64 - 1),
        stop=_stops(body),
        stop_token_ids=() if stop_ids is None else _token_ids(stop_ids, "stop_token_ids", served.vocab_size),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
        ignore_eos=_bool(body, "ignore_eos"),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        logprobs=logprobs,
    )


def _require_object(body) -> Mapping:
    if not isinstance(body, Mapping):
        raise InvalidRequest("the request body must be a JSON object")
    return body


# ---- endpoints ----------------------------------------------------------------------------------------------------
def _check_messages(messages) -> None:
    """The message fields text/chat.py passes through without reading their type."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty array", param="messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
        for key in ("tool_call_id", "name", "reasoning_content", "reasoning"):
            if msg.get(key) is not None and not isinstance(msg[key], str):
                raise InvalidRequest(f"messages[{i}].{key} must be a string", param=f"messages[{i}].{key}")
        calls = msg.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, Mapping) for c in calls)):
            raise InvalidRequest(f"messages[{i}].tool_calls must be an array of objects", f"messages[{i}].tool_calls")


def parse_chat(body, served: ServedModel) -> tuple[ChatRequest, Stream]:
    """POST /v1/chat/completions body -> (ChatRequest, how to answer)."""
    body = _require_object(body)
    served.check(body)
    if "messages" not in body:
        raise InvalidRequest("messages is required", param="messages")
    _check_messages(body["messages"])
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise InvalidRequest(f"{key} is deprecated and not supported; use tools", param=key)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, Mapping) or fmt.get("type") != "text"):
        raise InvalidRequest(
            "response_format: only {'type': 'text'} is supported (no structured output)", "response_format"
        )
    max_tokens = _int(body, "max_completion_tokens", 1, 1 << 62)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, 1 << 62)
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top and not want:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    options = _options(body, served, max_tokens, (top or 0) if want else None)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("tools must be an array", param="tools")
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        raise InvalidRequest("tool_choice: only 'auto' and 'none' are supported", param="tool_choice")
    if body.get("parallel_tool_calls") is not None:
        _bool(body, "parallel_tool_calls")
    effort = body.get("reasoning_effort")
    if effort is not None and (type(effort) not in (str, int)):
        raise InvalidRequest("reasoning_effort must be a string or an integer", param="reasoning_effort")
    chat = chat_options(
        body.get("chat_template_kwargs"),
        reasoning_effort=effort,
        thinking=body.get("thinking"),
        defaults=served.chat_defaults,
    )
    req = ChatRequest(
        messages=body["messages"],
        options=options,
        chat=chat,
        tools=tools or None,
        tool_choice=choice or "auto",
    )
    return req, _stream(body)


def parse_completion(body, served: ServedModel) -> tuple[CompletionRequest, Stream]:
    """POST /v1/completions body -> (CompletionRequest, how to answer)."""
    body = _require_object(body)
    served.check(body)
    if "prompt" not in body:
        raise InvalidRequest("prompt is required", param="prompt")
    prompt = _prompt(body["prompt"], served.vocab_size)
    suffix = body.get("suffix")
    if suffix is not None and (not isinstance(suffix, str) or suffix):
        raise InvalidRequest("suffix is not supported by this server", param="suffix")
    if _int(body, "best_of", 1, 1 << 31, 1) != 1:
        raise InvalidRequest("best_of > 1 is not supported", param="best_of")
    max_tokens = _int(body, "max_tokens", 0, 1 << 62, 16)
    logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    options = _options(body, served, max_tokens, logprobs)
    return CompletionRequest(prompt, options, echo=_bool(body, "echo")), _stream(body)


def _prompt(value, vocab: int, nested: bool = False) -> str | tuple[int, ...]:
    """str | [str] | [int] | [[int]] with one prompt; a batch of several is a 400 (one sequence at a time)."""
    if isinstance(value, str) and not nested:
        return value
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        return _token_ids(value, "prompt", vocab)
    if nested:
        raise InvalidRequest("prompt: [[...]] must hold token ids", "prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    if isinstance(value, list) and len(value) == 1:
        return _prompt(value[0], vocab, nested=True)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        raise InvalidRequest("batched prompts are not supported: send one prompt per request", param="prompt")
    raise InvalidRequest("prompt must be a string, an array of token ids, or an array with one of those", "prompt")


@dataclass(frozen=True)
class TokenizeRequest:
    prompt: str | None = None
    messages: list | None = None
    tools: list | None = None
    chat: ChatOptions = ChatOptions()
    add_special_tokens: bool = True
    return_token_strs: bool = False


def parse_tokenize(body, served: ServedModel) -> TokenizeRequest:
    """POST /tokenize: {"prompt": str} or {"messages": [...]} (rendered with the chat template)."""
    body = _require_object(body)
    served.check(body)
    strs = _bool(body, "return_token_strs")
    add = _bool(body, "add_special_tokens", True)
    if body.get("prompt") is not None and not isinstance(body["prompt"], str):
        raise InvalidRequest("prompt must be a string", param="prompt")
    if "messages" in body and body["messages"] is not None:
        _check_messages(body["messages"])
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise InvalidRequest("tools must be an array", param="tools")
        chat = chat_options(body.get("chat_template_kwargs"), defaults=served.chat_defaults)
        return TokenizeRequest(messages=body["messages"], tools=tools, chat=chat, return_token_strs=strs)
    if not isinstance(body.get("prompt"), str):
        raise InvalidRequest("prompt must be a string (or send messages)", param="prompt")
    return TokenizeRequest(prompt=body["prompt"], add_special_tokens=add, return_token_strs=strs)


def parse_detokenize(body, served: ServedModel) -> tuple[int, ...]:
    """POST /detokenize: {"tokens": [int]}."""
    body = _require_object(body)
    served.check(body)
    if "tokens" not in body:
        raise InvalidRequest("tokens is required", param="tokens")
    return _token_ids(body["tokens"], "tokens", served.vocab_size)
