"""`dsflash serve [MODEL]`: boot a model phase by phase and serve the OpenAI-compatible API until stopped."""

from __future__ import annotations

import argparse
import os
import sys
import time

from dsflash.cli._engine import add_engine_arguments
from dsflash.service.api import MAX_TOKENS_DEFAULT

DEFAULT_PORT = 20000
API_KEY_ENV = "DSFLASH_API_KEY"


def add_parser(sub) -> None:
    from dsflash.cli._terminal import HelpFormatter

    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Boot MODEL (resolve, check, load, warm up) and serve /v1/models, /v1/completions, "
        "/v1/chat/completions, /v1/responses, /tokenize, /detokenize, /health and /metrics. Without MODEL: the "
        "demo model trained here and shipped in the package (dsflash-demo-v4.1).",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="bundle name (see `dsflash profiles`), Hub repo id[@revision] or model directory "
        "(default: the packaged dsflash-demo-v4.1; dsflash-tiny-v4.1 is the random one, generated on first boot)",
    )
    p.add_argument("--profile", default=None, help="bundle profile (default: the bundle's first profile)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port; a busy one walks up to the next free one")
    add_engine_arguments(p, serving=True)
    p.add_argument(
        "--backend",
        choices=["engine", "reference"],
        default="engine",
        help="what computes tokens: the engine (experts streamed from the store into --expert-slots slots per rank "
        "over --tp ranks), or the fp32 CPU reference with every expert resident (quality baseline)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 and /tokenize routes (default: ${API_KEY_ENV} or none)",
    )
    p.add_argument(
        "--allowed-origins",
        default=None,
        metavar="ORIGINS",
        help="CORS: comma-separated origins a browser page may call from (e.g. http://localhost:3000), or '*' "
        "(default: none; browsers' cross-origin requests are refused)",
    )
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get 429 + Retry-After")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the profile's)")
    p.add_argument(
        "--allow-long-context",
        action="store_true",
        help="accept a --max-model-len beyond the model's max_position_embeddings (as vLLM's "
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN; positions past what it was trained on may give garbage)",
    )
    p.add_argument(
        "--max-tokens-default",
        type=int,
        default=MAX_TOKENS_DEFAULT,
        help="new tokens a request that names no max_tokens may generate at most (never more than the context leaves)",
    )
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="the most new tokens any request may ask for; more is a 400 (default: what the context leaves)",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="server-wide chat_template_kwargs, e.g. '{\"thinking\": false}' (requests override them; default: "
        "none, the model's template defaults)",
    )
    p.add_argument(
        "--shutdown-grace", type=float, default=5.0, help="seconds a running request may finish after SIGTERM"
    )
    p.add_argument("--detach", action="store_true", help="boot in the background, print the ready card, return")
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_log", default=None, help=argparse.SUPPRESS)
    # a detached server gets its key in the environment, never in its argv (ps shows argv): this says it was a flag
    p.add_argument("--_key_was_flag", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=run)


def run(args) -> int:
    from dsflash.service.catalog import choose

    choice = choose(args.model, args.profile)  # bad names fail here, before anything starts
    defaults = _chat_defaults(args.default_chat_template_kwargs)
    opts = boot_options(args)  # so do bad flags
    if args.detach and not args._child:
        from dsflash.cli._detach import detach

        return detach(args, choice)
    return _Serve(args, choice, defaults, opts).run()


def boot_options(args):
    """What the serve flags ask the boot for."""
    from dsflash.cli._engine import engine_spec
    from dsflash.service.boot import BootOptions

    return BootOptions(
        engine_spec(args),
        args.backend,
        max_queue=args.max_queue,
        max_model_len=args.max_model_len,
        allow_long_context=args.allow_long_context,
        max_tokens_default=args.max_tokens_default,
        max_tokens_limit=args.max_tokens_limit,
    )


def _chat_defaults(text: str | None):
    import json

    from dsflash.errors import ConfigError, InvalidRequest
    from dsflash.text.chat import chat_options

    if not text:
        return chat_options()
    try:
        kwargs = json.loads(text)
        return chat_options(kwargs)
    except (ValueError, InvalidRequest) as e:
        raise ConfigError(f"--default-chat-template-kwargs: {e}") from None


