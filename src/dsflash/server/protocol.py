"""Request bodies as pydantic models (the OpenAPI document is generated from them), and their conversion to the
service's frozen requests: the only place that reads request fields and applies defaults.

Policy: wrong types and out-of-range values are a 400 naming the parameter (prompt + max_tokens against the context
is the service's check, after templating); parameters we know but cannot honour (penalties, logit_bias,
deprecated functions) are a 400 rather than silently ignored; fields we do not know are accepted
and reported back for the request log line (`extra="allow"`: they land in `model_extra`).

The models are strict (no "1" -> 1, no true -> 1) because OpenAI's API is typed JSON and a coerced value hides a
client bug; an integral float (3.0) still counts as an integer, as JSON Schema counts it. Structured output
(response_format json_object / json_schema) and forced tool choice ("required" or a named function) become the
service's JsonFormat / tool_choice here; the service compiles them (a schema the grammar engine cannot do is a 400).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from dsflash.errors import InvalidRequest, ModelSourceError
from dsflash.service.api import MAX_CHOICES, MAX_LOGPROBS, ChatRequest, CompletionRequest, GenerationOptions, JsonFormat
from dsflash.text.chat import ChatOptions, chat_options

INT64 = 1 << 63
MAX_STOPS = 64
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _integral(value):
    return int(value) if type(value) is float and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]
TokenId = Annotated[Int, Field(ge=0)]
Logprobs = Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)]


def _num(**bounds):
    return Annotated[float, Field(allow_inf_nan=False, **bounds)]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _Closed(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


# ---- pieces -------------------------------------------------------------------------------------------------------
class StreamOptions(_Model):
    include_usage: bool | None = None


class ContentPart(_Model):
    """A message content part; text/chat.py decides which types the model takes (text; images on vision models)."""

    type: str


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for reasoning_content, accepted inbound
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDef(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Model):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatTemplateKwargs(_Closed):
    thinking: bool | None = None
    enable_thinking: bool | None = None
    reasoning_effort: str | Int | None = None
    drop_thinking: bool | None = None


class Thinking(_Model):
    """DeepSeek's switch; other keys (Anthropic's budget_tokens) are accepted and not used, as before."""

    type: Literal["enabled", "disabled"]


# ---- bodies -------------------------------------------------------------------------------------------------------
class _Sampling(_Model):
    """What chat and completions share: sampling, stopping, streaming, vLLM's extras."""

    model: str | None = Field(None, description="the served model id or one of its aliases")
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    temperature: _num(ge=0, le=2) | None = 1.0
    top_p: _num(gt=0, le=1) | None = 1.0
    top_k: Annotated[Int, Field(ge=-1, description="-1 or 0: off")] | None = None
    min_p: _num(ge=0, le=1) | None = 0.0
    seed: Annotated[Int, Field(ge=-INT64, le=INT64 - 1)] | None = None
    n: Annotated[Int, Field(ge=1, description=f"choices, one prefill; at most {MAX_CHOICES}")] | None = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: list[TokenId] | None = None
    min_tokens: Annotated[Int, Field(ge=0, description="EOS and stop_token_ids cannot end it sooner")] | None = None
    ignore_eos: bool | None = False
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    prompt_logprobs: Logprobs | None = Field(None, description="logprobs of each prompt token, top k alternatives")
    presence_penalty: _num(ge=-2, le=2) | None = Field(None, description="only 0 (no repetition penalties)")
    frequency_penalty: _num(ge=-2, le=2) | None = Field(None, description="only 0 (no repetition penalties)")
    repetition_penalty: _num(gt=0) | None = Field(None, description="only 1 (no repetition penalties)")
    logit_bias: dict[str, _num()] | None = Field(None, description="not supported: leave it out or send {}")
    user: str | None = None
    cache_salt: str | None = Field(None, description="prompt prefixes are reused only among requests with this salt")


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Logprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = Field(
        None, description="'required' or a named function: the output is a call, grammar-constrained"
    )
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = Field(None, description="json_object / json_schema: grammar-constrained")
    chat_template_kwargs: ChatTemplateKwargs | None = None
    reasoning_effort: str | Int | None = None
    thinking: Thinking | bool | None = None
    functions: list[dict[str, Any]] | None = Field(None, description="deprecated by OpenAI; use tools")
    function_call: str | dict[str, Any] | None = Field(None, description="deprecated by OpenAI; use tool_choice")


