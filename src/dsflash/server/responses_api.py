"""OpenAI's Responses API (POST /v1/responses) over the chat service: the request body, its conversion to a
ChatRequest (input items -> chat messages), and the Deltas rendered as a `response` object or its stream of events.

Nothing is stored: `previous_response_id` is a 400, and a conversation continues by sending its items again (the
`function_call` and `function_call_output` items of a tool round trip included). Both renderings come from one
builder, so the streamed events and the folded object cannot disagree.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from dsflash.errors import InvalidRequest
from dsflash.server.protocol import (
    Int,
    Logprobs,
    ServedModel,
    Stream,
    _Model,
    _options,
    _Sampling,
    json_format,
    tool_choice,
)
from dsflash.server.render import _lp, new_id
from dsflash.service.api import ChatRequest, Delta, TokenLogprob, Usage
from dsflash.text.chat import chat_options


# ---- the request ----------------------------------------------------------------------------------------------------
class ResponsesTool(_Model):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedTool(_Model):
    type: Literal["function"]
    name: str


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Model):
    format: TextFormat | None = None


class ReasoningConfig(_Model):
    effort: str | None = Field(None, description="'none' turns thinking off; other values as reasoning_effort")
    summary: str | None = None


class ResponsesRequest(_Sampling):
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[Int, Field(ge=1)] | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = Field(None, description="not supported: nothing is stored")
    store: bool | None = Field(None, description="accepted; nothing is stored")
    top_logprobs: Logprobs | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None


@dataclass(frozen=True)
class Echo:
    """The request's settings a `response` object states back."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list = field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    text: dict = field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict | None = None
    metadata: dict = field(default_factory=dict)
    top_logprobs: int | None = None


def to_responses(b: ResponsesRequest, served: ServedModel) -> tuple[ChatRequest, Stream, Echo]:
    """A validated Responses body -> (ChatRequest, how to answer, what the response states back)."""
    if b.previous_response_id is not None:
        raise InvalidRequest("previous_response_id is not supported: nothing is stored; send the items again",
                             param="previous_response_id")  # fmt: skip
    tools = [_chat_tool(t, i) for i, t in enumerate(b.tools or ())]
    choice = b.tool_choice
    named = choice.model_dump() if isinstance(choice, ResponsesNamedTool) else None
    mode, name = tool_choice("function" if named else choice, named and named["name"], tools)
    fmt = b.text.format if b.text is not None else None
    if b.n not in (None, 1):  # a response holds one output; OpenAI's Responses API has no n
        raise InvalidRequest("n > 1 is not supported by the Responses API; use /v1/chat/completions", param="n")
    options = _options(b, served, b.max_output_tokens, b.top_logprobs)
    effort = b.reasoning.effort if b.reasoning is not None else None
    thinking = False if effort == "none" else None
    chat = chat_options(None, reasoning_effort=None if effort in (None, "none") else effort, thinking=thinking,
                        defaults=served.chat_defaults)  # fmt: skip
    req = ChatRequest(
        messages=to_messages(b.input, b.instructions),
        options=options,
        chat=chat,
        tools=tools or None,
        tool_choice=mode,
        tool_name=name,
        parallel_tool_calls=b.parallel_tool_calls is not False,
        response_format=json_format(fmt.type, fmt.schema_, "text.format") if fmt is not None else None,
        cache_salt=b.cache_salt,
    )
    echo = Echo(
        instructions=b.instructions,
        max_output_tokens=b.max_output_tokens,
        tools=[t.model_dump(exclude_none=True, by_alias=True) | {"strict": bool(t.strict)} for t in b.tools or ()],
        tool_choice=named or choice or "auto",
        parallel_tool_calls=b.parallel_tool_calls is not False,
        temperature=options.temperature,
        top_p=options.top_p,
        text={"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
        reasoning={"effort": effort, "summary": None} if b.reasoning is not None else None,
        metadata=dict(b.metadata or {}),
        top_logprobs=b.top_logprobs,
    )
    return req, Stream(bool(b.stream), False), echo


def _chat_tool(t: ResponsesTool, i: int) -> dict:
    if t.type != "function":
        raise InvalidRequest(f"tools[{i}].type: only function tools are supported; got {t.type!r}", f"tools[{i}].type")
    if not t.name:
        raise InvalidRequest(f"tools[{i}].name is required", param=f"tools[{i}].name")
    fn = {"name": t.name, "parameters": t.parameters or {"type": "object", "properties": {}}}
    if t.description:
        fn["description"] = t.description
    return {"type": "function", "function": fn}


def to_messages(items, instructions: str | None) -> list[dict]:
    """Responses input (a string, or items: messages, function calls and their outputs) -> chat messages."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": _role(item, i), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", i), "type": "function",
                    "function": {"name": _str(item, "name", i), "arguments": _str(item, "arguments", i)}}  # fmt: skip
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # one turn's calls are one assistant message
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, i)
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", i), "content": text})
        elif kind == "reasoning":
            continue  # earlier turns' reasoning is dropped by the chat template anyway (drop_thinking)
        else:
            raise InvalidRequest(f"input[{i}].type {kind!r} is not supported", param=f"input[{i}].type")
    return out


def _role(item: Mapping, i: int) -> str:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequest(f"input[{i}].role must be user, system, developer or assistant", f"input[{i}].role")
    return role


def _str(item: Mapping, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"input[{i}].{key} must be a string", param=f"input[{i}].{key}")
    return value


def _text(content, i: int) -> str:
    """A message's content: a string, or text parts (input_text / output_text / text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"input[{i}].content must be a string or an array of parts", f"input[{i}].content")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") not in ("input_text", "output_text", "text"):
            got = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidRequest(f"input[{i}].content[{j}]: only text parts are supported; got {got!r}",
                                 param=f"input[{i}].content[{j}].type")  # fmt: skip
        texts.append(str(part.get("text", "")))
    return "".join(texts)


# ---- the response ---------------------------------------------------------------------------------------------------
@dataclass
class ResponseMeta:
    model: str
    echo: Echo
    id: str = field(default_factory=lambda: new_id("resp"))
    created: int = field(default_factory=lambda: int(time.time()))


def usage_json(u: Usage | None) -> dict | None:
    if u is None:
        return None
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.total_tokens,
    }


