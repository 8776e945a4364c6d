"""`dsflash bench`: `vllm bench serve` against any OpenAI-compatible server: its random dataset, its timing and
metric definitions, its console block and JSON keys; presets for the reference box's four workloads; a PNG of
per-token latency next to the JSON."""

from __future__ import annotations

DEFAULT_BASE_URL = "http://127.0.0.1:20000"
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def add_parser(sub) -> None:
    from dsflash.cli._serving import HelpFormatter

    p = sub.add_parser(
        "bench",
        help="benchmark a serving endpoint like `vllm bench serve` (TTFT, TPOT, ITL, E2EL, throughput)",
        description="Send random-token prompts to an OpenAI-compatible server (ours, vLLM, anything) and report "
        "`vllm bench serve`'s metrics with its definitions and JSON keys. Decode tok/s = 1000 / mean TPOT.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--base-url", default=None, help=f"server root, e.g. {DEFAULT_BASE_URL} (default: --host/--port)")
    p.add_argument("--host", default="127.0.0.1", help="server host when --base-url is not given")
    p.add_argument("--port", type=int, default=20000, help="server port when --base-url is not given")
    p.add_argument(
        "--endpoint",
        default="completions",
        help="completions | chat, or a path such as /v1/chat/completions",
    )
    p.add_argument("--backend", choices=["openai", "openai-chat"], default=None,
                   help="vLLM's name for the endpoint kind (default: from --endpoint)")  # fmt: skip
    p.add_argument("--model", default=None, help="model id to send (default: the first of GET /v1/models)")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="tokenizer directory (tokenizer.json) for the dataset and token counts (default: the bundled "
        "DeepSeek V4.1 tokenizer)",
    )
    p.add_argument("--dataset-name", choices=["random"], default="random", help="the prompt dataset")
    p.add_argument("--workload", choices=["chat", "codegen", "agent", "long"], default=None,
                   help="the reference box's workloads: sets input/output lengths (128/256, 1024/1024, 8192/512, "
                   "32768/256), --max-concurrency 1 and 3 prompts unless given")  # fmt: skip
    p.add_argument("--scale", type=float, default=1.0, help="multiply the lengths by this (small machines)")
    p.add_argument("--random-input-len", "--input-len", type=int, default=None, help="prompt tokens (default 1024)")
    p.add_argument("--random-output-len", "--output-len", type=int, default=None,
                   help="generated tokens (default 128)")  # fmt: skip
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths vary in [len*(1-r), len*(1+r)]")
    p.add_argument("--random-prefix-len", type=int, default=0, help="random prefix tokens shared by all prompts")
    p.add_argument("--num-prompts", type=int, default=None, help="requests to send (default 1000; 3 with --workload)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (always on for the random dataset, as in vLLM)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset and the arrival times")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    p.add_argument("--temperature", type=float, default=None, help="sent when given (default: the server's)")
    p.add_argument("--top-p", type=float, default=None, help="sent when given")
    p.add_argument("--top-k", type=int, default=None, help="sent when given")
    p.add_argument("--extra-body", default=None, metavar="JSON", help="merged into every request body")
    p.add_argument("--num-warmups", type=int, default=0, help="untimed requests before the run")
    p.add_argument("--ready-check-timeout-sec", type=int, default=600,
                   help="send the first prompt once, untimed, and wait this long for it (0: skip)")  # fmt: skip
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="metrics with stats")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles")
    p.add_argument("--save-result", nargs="?", const=True, default=None, metavar="FILE",
                   help="write the JSON (to FILE, or vLLM's default name) and the PNG next to it")  # fmt: skip
    p.add_argument("--result-dir", default=None, help="directory of the JSON")
    p.add_argument("--result-filename", default=None, help="file name of the JSON")
    p.add_argument("--save-detailed", action="store_true", help="keep per-request arrays in the JSON")
    p.add_argument("--label", default=None, help="label in the JSON and the file name (default: the backend)")
    p.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="extra JSON keys")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.set_defaults(run=run)