class CompletionRequestBody(_Sampling):
    prompt: (
        str
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    ) = Field(description="one prompt: text, token ids, or an array holding one of those")
    max_tokens: Annotated[Int, Field(ge=0)] | None = COMPLETION_MAX_TOKENS
    logprobs: bool | Logprobs | None = Field(None, description="k alternatives per token; true means 1 (as vLLM)")
    echo: bool | None = False
    suffix: str | None = Field(None, description="not supported")
    best_of: Annotated[Int, Field(ge=1)] | None = Field(
        None, description=f"sequences generated, the n of highest cumulative logprob returned; at most {MAX_CHOICES}"
    )


class TokenizeRequestBody(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class DetokenizeRequestBody(_Model):
    model: str | None = None
    tokens: list[TokenId]


BODIES = (ChatCompletionRequest, CompletionRequestBody, TokenizeRequestBody, DetokenizeRequestBody)


# ---- validation ---------------------------------------------------------------------------------------------------
def validate(model: type[BaseModel], body):
    """JSON value -> model, or InvalidRequest naming the first bad parameter."""
    if not isinstance(body, Mapping):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _invalid(e.errors(include_url=False)) from None


# pydantic's loc names union members and wrappers ('str', 'list[int]', 'function-after[...]'); a param names fields
_NOT_FIELDS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc) -> str | None:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _NOT_FIELDS or not part.replace("_", "a").isalnum() or part[0].isupper():  # a model's name
            continue
        else:
            out += f".{part}" if out else part
    return out or None


