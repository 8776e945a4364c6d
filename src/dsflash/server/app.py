"""The ASGI app: FastAPI routes (routes.py) over the loading / ready / draining lifecycle, the body cap, the API key,
CORS, and generation on worker threads with client-disconnect cancellation.

Threads: the event loop (HTTP I/O only), a worker thread per generation request in flight (prompt encoding,
detokenizing, parsing, JSON; the threads are kept between requests), the engine thread (tokens only). A worker
hands frames to the loop through call_soon_threadsafe.
A disconnect is seen by awaiting ASGI `receive()` (uvicorn answers `http.disconnect` when the socket closes), at
any point: queued, prefilling or decoding; it cancels the engine handle, which the engine checks every step.
Generation is answered by a Response of its own (GenerationResponse) rather than FastAPI's StreamingResponse: it
needs `receive` from before the first byte (a non-streaming request is cancelled by a disconnect too).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import queue
import re
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from dsflash.errors import DsflashError, InvalidRequest, NotReady, Overloaded
from dsflash.server import routes, sse
from dsflash.server.errors import HttpError, classify
from dsflash.server.metrics import Metrics
from dsflash.server.protocol import ServedModel
from dsflash.server.routes import Generation
from dsflash.service.api import GAUGES, PREFIX_METRICS, Delta
from dsflash.text.chat import ChatOptions

if TYPE_CHECKING:
    from dsflash.service.generator import Generator

log = logging.getLogger("dsflash.server")
request_log = logging.getLogger("dsflash.requests")

MAX_BODY = 16 << 20
PING_INTERVAL = 15.0
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


class App:
    """ASGI callable for one model, loading from the start; `attach(generator)` once it is booted, `drain()` on
    SIGTERM."""

    def __init__(
        self,
        model_id: str,
        aliases: tuple[str, ...] = (),
        root: str | None = None,
        chat_defaults: ChatOptions | None = None,
        api_key: str | None = None,
        max_body: int = MAX_BODY,
        shutdown_grace: float = 5.0,
        allowed_origins: tuple[str, ...] = (),
        revision: str | None = None,
    ):
        self.model_id, self.aliases, self.chat_defaults = model_id, tuple(aliases), chat_defaults or ChatOptions()
        self.root, self.max_body, self.grace, self.revision = root or model_id, max_body, shutdown_grace, revision
        self.api_key = api_key.encode() if api_key else None
        self.state = "loading"  # loading | ready | draining | failed
        self.served: ServedModel | None = None  # what requests are checked against, from the attached service
        self.generator: Generator | None = None
        self.created = int(time.time())
        self.metrics = Metrics(model_id, self._gauges, self._prefix_stats, self._step_histograms)
        self.jobs: set[_Job] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.api = self._build(tuple(allowed_origins))

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def attach(self, generator: Generator) -> None:
        """The booted service: the model's facts (context, vocabulary) come from it, once."""
        self.served = ServedModel(
            self.model_id, self.aliases, generator.max_len, generator.vocab_size, chat_defaults=self.chat_defaults
        )
        self.generator = generator
        if self.state == "loading":
            self.state = "ready"

    def fail(self) -> None:
        self.state = "failed"

    def drain(self) -> None:
        """Stop taking requests; cancel queued ones now and the running one after the grace period. Thread-safe."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._drain)
        else:
            self.state = "draining"

    def _drain(self) -> None:
        if self.state == "draining":
            return
        self.state = "draining"
        for job in list(self.jobs):
            if not job.running:
                job.cancel("shutdown")
        if any(job.running for job in self.jobs):
            log.info("finishing the running request (up to %.0f s) before shutting down", self.grace)
        self.loop.call_later(self.grace, self._cancel_all)

    def _cancel_all(self) -> None:
        for job in list(self.jobs):
            job.cancel("shutdown")

    def _gauges(self) -> dict[str, float]:
        gen = self.generator
        gauges = gen.gauges() if gen is not None else dict.fromkeys(GAUGES, 0)
        return {**gauges, "ready": 1 if self.state == "ready" else 0}

    def _step_histograms(self) -> dict[str, dict[int, int]]:
        gen = self.generator
        return gen.step_histograms() if gen is not None else {}

    def _prefix_stats(self) -> dict[str, float]:
        gen = self.generator
        return gen.prefix_stats() if gen is not None else dict.fromkeys(PREFIX_METRICS, 0)

    # ---- ASGI ---------------------------------------------------------------------------------------------------
    def _build(self, origins: tuple[str, ...]) -> FastAPI:
        # our own /openapi.json (503 while loading, the served model's facts); no /docs: it loads assets from a CDN
        api = FastAPI(title="dsflash", openapi_url=None, docs_url=None, redoc_url=None)
        routes.install(api, self)
        api.add_exception_handler(DsflashError, self._on_error)
        api.add_exception_handler(StarletteHTTPException, self._on_http_error)
        api.add_exception_handler(ClientDisconnect, _on_gone)
        api.add_exception_handler(Exception, self._on_error)  # every error leaves as an OpenAI envelope
        if origins:
            wild = "*" in origins
            api.add_middleware(
                CORSMiddleware,
                allow_origins=["*"] if wild else list(origins),
                allow_methods=["GET", "POST", "HEAD", "OPTIONS"],
                allow_headers=["*"],
                # a wildcard origin with credentials would let any page use a browser's cookies; bearer keys only
                allow_credentials=not wild,
                expose_headers=["Retry-After"],
            )
        return api

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["type"] != "http":
            return
        self.loop = self.loop or asyncio.get_running_loop()
        await self.api(scope, receive, send)

    async def _on_error(self, request: Request, exc: Exception) -> Response:
        reply = self._error_reply(exc, f"{request.method} {request.scope['path']}")
        endpoint = _ENDPOINTS.get(request.scope["path"])
        if endpoint is not None:
            self.metrics.record(endpoint, _outcome(exc, reply.status_code), None, None)
        return reply

    async def _on_http_error(self, request: Request, exc: StarletteHTTPException) -> Response:
        """Routing's own errors (no such path, wrong method) in the OpenAI envelope."""
        method, path = request.method, request.scope["path"]
        if exc.status_code == 405:
            allowed = routes.methods_of(self.api, path)
            use = "GET" if "GET" in allowed else ", ".join(sorted(allowed))
            err = HttpError(
                "method", f"{method} is not allowed on {path} (use {use})", allow=", ".join(sorted(allowed))
            )
        elif exc.status_code == 404:
            err = HttpError("not_found", f"Invalid URL ({method} {path})")
        else:
            err = HttpError("bad_json", str(exc.detail))
        return self._error_reply(err, f"{method} {path}")

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "").encode()
        scheme, _, token = got.partition(b" ")
        # compare_digest: the time taken does not reveal how much of the key matched
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
            raise HttpError("unauthorized", "Incorrect or missing API key (send Authorization: Bearer <key>)")

    def ready_generator(self) -> Generator:
        """The service, or NotReady (503) while loading or after shutdown began."""
        if self.generator is None:
            raise NotReady("the model is still loading" if self.state == "loading" else f"the server is {self.state}")
        return self.generator

    async def read_json(self, request: Request):
        """The body as JSON, within the size cap (checked on Content-Length and again while reading)."""
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise HttpError("bad_json", "invalid Content-Length")
            if int(length) > self.max_body:
                raise HttpError("too_large", f"the request body is {int(length)} bytes; the limit is {self.max_body}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise HttpError("too_large", f"the request body exceeds the limit of {self.max_body} bytes")
            chunks.append(chunk)
        return parse_json(b"".join(chunks))

    def _error_reply(self, exc: Exception, where: str) -> Response:
        status, body, headers = classify(exc)
        if status == 500:  # unexpected; a 503 (still loading, draining, engine gone) is an answer, not a fault
            log.error("internal error in %s", where, exc_info=exc)
        return Response(sse.dumps(body), status, headers=dict(headers), media_type="application/json")

    # ---- generation ---------------------------------------------------------------------------------------------
    async def generate(self, work: Generation, scope, receive, send) -> None:
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        job = _Job(self, work, lambda item: _post(loop, queue, item))
        self.jobs.add(job)
        watcher = asyncio.create_task(_watch_disconnect(receive, job))
        status, complete = 200, False
        try:
            kind, value = await queue.get()
            if kind == "error":
                reply = self._error_reply(value, work.meta.id)
                status = reply.status_code
                await reply(scope, receive, send)
            elif kind == "body":
                await Response(value, 200, media_type="application/json")(scope, receive, send)
            else:
                await send({"type": "http.response.start", "status": 200, "headers": sse.HEADERS})
                await self._pump(queue, send, job)
            complete = True
        finally:
            watcher.cancel()
            self.jobs.discard(job)
            if not complete:  # this task was cancelled (shutdown timeout): the engine must not keep working for it
                job.cancel(job.cancel_reason or "shutdown")
            self._account(job, status, time.perf_counter() - t0)

    async def _pump(self, queue: asyncio.Queue, send, job: _Job) -> None:
        """Forward the worker's SSE frames, those ready together in one write; a comment ping keeps a quiet stream
        (long prefill) alive. The ping is a timer re-armed per write, not a timeout per frame (asyncio.wait_for
        makes a task each time: a cost per streamed token)."""
        loop = asyncio.get_running_loop()
        ping = loop.call_later(PING_INTERVAL, queue.put_nowait, ("frame", sse.PING))
        try:
            end = False
            while not end:
                chunks = []
                kind, value = await queue.get()
                while True:
                    if kind == "end":
                        end = True
                        break
                    chunks.append(value)
                    if queue.empty():
                        break
                    kind, value = queue.get_nowait()
                ping.cancel()
                ping = loop.call_later(PING_INTERVAL, queue.put_nowait, ("frame", sse.PING))
                if chunks and not job.disconnected:
                    await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})
        finally:
            ping.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _account(self, job: _Job, status: int, e2e: float) -> None:
        stats = job.stream.stats if job.stream is not None else None
        if job.cancel_reason is not None and job.stream is not None and stats.finish_reason in (None, "cancelled"):
            outcome = "cancelled"
        elif status != 200 or job.error is not None:
            outcome = _outcome(job.error or job.early_error, status)
        else:
            outcome = "ok"
        self.metrics.record(job.work.endpoint, outcome, stats if job.stream is not None else None, e2e)
        if stats is not None:
            request_log.info(log_line(stats, outcome, job.work.ignored))