def run(args) -> int:
    import sys
    import time
    from datetime import datetime
    from pathlib import Path

    from dsflash.bench import client, metrics, report
    from dsflash.bench.client import BenchError

    plan = _plan(args)
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = client.api_headers()
    model_id, root, max_len = client.first_model(base, headers) if args.model is None else (args.model, None, None)
    if max_len is None and args.model is not None:
        max_len = _served_len(base, headers, args.model)
    need = plan["input_len"] + plan["output_len"]
    if max_len and need > max_len:
        hint = f"; serve the {plan['profile']} profile" if plan.get("profile") else ""
        raise BenchError(f"prompt {plan['input_len']} + output {plan['output_len']} tokens exceed the server's "
                         f"{max_len}-token context{hint} (or pass --scale)")  # fmt: skip
    tok, tokenizer_id = _tokenizer(args.tokenizer)
    counter = _counter(tok)
    from dsflash.bench.datasets import random_requests

    print(f"dsflash bench: {plan['num_prompts']} prompts of {plan['input_len']} tokens -> {plan['output_len']} "
          f"tokens against {base}{plan['path']} ({model_id})", file=sys.stderr)  # fmt: skip
    reqs = random_requests(counter, plan["num_prompts"], plan["input_len"], plan["output_len"],
                           args.random_range_ratio, args.random_prefix_len, args.seed)  # fmt: skip
    reqs = _align(base, headers, model_id, reqs, counter)
    ep = client.Endpoint(base, plan["path"], model_id, headers)
    extra = _extra_body(args)
    ids = client.request_ids(len(reqs))

    def job(r, rid=None):
        body = client.payload(ep, r.prompt, r.expected_output_len, True, extra)
        return lambda: client.send(ep, body, r.prompt_len, rid)

    if args.ready_check_timeout_sec > 0:
        print("Starting initial single prompt test run...", file=sys.stderr)
        first = _ready_check(job(reqs[0]), args.ready_check_timeout_sec)
        if not first.success:
            raise BenchError(f"the initial test request failed: {first.error.strip().splitlines()[-1:]}")
    for _ in range(args.num_warmups):
        job(reqs[0])()
    arrivals = client.arrival_times(len(reqs), args.request_rate, args.burstiness, args.seed)
    t0 = time.perf_counter()
    outputs = client.Dispatcher(plan["max_concurrency"]).run([job(r, i) for r, i in zip(reqs, ids)], arrivals)
    duration = time.perf_counter() - t0
    failed = [o for o in outputs if not o.success]
    for i, o in enumerate(failed[:10]):
        print(f"Error {i}: {o.error.strip()}", file=sys.stderr)
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    chosen = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if unknown := [m for m in chosen if m not in metrics.METRICS]:
        raise BenchError(f"--percentile-metrics: unknown {unknown} (known: {', '.join(metrics.METRICS)})")
    result = metrics.calculate(outputs, duration, percentiles, lambda s: len(counter.encode(s)))
    print(report.console(result, plan["max_concurrency"], args.request_rate, chosen, percentiles))
    if args.save_result is None and not args.result_filename and not args.result_dir:
        return 0 if not failed else 1
    now = datetime.now()
    label = args.label or plan["backend"]
    setup = {
        "date": now.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": plan["backend"],
        "backend": plan["backend"],
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": plan["num_prompts"],
        **plan["metadata"],
        **_metadata(args.metadata),
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": plan["max_concurrency"],
    }
    data = report.result_json(setup, result, chosen, percentiles, args.save_detailed)
    name = args.save_result if isinstance(args.save_result, str) else args.result_filename
    name = name or report.default_filename(label, args.request_rate, plan["max_concurrency"], model_id, now)
    path = Path(args.result_dir) / name if args.result_dir else Path(name)
    report.save(path, data)
    print(f"wrote {path}", file=sys.stderr)
    if not args.no_plot and result["completed"]:
        title = f"{model_id} · {plan['input_len']} → {plan['output_len']} tokens · {base}{plan['path']}"
        png = report.plot(path.with_suffix(".png"), result, title)
        print(f"wrote {png}", file=sys.stderr)
    return 0 if not failed else 1


