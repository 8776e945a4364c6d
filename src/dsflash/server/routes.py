"""The routes: /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize, /tokenizer_info, /version,
/health, /metrics, /openapi.json, bound to one App.

An endpoint reads its body itself (app.read_json: the size cap, our JSON errors, no content-type guessing) and
validates it with its pydantic model (protocol.py); the OpenAPI document names the same models (openapi.py), so what
is documented is what is checked. Generation endpoints return a GenerationResponse, which app.py runs on a worker
thread, streamed or folded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from starlette.responses import Response

from dsflash import __version__
from dsflash.errors import ModelSourceError, NotReady
from dsflash.server import openapi, protocol, render, responses, responses_api, sse
from dsflash.server.errors import classify, error_frame
from dsflash.server.metrics import CONTENT_TYPE
from dsflash.server.protocol import Stream
from dsflash.server.render import Meta
from dsflash.service.api import ChatRequest, CompletionRequest
from dsflash.text.detokenizer import token_text

if TYPE_CHECKING:
    from dsflash.server.app import App


def json_reply(obj, status: int = 200) -> Response:
    return Response(sse.dumps(obj), status, media_type="application/json")


@dataclass
class Generation:
    """A generation request, parsed: what to open, how to render it, where to count it."""

    endpoint: str  # chat | completion | responses
    request: ChatRequest | CompletionRequest
    stream: Stream
    meta: Meta | responses_api.ResponseMeta
    ignored: list[str]

    def open(self, generator):
        if self.endpoint == "completion":
            return generator.open_completion(self.request)
        return generator.open_chat(self.request)

    def render_stream(self, deltas):
        return _RENDER[self.endpoint][0](deltas, self.meta)

    def render_full(self, deltas):
        return _RENDER[self.endpoint][1](deltas, self.meta)

    def frame(self, obj: dict) -> bytes:
        """One SSE frame: the Responses API names each event (`event: <type>`), chat and completions do not."""
        if self.endpoint == "responses":
            return b"event: " + obj["type"].encode() + b"\n" + sse.frame(obj)
        return sse.frame(obj)

    def error_frame(self, exc: BaseException) -> bytes:
        """An error after the stream started: the chat envelope as data, or the Responses API's `error` event."""
        if self.endpoint == "responses":
            err = classify(exc)[1]["error"]
            return self.frame({"type": "error", "sequence_number": 0, "code": err["code"] or err["type"],
                               "message": err["message"], "param": err["param"]})  # fmt: skip
        return sse.raw_frame(error_frame(exc))

    @property
    def done(self) -> bytes:
        """What ends the stream: `data: [DONE]`, except in the Responses API (its last event is the end)."""
        return b"" if self.endpoint == "responses" else sse.DONE


_RENDER = {
    "chat": (render.stream_chat, render.full_chat),
    "completion": (render.stream_completion, render.full_completion),
    "responses": (responses_api.stream_response, responses_api.full_response),
}


class GenerationResponse(Response):
    """What a generation endpoint returns: the app runs the request when Starlette sends this response."""

    def __init__(self, app: App, work: Generation):
        self.app, self.work = app, work
        self.background, self.status_code = None, 200  # what FastAPI reads of a returned Response

    async def __call__(self, scope, receive, send) -> None:
        await self.app.generate(self.work, scope, receive, send)


def _card(app: App) -> dict:
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


def _generation(app: App, kind: str, body, raw) -> Generation:
    if kind == "responses":
        req, stream, echo = responses_api.to_responses(body, app.served)
        meta = responses_api.ResponseMeta(app.served.model_id, echo)
        return Generation(kind, replace(req, request_id=meta.id), stream, meta, protocol.unknown_fields(body))
    if kind == "chat":
        req, stream = protocol.to_chat(body, raw, app.served)
    else:
        req, stream = protocol.to_completion(body, app.served)
    opts = req.options
    meta = Meta(
        app.served.model_id,
        kind,
        logprobs=opts.logprobs is not None,
        include_usage=stream.include_usage,
        prompt_logprobs=opts.prompt_logprobs is not None,
        n=opts.n,
    )
    return Generation(kind, replace(req, request_id=meta.id), stream, meta, protocol.unknown_fields(body))


@dataclass(frozen=True)
class _Doc:
    """How a route appears in /openapi.json."""

    summary: str
    ok: type | None = None  # the 200 body's model
    body: type | None = None  # the request body's model
    stream: bool = False  # also answers text/event-stream
    errors: tuple[int, ...] = (503,)
    media: str = "application/json"