_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "responses"}


def _outcome(exc: BaseException | None, status: int) -> str:
    """How a request that did not finish normally is counted in /metrics."""
    if isinstance(exc, Overloaded | NotReady):
        return "rejected"
    return "invalid" if 400 <= status < 500 else "error"


class _Workers:
    """Daemon threads that run generation jobs, kept between requests: starting a thread per request cost ~2 ms of
    TTFT (Thread.start waits for the new thread, whose bootstrap contends for the GIL with the event loop). A job is
    handed to an idle thread, or to a new one when none is idle; daemon, so that a job stuck in an engine that is
    gone cannot hold up the process's exit."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        self._jobs.put(fn)
        if spawn:
            threading.Thread(target=self._loop, name="dsflash-req", daemon=True).start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except BaseException:  # a job reports its own errors; this thread must stay for the next one
                log.exception("a request's worker failed")
            with self._lock:
                self._idle += 1


_WORKERS = _Workers()


async def _on_gone(request: Request, exc: Exception) -> Response:
    """The client closed the connection before its request body arrived: nobody reads this answer."""
    return Response(b"", 400)


class _Job:
    """One generation on its worker thread: open the stream, render it, hand the result to the loop."""

    def __init__(self, app: App, work: Generation, post):
        self.app, self.work, self.post = app, work, post
        self.stream = None
        self.error: BaseException | None = None  # failed after the response started
        self.early_error: BaseException | None = None  # failed before: the response is an HTTP error
        self.cancel_reason: str | None = None  # disconnect | shutdown
        self._lock = threading.Lock()
        _WORKERS.submit(self._run)

    @property
    def running(self) -> bool:
        return self.stream is not None and self.stream.started

    @property
    def disconnected(self) -> bool:
        return self.cancel_reason == "disconnect"

    def cancel(self, reason: str) -> None:
        with self._lock:
            if self.cancel_reason is None:
                self.cancel_reason = reason
            stream = self.stream
        if stream is not None:
            stream.cancel()

    def _run(self) -> None:
        try:
            self._open()
            if self.stream is None:
                return
            deltas = self._guard(iter(self.stream))
            if self.work.stream.stream:
                self.post(("open", None))
                self._render_stream(deltas)
            else:
                self.post(("body", sse.dumps(self.work.render_full(deltas))))
        except Exception as e:
            self.early_error = e
            self.post(("error", e))

    def _open(self) -> None:
        gen = self.app.generator
        if gen is None or self.app.state != "ready":
            raise NotReady("the server is shutting down" if self.app.state == "draining" else "the model is not ready")
        gen.check_admission()
        stream = self.work.open(gen)
        with self._lock:
            self.stream = stream
            reason = self.cancel_reason
        if reason is not None:
            stream.cancel()

    def _render_stream(self, deltas: Iterator[Delta]) -> None:
        try:
            for obj in self.work.render_stream(deltas):
                self.post(("frame", self.work.frame(obj)))
        except Exception as e:  # after the first byte an error is a frame, then [DONE]
            self.error = e
            if not isinstance(e, NotReady | InvalidRequest):
                log.error("generation failed", exc_info=e)
            self.post(("frame", self.work.error_frame(e)))
        if self.work.done:
            self.post(("frame", self.work.done))
        self.post(("end", None))

    def _guard(self, deltas: Iterator[Delta]) -> Iterator[Delta]:
        """A cancelled stream never reaches a client as a normal finish: shutdown is an error (the client is told),
        a disconnect has nobody left to tell."""
        for d in deltas:
            if d.finish_reason == "cancelled":
                raise NotReady("the server is shutting down; the request was cancelled")
            yield d


async def _watch_disconnect(receive, job: _Job) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            job.cancel("disconnect")
            return


def _post(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone, nobody is waiting
        loop.call_soon_threadsafe(queue.put_nowait, item)


async def _lifespan(receive, send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def parse_json(raw: bytes):
    """Body bytes -> JSON value; anything that is not valid UTF-8 JSON (or holds lone surrogates) is a 400."""
    if not raw.strip():
        raise HttpError("bad_json", "the request body is empty; send a JSON object")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise HttpError("bad_json", f"the request body is not valid JSON: {str(e)[:200]}") from None
    if _SURROGATE.search(raw):
        _check_strings(value)
    return value


def _check_strings(value) -> None:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise HttpError("bad_json", "the request body holds an unpaired UTF-16 surrogate (\\ud8xx)") from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def log_line(s, outcome: str, ignored: list[str]) -> str:
    """One line per request: what it cost and how it ended."""
    tps = f"{s.tokens_per_s:.1f}" if s.tokens_per_s else "-"
    ttft = f"{s.ttft_s:.2f}s" if s.ttft_s is not None else "-"
    hit = f"{s.hit_rate:.2f}" if s.hit_rate is not None else "-"
    streamed = s.experts.bytes_streamed if s.experts is not None else None
    line = (
        f"req={s.request_id} prompt={s.prompt_tokens} out={s.completion_tokens} ttft={ttft} tok/s={tps} "
        f"hit={hit} streamed={_bytes(streamed)} finish={s.finish_reason or '-'} outcome={outcome}"
    )
    if not ignored:
        return line
    shown = ",".join(loggable(name) for name in ignored[:LOG_NAMES])
    more = f",+{len(ignored) - LOG_NAMES} more" if len(ignored) > LOG_NAMES else ""
    return f"{line} ignored={shown}{more}"


LOG_NAMES, LOG_NAME_CHARS = 16, 64  # of a request's ignored field names, how many reach its log line, how long


def loggable(text: str, limit: int = LOG_NAME_CHARS) -> str:
    """A client's text as it may stand in a log line: one printable ASCII line (control characters, backslashes and
    non-ASCII escaped, so a newline or a terminal escape cannot forge or colour a line), at most `limit` characters."""
    safe = text.encode("unicode_escape").decode("ascii").replace(" ", "\\x20")
    return safe if len(safe) <= limit else safe[: limit - 3] + "..."


def _bytes(n: int | None) -> str:
    if n is None:
        return "0B"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n}"