def _plan(args) -> dict:
    """Lengths, prompts, concurrency and endpoint after the preset and --scale; the preset's JSON metadata."""
    from dsflash.bench.client import BenchError
    from dsflash.bench.datasets import PRESETS

    if args.scale <= 0:
        raise BenchError("--scale must be positive")
    meta, profile = {}, None
    input_len, output_len, prompts, conc = 1024, 128, 1000, args.max_concurrency
    if args.workload:
        pre = PRESETS[args.workload]
        input_len, output_len = pre.scaled(args.scale)
        prompts, conc, profile = pre.num_prompts, conc or 1, pre.profile
        meta = {"workload": args.workload, "profile": pre.profile, "scale": args.scale}
    elif args.scale != 1.0:
        meta = {"scale": args.scale}
    if args.random_input_len is not None:
        input_len = max(1, round(args.random_input_len * args.scale))
    if args.random_output_len is not None:
        output_len = max(1, round(args.random_output_len * args.scale))
    if args.num_prompts is not None:
        prompts = args.num_prompts
    if prompts < 1:
        raise BenchError("--num-prompts must be at least 1")
    if conc is not None and conc <= 0:
        raise BenchError("--max-concurrency must be greater than 0")
    path = ENDPOINTS.get(args.endpoint, args.endpoint)
    if not path.startswith("/"):
        raise BenchError(f"--endpoint: expected completions, chat or a path, got {args.endpoint!r}")
    if args.backend == "openai-chat" and args.endpoint == "completions":
        path = ENDPOINTS["chat"]
    backend = "openai-chat" if path.rstrip("/").endswith("chat/completions") else "openai"
    return {"input_len": input_len, "output_len": output_len, "num_prompts": prompts, "max_concurrency": conc,
            "path": path, "backend": backend, "profile": profile, "metadata": meta}  # fmt: skip


def _tokenizer(directory: str | None):
    from pathlib import Path

    from dsflash.bench.client import BenchError
    from dsflash.text.tokenizer import Tokenizer

    if directory is None:
        return Tokenizer.bundled("v41"), "deepseek-v4.1 (bundled)"
    if not (Path(directory) / "tokenizer.json").is_file():
        raise BenchError(f"--tokenizer {directory}: no tokenizer.json there")
    return Tokenizer.from_dir(directory), directory


def _counter(tok):
    from dsflash.bench.datasets import TokenCounter

    return TokenCounter(tok)


def _served_len(base: str, headers: dict, model: str) -> int | None:
    from dsflash.bench.client import BenchError, get_json

    try:
        for card in get_json(base, "/v1/models", headers).get("data") or []:
            if card.get("id") == model:
                return card.get("max_model_len")
    except BenchError:
        pass
    return None


def _align(base: str, headers: dict, model: str, reqs: list, counter) -> list:
    """vLLM's re-alignment: when the server's /tokenize counts the first prompt differently, cut every prompt to
    its target length by the server's tokenizer (/tokenize + /detokenize). A server without /tokenize is fine."""
    import sys
    from dataclasses import replace

    from dsflash.bench.client import BenchError, get_json

    def tokens(prompt):
        return get_json(base, "/tokenize", headers, {"model": model, "prompt": prompt, "add_special_tokens": False})[
            "tokens"
        ]

    try:
        first = tokens(reqs[0].prompt)
    except (BenchError, KeyError):
        print("WARNING: /tokenize unavailable, skipping alignment.", file=sys.stderr)
        return reqs
    if len(first) == reqs[0].prompt_len:
        return reqs
    print(f"WARNING: tokenizer mismatch (server={len(first)}, expected={reqs[0].prompt_len}), re-aligning prompts.",
          file=sys.stderr)  # fmt: skip
    out = []
    for r in reqs:
        try:
            ids = tokens(r.prompt)
            if len(ids) > r.prompt_len:
                text = get_json(base, "/detokenize", headers, {"model": model, "tokens": ids[: r.prompt_len]})
                r = replace(r, prompt=text["prompt"])
        except (BenchError, KeyError):
            pass
        out.append(r)
    return out


def _extra_body(args) -> dict:
    import json

    from dsflash.bench.client import BenchError

    extra = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k))
             if v is not None}  # fmt: skip
    if args.extra_body:
        try:
            more = json.loads(args.extra_body)
        except ValueError as e:
            raise BenchError(f"--extra-body is not JSON: {e}") from None
        if not isinstance(more, dict):
            raise BenchError("--extra-body must be a JSON object")
        extra.update(more)
    return extra


def _metadata(items: list[str] | None) -> dict:
    from dsflash.bench.client import BenchError

    out = {}
    for item in items or []:
        if "=" not in item:
            raise BenchError(f"--metadata {item!r}: use KEY=VALUE")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _ready_check(job, timeout_s: int):
    """Send the first prompt until it succeeds or `timeout_s` passes (vLLM's wait_for_endpoint); an HTTP error
    other than 503 (still loading) is final."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        out = job()
        if out.success or out.status not in (0, 503) or time.monotonic() >= deadline:
            return out
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