def install(api: FastAPI, app: App) -> None:
    """Bind every route to `app`."""

    async def models(request: Request) -> Response:
        app.authorize(request)
        app.ready_generator()  # 503 until loaded: a listed model is a model that answers
        return json_reply({"object": "list", "data": [_card(app)]})

    async def model(request: Request, name: str) -> Response:
        app.authorize(request)
        app.ready_generator()
        if name != app.served.model_id and name not in app.served.aliases:
            raise ModelSourceError(f"the model {name!r} does not exist; this server serves {app.served.model_id!r}")
        return json_reply(_card(app))

    def generation(kind: str, model_type):
        async def endpoint(request: Request) -> Response:
            app.authorize(request)
            app.ready_generator()
            raw = await app.read_json(request)
            body = protocol.validate(model_type, raw)
            return GenerationResponse(app, _generation(app, kind, body, raw))

        return endpoint

    async def tokenize(request: Request) -> Response:
        app.authorize(request)
        gen = app.ready_generator()
        raw = await app.read_json(request)
        t = protocol.to_tokenize(protocol.validate(protocol.TokenizeRequestBody, raw), raw, app.served)
        if t.messages is not None:
            ids = gen.chat_prompt(ChatRequest(t.messages, chat=t.chat, tools=t.tools))
        else:
            ids = gen.text_prompt(t.prompt, t.add_special_tokens)
        out = {"count": len(ids), "max_model_len": app.served.max_len, "tokens": ids}
        if t.return_token_strs:
            out["token_strs"] = [token_text(gen.tokenizer, i) for i in ids]
        return json_reply(out)

    async def detokenize(request: Request) -> Response:
        app.authorize(request)
        gen = app.ready_generator()
        raw = await app.read_json(request)
        ids = protocol.to_detokenize(protocol.validate(protocol.DetokenizeRequestBody, raw), app.served)
        return json_reply({"prompt": gen.detokenize(list(ids))})

    async def tokenizer_info(request: Request) -> Response:
        app.authorize(request)
        gen = app.ready_generator()
        return json_reply(gen.tokenizer_info())

    async def version(request: Request) -> Response:
        return json_reply({"version": __version__, "model": app.model_id, "revision": app.revision})

    async def health(request: Request) -> Response:
        if app.state != "ready":
            raise NotReady("the model is still loading" if app.state == "loading" else f"the server is {app.state}")
        return json_reply({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(app.metrics.render(), 200, media_type=CONTENT_TYPE)

    built: list[bytes] = []  # the document, once: the served model does not change after attach

    async def schema(request: Request) -> Response:
        app.ready_generator()  # the document states the model's context and vocabulary: 503 until they are known
        if not built:
            built.append(sse.dumps(openapi.document(api, app.served, auth=app.api_key is not None)))
        return Response(built[0], 200, media_type="application/json")

    gen_errors = (400, 404, 413, 429, 503)
    table: list[tuple[str, str, Callable, _Doc]] = [
        ("GET", "/v1/models", models, _Doc("the served model", responses.ModelList)),
        ("GET", "/v1/models/{name:path}", model, _Doc("a model card", responses.ModelCard, errors=(404, 503))),
        (
            "POST",
            "/v1/chat/completions",
            generation("chat", protocol.ChatCompletionRequest),
            _Doc("chat completion", responses.ChatCompletionResponse, protocol.ChatCompletionRequest, True, gen_errors),
        ),
        (
            "POST",
            "/v1/responses",
            generation("responses", responses_api.ResponsesRequest),
            _Doc(
                "a response (OpenAI's Responses API)",
                responses.ResponseObject,
                responses_api.ResponsesRequest,
                True,
                gen_errors,
            ),  # fmt: skip
        ),
        (
            "POST",
            "/v1/completions",
            generation("completion", protocol.CompletionRequestBody),
            _Doc("text completion", responses.CompletionResponse, protocol.CompletionRequestBody, True, gen_errors),
        ),
        (
            "POST",
            "/tokenize",
            tokenize,
            _Doc("prompt -> token ids", responses.TokenizeResponse, protocol.TokenizeRequestBody, errors=gen_errors),
        ),
        (
            "POST",
            "/detokenize",
            detokenize,
            _Doc("token ids -> text", responses.DetokenizeResponse, protocol.DetokenizeRequestBody, errors=gen_errors),
        ),
        ("POST", "/v1/tokenize", tokenize, _Doc("")),
        ("POST", "/v1/detokenize", detokenize, _Doc("")),
        (
            "GET",
            "/tokenizer_info",
            tokenizer_info,
            _Doc("the tokenizer's facts and chat template", responses.TokenizerInfo),
        ),
        (
            "GET",
            "/version",
            version,
            _Doc("dsflash's version, the model and its revision", responses.Version, errors=()),
        ),
        ("GET", "/health", health, _Doc("200 when ready, 503 while loading or shutting down", responses.Health)),
        ("GET", "/metrics", metrics, _Doc("Prometheus metrics", None, errors=(), media="text/plain")),
        ("GET", "/openapi.json", schema, _Doc("")),
    ]
    for method, path, fn, doc in table:
        shown = bool(doc.summary)
        extra = openapi.operation(doc.ok, doc.body, doc.stream, doc.errors, doc.media) if shown else None
        api.add_api_route(
            path, fn, methods=[method], summary=doc.summary or None, include_in_schema=shown, openapi_extra=extra
        )
        if method == "GET":  # load balancers and uptime checks probe with HEAD: GET's status and headers
            api.add_api_route(path, fn, methods=["HEAD"], include_in_schema=False)


def methods_of(api: FastAPI, path: str) -> set[str]:
    """Every method some route takes on `path` (for a 405's Allow header)."""
    out: set[str] = set()
    for route in api.router.routes:
        regex = getattr(route, "path_regex", None)
        if regex is not None and regex.match(path):
            out |= set(getattr(route, "methods", None) or ())
    return out