def _logprobs(entries) -> list[dict]:
    return [
        {"token": e.token, "bytes": list(e.bytes), "logprob": _lp(e.logprob),
         "top_logprobs": [{"token": t.token, "bytes": list(t.bytes), "logprob": _lp(t.logprob)} for t in e.top or ()]}
        for e in entries
    ]  # fmt: skip


class _Builder:
    """Deltas -> Responses events, keeping the output items; the last event's response is the folded object."""

    def __init__(self, meta: ResponseMeta):
        self.meta, self.items, self.seq = meta, [], 0
        self.open: dict | None = None  # the reasoning or message item text is being added to

    def event(self, kind: str, **body) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **body}

    def response(self, status: str, usage: Usage | None = None, reason: str | None = None) -> dict:
        e, m = self.meta.echo, self.meta
        return {
            "id": m.id, "object": "response", "created_at": m.created, "status": status, "model": m.model,
            "output": [dict(i) for i in self.items], "error": None,
            "incomplete_details": {"reason": reason} if reason else None,
            "instructions": e.instructions, "max_output_tokens": e.max_output_tokens, "metadata": e.metadata,
            "parallel_tool_calls": e.parallel_tool_calls, "temperature": e.temperature, "top_p": e.top_p,
            "tool_choice": e.tool_choice, "tools": e.tools, "text": e.text, "reasoning": e.reasoning,
            "top_logprobs": e.top_logprobs, "truncation": "disabled", "usage": usage_json(usage),
        }  # fmt: skip

    def start(self) -> Iterator[dict]:
        yield self.event("response.created", response=self.response("in_progress"))
        yield self.event("response.in_progress", response=self.response("in_progress"))

    def feed(self, d: Delta) -> Iterator[dict]:
        if d.kind == "reasoning" and d.text:
            yield from self._text("reasoning", d.text, ())
        elif d.kind == "content" and (d.text or d.logprobs):
            yield from self._text("message", d.text, d.logprobs)
        elif d.kind == "tool_call":
            yield from self._close()
            c = d.tool_call
            item = {"type": "function_call", "id": new_id("fc"), "call_id": c.id, "name": c.name, "arguments": "",
                    "status": "in_progress"}  # fmt: skip
            index = len(self.items)
            self.items.append(item)
            yield self.event("response.output_item.added", output_index=index, item=dict(item))
            yield self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                             delta=c.arguments)  # fmt: skip
            yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=c.arguments, name=c.name)  # fmt: skip
            item.update(arguments=c.arguments, status="completed")
            yield self.event("response.output_item.done", output_index=index, item=dict(item))

    def finish(self, reason: str, usage: Usage | None) -> Iterator[dict]:
        yield from self._close("incomplete" if reason == "length" else "completed")
        if reason == "length":
            yield self.event("response.incomplete", response=self.response("incomplete", usage, "max_output_tokens"))
        else:
            yield self.event("response.completed", response=self.response("completed", usage))

    def _text(self, kind: str, text: str, logprobs: tuple[TokenLogprob, ...]) -> Iterator[dict]:
        if self.open is None or self.open["type"] != kind:
            yield from self._close()
            yield from self._open(kind)
        index, item = len(self.items) - 1, self.open
        part = item["content"][0]
        part["text"] += text
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if kind == "reasoning":
            yield self.event("response.reasoning_text.delta", **ids, delta=text)
        else:
            lps = _logprobs(logprobs) if self.meta.echo.top_logprobs is not None else []
            part["logprobs"].extend(lps)
            yield self.event("response.output_text.delta", **ids, delta=text, logprobs=lps)

    def _open(self, kind: str) -> Iterator[dict]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": new_id("msg"), "role": "assistant", "status": "in_progress",
                    "content": []}  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        index = len(self.items)
        self.items.append(item)
        yield self.event("response.output_item.added", output_index=index, item=_copy(item))
        item["content"].append(part)
        self.open = item
        yield self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                         part=dict(part, text=""))  # fmt: skip

    def _close(self, status: str = "completed") -> Iterator[dict]:
        item, self.open = self.open, None
        if item is None:
            return
        index, part = self.items.index(item), item["content"][0]
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            yield self.event("response.reasoning_text.done", **ids, text=part["text"])
        else:
            yield self.event("response.output_text.done", **ids, text=part["text"], logprobs=part["logprobs"])
        yield self.event("response.content_part.done", **ids, part=dict(part))
        item["status"] = status
        yield self.event("response.output_item.done", output_index=index, item=_copy(item))


def _copy(item: dict) -> dict:
    return {**item, "content": [dict(p) for p in item.get("content", ())]}


def stream_response(deltas: Iterator[Delta], meta: ResponseMeta) -> Iterator[dict]:
    """The events of one response: created, in_progress, the items' events, then completed (or incomplete)."""
    b = _Builder(meta)
    yield from b.start()
    for d in deltas:
        if d.finish_reason is not None:
            yield from b.feed(d)
            yield from b.finish(d.finish_reason, d.usage)
            return
        yield from b.feed(d)


def full_response(deltas: Iterator[Delta], meta: ResponseMeta) -> dict:
    """The same deltas folded into one `response` object (the last event's)."""
    last = None
    for ev in stream_response(deltas, meta):
        last = ev
    return last["response"]