class _Serve:
    """The terminal side of one server process (server.serving.Serving is the process): the console, its log file,
    the boot's rows, the ready card."""

    def __init__(self, args, choice, chat_defaults, opts):
        from dsflash.server.serving import Serving

        self.args, self.choice = args, choice
        self.t0 = time.perf_counter()
        self.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
        self.key_source = "--api-key" if args.api_key or args._key_was_flag else API_KEY_ENV
        # a flag the backend cannot honour fails before anything starts; then the port is bound
        origins = tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip())
        self.serving = Serving(
            choice,
            opts,
            args.host,
            args.port,
            self.api_key,
            args.shutdown_grace,
            chat_defaults,
            allowed_origins=origins,
        )

    def run(self) -> int:
        from dsflash.cli._terminal import Console, row
        from dsflash.server.registry import new_log_path

        args, choice, port = self.args, self.choice, self.serving.port
        log_path = args._log or new_log_path(choice.slug, port)
        # a detached child's stdout is its log file already
        self.console = Console(to_stdout=True, log_path=None if args._child else log_path)
        _setup_logging(self.console)
        context = self.serving.max_len
        self.console.line(
            f"dsflash serve · {choice.model_id} · profile {choice.profile.name} · {context:,}-token context"
        )
        if port != args.port:
            self.console.line(row("done", "port", f"{args.port} is busy; using {port}"))
        try:
            code = self.serving.run(str(log_path), self._report, self._ready, self._failed)
            if code == 0:
                self.console.line(f"dsflash serve: stopped {choice.model_id} on port {port}")
            return code
        finally:
            self.console.close()

    def _report(self, r) -> None:
        from dsflash.cli._terminal import row

        if r.state == "run":
            self.console.transient(row("run", r.label, "…"))
        else:
            self.console.line(row(r.state, r.label, r.detail, r.seconds))

    def _failed(self, e: BaseException) -> None:
        self.console.line(f"dsflash serve: error: {e}", sys.stderr)

    def _ready(self, booted, health: str, seconds: float) -> None:
        import json

        from dsflash.cli._terminal import row

        self.console.line(row("done" if health == "ready" else "fail", "API", f"GET /health: {health}", seconds))
        record = self.serving.record
        base = record.base_url
        model = self.choice.model_id
        ready = time.perf_counter() - self.t0
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64})
        # by port: `stop MODEL` refuses and `logs MODEL` cannot tell servers apart once a second one runs
        port = record.port
        stop = f"dsflash stop {port}" + ("" if self.args._child else "   (or Ctrl-C)")
        lines = [
            "",
            f"  Ready in {ready:.1f}s · {model} · profile {self.choice.profile.name} · "
            f"context {booted.max_len:,} tokens · backend {booted.backend.name}",
            f"  endpoint  {base}/v1",
            f"  limits    max_tokens {_limits(booted)}",
            f"  try       curl {base}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'",
            f"  logs      dsflash logs {port} --follow   ({record.log})",
            f"  stop      {stop}",
            "",
        ]
        if self.api_key is not None:
            # a key given as a flag is not in the environment: the card names where it comes from, never the key
            bearer = "$" + API_KEY_ENV if self.key_source == API_KEY_ENV else "<the key given with --api-key>"
            lines = [x.replace("curl ", f'curl -H "Authorization: Bearer {bearer}" ', 1) for x in lines]
        for line in lines:
            self.console.line(line)


def _limits(booted) -> str:
    o = booted.opts
    most = f"at most {o.max_tokens_limit:,}" if o.max_tokens_limit else "at most what the context leaves"
    return f"{o.max_tokens_default:,} where a request names none (--max-tokens-default), {most} (--max-tokens-limit)"


def _setup_logging(console) -> None:
    import logging

    class _ToConsole(logging.Handler):
        def emit(self, record):
            try:
                text = f"{time.strftime('%H:%M:%S')} {record.getMessage()}"
                if record.exc_info:
                    text += "\n" + logging.Formatter().formatException(record.exc_info)
                console.line(text)
            except Exception:  # a log line must never take a request down
                pass

    handler = _ToConsole()
    for name in ("dsflash.requests", "dsflash.server", "dsflash.runtime.scheduler.engine"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(logging.INFO)
        lg.propagate = False
    if sys.stderr is not None:
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