def _invalid(errors: list[dict]) -> InvalidRequest:
    # a union reports one error per member; the one that got deepest into the value is the one the client meant
    err = max(errors, key=lambda e: len((_param(e["loc"]) or "").replace("[", ".[").split(".")))
    param = _param(err["loc"])
    if err["type"] == "missing":
        return InvalidRequest(f"{param} is required", param=param)
    if err["type"] == "extra_forbidden":
        return InvalidRequest(f"{param} is not a known field here", param=param)
    msg = err["msg"].removeprefix("Value error, ")
    got = err.get("input")
    shown = repr(got) if isinstance(got, int | float | bool | str) and len(repr(got)) <= 40 else None
    return InvalidRequest(f"{param}: {msg}" + (f"; got {shown}" if shown else ""), param=param)


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the served id, its aliases, the context, the vocabulary."""

    model_id: str
    aliases: tuple[str, ...]
    max_len: int
    vocab_size: int
    chat_defaults: ChatOptions = ChatOptions()

    def check(self, name: str | None) -> None:
        if name is not None and name != self.model_id and name not in self.aliases:
            raise ModelSourceError(f"the model {name!r} does not exist; this server serves {self.model_id!r}")

    def check_ids(self, ids, param: str) -> tuple[int, ...]:
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{param}: token ids must be in 0..{self.vocab_size - 1}; got {bad}", param=param)
        return tuple(ids)


@dataclass(frozen=True)
class Stream:
    """How to answer: SSE or one JSON object, and whether a usage chunk ends the stream."""

    stream: bool = False
    include_usage: bool = False


def unknown_fields(body: BaseModel) -> list[str]:
    return sorted(body.model_extra or ())


# ---- conversion ---------------------------------------------------------------------------------------------------
def _stream(b: _Sampling) -> Stream:
    if b.stream_options is not None and not b.stream:
        raise InvalidRequest("stream_options is only allowed with stream: true", param="stream_options")
    return Stream(bool(b.stream), bool(b.stream_options and b.stream_options.include_usage))


def _neutral(value, key: str, neutral) -> None:
    if value is not None and value != neutral:
        raise InvalidRequest(f"{key} is not supported by this server (no repetition penalties; send {neutral})", key)


def _choices(n: int | None, best_of: int | None, stream: bool) -> tuple[int, int | None]:
    """n and best_of checked as vLLM checks them -> (n, best_of or None)."""
    n = n or 1
    if n > MAX_CHOICES:
        raise InvalidRequest(f"n is {n}; this server allows at most {MAX_CHOICES} choices a request", param="n")
    if best_of is None or best_of == n:
        return n, None
    if best_of < n:
        raise InvalidRequest(f"best_of ({best_of}) must be at least n ({n})", param="best_of")
    if best_of > MAX_CHOICES:
        raise InvalidRequest(f"best_of is {best_of}; this server allows at most {MAX_CHOICES}", param="best_of")
    if stream:
        raise InvalidRequest("best_of > n cannot be streamed: send stream: false", param="best_of")
    return n, best_of


def _options(b: _Sampling, served: ServedModel, max_tokens: int | None, logprobs: int | None,
             best_of: int | None = None) -> GenerationOptions:  # fmt: skip
    served.check(b.model)
    n, best_of = _choices(b.n, best_of, bool(b.stream))
    _neutral(b.presence_penalty, "presence_penalty", 0)
    _neutral(b.frequency_penalty, "frequency_penalty", 0)
    _neutral(b.repetition_penalty, "repetition_penalty", 1)
    if b.logit_bias:
        raise InvalidRequest("logit_bias is not supported by this server", param="logit_bias")
    stops = (b.stop,) if isinstance(b.stop, str) else tuple(b.stop or ())
    if max_tokens is not None and b.min_tokens is not None and b.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({b.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    return GenerationOptions(
        max_tokens=max_tokens,
        temperature=1.0 if b.temperature is None else b.temperature,
        top_p=1.0 if b.top_p is None else b.top_p,
        top_k=max(b.top_k or 0, 0),  # -1 and 0 both mean off (vLLM spells it -1)
        min_p=b.min_p or 0.0,
        seed=b.seed,
        stop=tuple(s for s in stops if s),
        stop_token_ids=served.check_ids(b.stop_token_ids or (), "stop_token_ids"),
        min_tokens=b.min_tokens or 0,
        include_stop_str_in_output=bool(b.include_stop_str_in_output),
        ignore_eos=bool(b.ignore_eos),
        skip_special_tokens=b.skip_special_tokens is not False,
        logprobs=logprobs,
        prompt_logprobs=b.prompt_logprobs,
        n=n,
        best_of=best_of,
    )


def to_chat(b: ChatCompletionRequest, raw: Mapping, served: ServedModel) -> tuple[ChatRequest, Stream]:
    """A validated chat body -> (ChatRequest, how to answer). `raw` is the JSON body: its messages and tools go to
    the template as the client sent them."""
    for key in ("functions", "function_call"):
        if getattr(b, key) is not None:
            raise InvalidRequest(f"{key} is deprecated and not supported; use tools", param=key)
    named = b.tool_choice.function.name if isinstance(b.tool_choice, NamedToolChoice) else None
    choice, name = tool_choice("function" if named else b.tool_choice, named, raw.get("tools"))
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    if b.top_logprobs and not b.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    options = _options(b, served, max_tokens, (b.top_logprobs or 0) if b.logprobs else None)
    kw = b.chat_template_kwargs.model_dump(exclude_none=True) if b.chat_template_kwargs is not None else None
    thinking = {"type": b.thinking.type} if isinstance(b.thinking, Thinking) else b.thinking
    chat = chat_options(kw, reasoning_effort=b.reasoning_effort, thinking=thinking, defaults=served.chat_defaults)
    req = ChatRequest(
        messages=raw["messages"],
        options=options,
        chat=chat,
        tools=raw.get("tools") or None,
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=b.parallel_tool_calls is not False,
        response_format=_chat_format(b.response_format),
        cache_salt=b.cache_salt,
    )
    return req, _stream(b)


def json_format(kind: str, schema: dict | None, param: str = "response_format") -> JsonFormat | None:
    """A response format (text | json_object | json_schema with its schema) -> the service's JsonFormat (None: free
    text)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonFormat()
    if schema is None:
        raise InvalidRequest(f"{param}: a schema is required with type json_schema", param=param)
    return JsonFormat(schema)


