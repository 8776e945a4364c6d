"""Handlers: /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize, /health, /metrics.

A handler takes the app and the parsed body and returns a Reply (one response) or a Generation (which app.py runs
on a worker thread, streamed or folded). Handlers never see HTTP details beyond that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dsflash.errors import ModelSourceError, NotReady
from dsflash.server import protocol, render, sse
from dsflash.server.openapi import openapi
from dsflash.server.protocol import Stream
from dsflash.server.render import Meta
from dsflash.service.api import ChatRequest, CompletionRequest
from dsflash.text.detokenizer import token_text


@dataclass
class Reply:
    status: int
    body: bytes
    content_type: bytes = b"application/json"
    headers: list = field(default_factory=list)


def json_reply(obj, status: int = 200) -> Reply:
    return Reply(status, sse.dumps(obj))


@dataclass
class Generation:
    """A generation request, parsed: what to open, how to render it, where to count it."""

    endpoint: str  # chat | completion
    request: ChatRequest | CompletionRequest
    stream: Stream
    meta: Meta
    ignored: list[str]

    def open(self, generator):
        if self.endpoint == "chat":
            return generator.open_chat(self.request)
        return generator.open_completion(self.request)

    def render_stream(self, deltas):
        fn = render.stream_chat if self.endpoint == "chat" else render.stream_completion
        return fn(deltas, self.meta)

    def render_full(self, deltas):
        fn = render.full_chat if self.endpoint == "chat" else render.full_completion
        return fn(deltas, self.meta)


def _served(app):
    if app.generator is None:
        raise NotReady("the model is still loading" if app.state == "loading" else f"the server is {app.state}")
    return app.generator


def _card(app) -> dict:
    s = app.served
    return {
        "id": s.model_id,
        "object": "model",
        "created": app.created,
        "owned_by": "dsflash",
        "root": app.root,
        "parent": None,
        "max_model_len": s.max_len,
    }


def models(app, body) -> Reply:
    _served(app)  # 503 until loaded: a listed model is a model that answers
    return json_reply({"object": "list", "data": [_card(app)]})


def model(app, name: str) -> Reply:
    """GET /v1/models/{name}: the card, under the id or any alias."""
    _served(app)
    if name != app.served.model_id and name not in app.served.aliases:
        raise ModelSourceError(f"the model {name!r} does not exist; this server serves {app.served.model_id!r}")
    return json_reply(_card(app))


def chat(app, body) -> Generation:
    return _generation(app, body, "chat", protocol.parse_chat, protocol.CHAT_FIELDS)


def completion(app, body) -> Generation:
    return _generation(app, body, "completion", protocol.parse_completion, protocol.COMPLETION_FIELDS)


def _generation(app, body, kind: str, parse, fields) -> Generation:
    _served(app)
    req, stream = parse(body, app.served)
    logprobs = req.options.logprobs is not None
    meta = Meta(app.served.model_id, kind, logprobs=logprobs, include_usage=stream.include_usage)
    req = _with_id(req, meta.id)
    return Generation(kind, req, stream, meta, protocol.unknown_fields(body, fields))


def _with_id(req, request_id: str):
    return replace(req, request_id=request_id)


def tokenize(app, body) -> Reply:
    gen = _served(app)
    t = protocol.parse_tokenize(body, app.served)
    if t.messages is not None:
        ids = gen.chat_prompt(ChatRequest(t.messages, chat=t.chat, tools=t.tools))
    else:
        ids = gen.text_prompt(t.prompt, t.add_special_tokens)
    out = {"count": len(ids), "max_model_len": app.served.max_len, "tokens": ids}
    if t.return_token_strs:
        out["token_strs"] = [token_text(gen.tokenizer, i) for i in ids]
    return json_reply(out)


def detokenize(app, body) -> Reply:
    gen = _served(app)
    ids = protocol.parse_detokenize(body, app.served)
    return json_reply({"prompt": gen.detokenize(list(ids))})


def health(app, body) -> Reply:
    if app.state != "ready":
        raise NotReady("the model is still loading" if app.state == "loading" else f"the server is {app.state}")
    return json_reply({"status": "ok"})


def metrics(app, body) -> Reply:
    return Reply(200, app.metrics.render().encode(), b"text/plain; version=0.0.4; charset=utf-8")


def schema(app, body) -> Reply:
    _served(app)  # the document states the model's context and vocabulary: 503 until they are known
    return json_reply(openapi(app.served, auth=app.api_key is not None))


@dataclass(frozen=True)
class Route:
    method: str
    handler: Callable
    auth: bool = True  # needs the API key when one is set


ROUTES: dict[str, Route] = {
    "/v1/models": Route("GET", models),
    "/v1/chat/completions": Route("POST", chat),
    "/v1/completions": Route("POST", completion),
    "/tokenize": Route("POST", tokenize),
    "/detokenize": Route("POST", detokenize),
    "/v1/tokenize": Route("POST", tokenize),
    "/v1/detokenize": Route("POST", detokenize),
    "/health": Route("GET", health, auth=False),
    "/metrics": Route("GET", metrics, auth=False),
    "/openapi.json": Route("GET", schema, auth=False),
}