def _chat_format(f: ResponseFormat | None) -> JsonFormat | None:
    if f is None:
        return None
    return json_format(f.type, f.json_schema.schema_ if f.json_schema is not None else None)


def tool_choice(choice: str | None, name: str | None, tools, param: str = "tool_choice") -> tuple[str, str | None]:
    """tool_choice (auto | none | required | function, with the function's name) checked against the request's tools
    -> (the service's tool_choice, the forced function's name)."""
    if choice is None or choice in ("auto", "none"):
        return choice or "auto", None
    names = [t["function"]["name"] for t in tools or () if isinstance(t, Mapping) and "function" in t]
    if not names:
        raise InvalidRequest(f"{param} forces a tool call, but the request has no tools", param=param)
    if choice == "function" and name not in names:
        raise InvalidRequest(f"{param}: no tool is named {name!r}", param=param)
    return choice, name if choice == "function" else None


def to_completion(b: CompletionRequestBody, served: ServedModel) -> tuple[CompletionRequest, Stream]:
    """A validated completions body -> (CompletionRequest, how to answer)."""
    prompt = _prompt(b.prompt, served)
    if b.suffix:
        raise InvalidRequest("suffix is not supported by this server", param="suffix")
    logprobs = b.logprobs
    if isinstance(logprobs, bool):  # vLLM reads true as 1 alternative; false is off
        logprobs = 1 if logprobs else None
    max_tokens = COMPLETION_MAX_TOKENS if b.max_tokens is None else b.max_tokens
    options = _options(b, served, max_tokens, logprobs, b.best_of)
    req = CompletionRequest(prompt, options, echo=bool(b.echo), cache_salt=b.cache_salt)
    return req, _stream(b)


def _prompt(value, served: ServedModel) -> str | tuple[int, ...]:
    """One prompt of str | [int] | [str] | [[int]]; a batch of several is a 400 (one sequence at a time)."""
    if isinstance(value, str):
        return value
    if len(value) > 1 and not isinstance(value[0], int):
        raise InvalidRequest("batched prompts are not supported: send one prompt per request", param="prompt")
    first = value[0]
    if isinstance(first, str):
        return first
    return served.check_ids(first if isinstance(first, list) else value, "prompt")


@dataclass(frozen=True)
class TokenizeRequest:
    prompt: str | None = None
    messages: list | None = None
    tools: list | None = None
    chat: ChatOptions = ChatOptions()
    add_special_tokens: bool = True
    return_token_strs: bool = False


def to_tokenize(b: TokenizeRequestBody, raw: Mapping, served: ServedModel) -> TokenizeRequest:
    """POST /tokenize: {"prompt": str} or {"messages": [...]} (rendered with the chat template)."""
    served.check(b.model)
    strs = bool(b.return_token_strs)
    if b.messages is not None:
        kw = b.chat_template_kwargs.model_dump(exclude_none=True) if b.chat_template_kwargs is not None else None
        chat = chat_options(kw, defaults=served.chat_defaults)
        return TokenizeRequest(messages=raw["messages"], tools=raw.get("tools"), chat=chat, return_token_strs=strs)
    if b.prompt is None:
        raise InvalidRequest("prompt must be a string (or send messages)", param="prompt")
    return TokenizeRequest(
        prompt=b.prompt, add_special_tokens=b.add_special_tokens is not False, return_token_strs=strs
    )


def to_detokenize(b: DetokenizeRequestBody, served: ServedModel) -> tuple[int, ...]:
    served.check(b.model)
    return served.check_ids(b.tokens, "tokens")
