"""`vllm bench serve` against any OpenAI-compatible server: its random dataset, its timing and metric definitions,
its console block and JSON keys; presets for the reference box's four workloads; a PNG of per-token latency next to
the JSON. `run(BenchOptions)` is the whole benchmark; `dsflash bench` parses the flags into those options."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from dsflash.bench import client, metrics, report
from dsflash.bench.client import BenchError, get_json
from dsflash.bench.datasets import PRESETS, TokenCounter, random_requests
from dsflash.bench.options import ENDPOINTS, BenchOptions
from dsflash.counters import ExpertCounters
from dsflash.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Plan:
    """Lengths, prompts, concurrency and endpoint after the preset and --scale; the preset's JSON metadata."""

    input_len: int
    output_len: int
    num_prompts: int
    max_concurrency: int | None
    path: str
    backend: str  # openai | openai-chat
    profile: str | None  # the serving profile whose context holds the preset
    metadata: dict
    metrics: tuple[str, ...]  # the metrics with statistics
    percentiles: tuple[float, ...]
    turns: int = 1  # > 1: num_prompts conversations of this many turns, one request at a time
    turn_len: int = 0


@dataclass(frozen=True)
class Target:
    """The server under test: where, with which headers, which model and its context (when it says)."""

    base: str
    headers: dict
    model: str
    max_len: int | None


def run(opts: BenchOptions) -> int:
    """The benchmark: 0 when every request succeeded, 1 otherwise; BenchError when it cannot run."""
    plan = make_plan(opts)
    target = _target(opts, plan)
    tok, tokenizer_id = _tokenizer(opts.tokenizer)
    counter = TokenCounter(tok)
    print(f"dsflash bench: {plan.num_prompts} prompts of {plan.input_len} tokens -> {plan.output_len} "
          f"tokens against {target.base}{plan.path} ({target.model})", file=sys.stderr)  # fmt: skip
    reqs = random_requests(counter, plan.num_prompts, plan.input_len, plan.output_len,
                           opts.random_range_ratio, opts.random_prefix_len, opts.seed)  # fmt: skip
    reqs = _align(target, reqs, counter)
    ep = client.Endpoint(target.base, plan.path, target.model, target.headers)
    extra = _extra_body(opts)

    def job(r, rid=None):
        body = client.payload(ep, r.prompt, r.expected_output_len, True, extra)
        return lambda: client.send(ep, body, r.prompt_len, rid)

    _warm_up(opts, lambda: job(replace(reqs[0], prompt="warm-up " + reqs[0].prompt)))  # shares no prefix
    experts0, spec0 = _experts(target), _speculation(target)
    t0 = time.perf_counter()
    if plan.turns > 1:
        outputs, turn_of = _conversations(opts, plan, ep, extra, reqs, counter)
    else:
        arrivals = client.arrival_times(len(reqs), opts.request_rate, opts.burstiness, opts.seed)
        jobs = [job(r, i) for r, i in zip(reqs, client.request_ids(len(reqs)))]
        outputs, turn_of = client.Dispatcher(plan.max_concurrency).run(jobs, arrivals), None
    duration = time.perf_counter() - t0
    experts1, spec1 = _experts(target), _speculation(target)
    failed = [o for o in outputs if not o.success]
    for i, o in enumerate(failed[:10]):
        print(f"Error {i}: {o.error.strip()}", file=sys.stderr)
    result = metrics.calculate(outputs, duration, list(plan.percentiles), lambda s: len(counter.encode(s)))
    if experts0 is not None and experts1 is not None:  # a dsflash server: what the timed requests streamed
        result["experts"] = (experts1 - experts0).to_json()
    if spec0 and spec1:  # a dsflash server with --speculative: what the timed requests drafted and kept
        d = {k: spec1[k] - spec0.get(k, 0) for k in spec1}
        result["speculative"] = {
            "drafts_proposed": int(d.get("spec_draft_tokens", 0)),
            "drafts_accepted": int(d.get("spec_accepted_tokens", 0)),
            "drafts_cut": int(d.get("spec_cut_tokens", 0)),
            "verifies": int(d.get("spec_verifies", 0)),
            "mean_accepted_per_verify": d["spec_accepted_tokens"] / d["spec_verifies"]
            if d.get("spec_verifies")
            else 0.0,
            "guard_off_steps": int(d.get("spec_guard_off_steps", 0)),
            "guard_off_s": d.get("spec_guard_off_s", 0.0),
        }
    if turn_of is not None:
        result.update(metrics.by_turn(outputs, turn_of))
    print(report.console(result, plan.max_concurrency, opts.request_rate, list(plan.metrics), list(plan.percentiles)))
    if opts.save_result is not None or opts.result_filename or opts.result_dir:
        _save(opts, plan, target, tokenizer_id, result)
    return 0 if not failed else 1


def make_plan(opts: BenchOptions) -> Plan:
    """What will be sent, from the options and the workload preset; bad options fail here, before any request."""
    if opts.scale <= 0:
        raise BenchError("--scale must be positive")
    meta, profile = {}, None
    input_len, output_len, prompts, conc = 1024, 128, 1000, opts.max_concurrency
    turns, turn_len = 1, 0
    if opts.workload:
        pre = PRESETS[opts.workload]
        input_len, output_len = pre.scaled(opts.scale)
        prompts, conc, profile = pre.num_prompts, conc or 1, pre.profile
        turns, turn_len = pre.turns, max(1, round(pre.turn_len * opts.scale)) if pre.turn_len else 0
        meta = {"workload": opts.workload, "profile": pre.profile, "scale": opts.scale}
    elif opts.scale != 1.0:
        meta = {"scale": opts.scale}
    if opts.random_input_len is not None:
        input_len = max(1, round(opts.random_input_len * opts.scale))
    if opts.random_output_len is not None:
        output_len = max(1, round(opts.random_output_len * opts.scale))
    if opts.num_prompts is not None:
        prompts = opts.num_prompts
    if prompts < 1:
        raise BenchError("--num-prompts must be at least 1")
    turns = opts.turns if opts.turns is not None else turns
    turn_len = opts.turn_len if opts.turn_len is not None else (turn_len or 64)
    if turns < 1 or turn_len < 1:
        raise BenchError("--turns and --turn-len must be at least 1")
    if turns > 1:
        meta = {**meta, "turns": turns, "turn_len": turn_len}
    if conc is not None and conc <= 0:
        raise BenchError("--max-concurrency must be greater than 0")
    path = ENDPOINTS.get(opts.endpoint, opts.endpoint)
    if not path.startswith("/"):
        raise BenchError(f"--endpoint: expected completions, chat or a path, got {opts.endpoint!r}")
    if opts.backend == "openai-chat" and opts.endpoint == "completions":
        path = ENDPOINTS["chat"]
    backend = "openai-chat" if path.rstrip("/").endswith("chat/completions") else "openai"
    chosen = tuple(m.strip() for m in opts.percentile_metrics.split(",") if m.strip())
    if unknown := [m for m in chosen if m not in metrics.METRICS]:
        raise BenchError(f"--percentile-metrics: unknown {unknown} (known: {', '.join(metrics.METRICS)})")
    percentiles = tuple(float(p) for p in opts.metric_percentiles.split(","))
    if turns > 1 and backend != "openai":
        raise BenchError("a multi-turn run resends the conversation as text: use the completions endpoint")
    return Plan(input_len, output_len, prompts, conc, path, backend, profile, meta, chosen, percentiles, turns,
                turn_len)  # fmt: skip


def _target(opts: BenchOptions, plan: Plan) -> Target:
    """The server, its model and its context; a plan that the context cannot hold fails here."""
    base = (opts.base_url or f"http://{opts.host}:{opts.port}").rstrip("/")
    headers = client.api_headers()
    if opts.model is None:
        model, _, max_len = client.first_model(base, headers)
    else:
        model, max_len = opts.model, _served_len(base, headers, opts.model)
    need = plan.input_len + plan.output_len + (plan.turns - 1) * (plan.turn_len + plan.output_len)
    if max_len and need > max_len:
        hint = f"; serve the {plan.profile} profile" if plan.profile else ""
        raise BenchError(f"prompt {plan.input_len} + output {plan.output_len} tokens exceed the server's "
                         f"{max_len}-token context{hint} (or pass --scale)")  # fmt: skip
    return Target(base, headers, model, max_len)


def _conversations(opts: BenchOptions, plan: Plan, ep, extra: dict, reqs: list, counter: TokenCounter):
    """Each conversation's turns in order, one request at a time: a turn's prompt is the previous prompt, its
    reply and turn_len new random tokens (an agent resending its history). -> (outputs, turn index of each)."""
    more = random_requests(counter, len(reqs) * (plan.turns - 1), plan.turn_len + 1, 1, seed=opts.seed + 1)
    appended = iter(m.prompt for m in more)
    outputs, turn_of, ids = [], [], iter(client.request_ids(len(reqs) * plan.turns))
    for r in reqs:
        prompt = r.prompt
        for turn in range(plan.turns):
            body = client.payload(ep, prompt, r.expected_output_len, True, extra)
            out = client.send(ep, body, len(counter.encode(prompt)), next(ids))
            outputs.append(out)
            turn_of.append(turn)
            if not out.success:
                break
            if turn + 1 < plan.turns:
                prompt = prompt + out.generated_text + next(appended)
    return outputs, turn_of


def _tokenizer(directory: str | None):
    if directory is None:
        return Tokenizer.bundled("v41"), "deepseek-v4.1 (bundled)"
    if not (Path(directory) / "tokenizer.json").is_file():
        raise BenchError(f"--tokenizer {directory}: no tokenizer.json there")
    return Tokenizer.from_dir(directory), directory


def _served_len(base: str, headers: dict, model: str) -> int | None:
    try:
        for card in get_json(base, "/v1/models", headers).get("data") or []:
            if card.get("id") == model:
                return card.get("max_model_len")
    except BenchError:
        pass
    return None


def _align(target: Target, reqs: list, counter: TokenCounter) -> list:
    """vLLM's re-alignment: when the server's /tokenize counts the first prompt differently, cut every prompt to
    its target length by the server's tokenizer (/tokenize + /detokenize). A server without /tokenize is fine."""
    base, headers, model = target.base, target.headers, target.model

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


def _extra_body(opts: BenchOptions) -> dict:
    extra = {k: v for k, v in (("temperature", opts.temperature), ("top_p", opts.top_p), ("top_k", opts.top_k))
             if v is not None}  # fmt: skip
    if opts.extra_body:
        try:
            more = json.loads(opts.extra_body)
        except ValueError as e:
            raise BenchError(f"--extra-body is not JSON: {e}") from None
        if not isinstance(more, dict):
            raise BenchError("--extra-body must be a JSON object")
        extra.update(more)
    return extra


def _warm_up(opts: BenchOptions, first) -> None:
    """The ready check (the first prompt, untimed, until the server answers it) and the warm-up requests."""
    if opts.ready_check_timeout_sec > 0:
        print("Starting initial single prompt test run...", file=sys.stderr)
        out = _ready_check(first(), opts.ready_check_timeout_sec)
        if not out.success:
            raise BenchError(f"the initial test request failed: {out.error.strip().splitlines()[-1:]}")
    for _ in range(opts.num_warmups):
        first()()


def _ready_check(job, timeout_s: int):
    """Send the first prompt until it succeeds or `timeout_s` passes (vLLM's wait_for_endpoint); an HTTP error
    other than 503 (still loading) is final."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = job()
        if out.success or out.status not in (0, 503) or time.monotonic() >= deadline:
            return out
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))


def _experts(target: Target) -> ExpertCounters | None:
    """The server's expert counters from its /metrics, None where it has none (another engine)."""
    text = client.get_text(target.base, "/metrics", target.headers)
    return ExpertCounters.from_prometheus(text) if text is not None else None


def _speculation(target: Target) -> dict[str, float]:
    """The server's speculative-decoding counters (dsflash:spec_* on /metrics), {} where it has none."""
    text = client.get_text(target.base, "/metrics", target.headers) or ""
    out = {}
    for line in text.splitlines():
        if line.startswith("dsflash:spec_"):
            name, _, value = line.partition(" ")
            out[name.split("{", 1)[0].removeprefix("dsflash:")] = float(value.rsplit(" ", 1)[-1])
    return out


def _save(opts: BenchOptions, plan: Plan, target: Target, tokenizer_id: str, result: dict) -> None:
    """The JSON (vLLM's keys) and, unless --no-plot, the PNG of per-token latency next to it."""
    now = datetime.now()
    setup = {
        "date": now.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": plan.backend,
        "backend": plan.backend,
        "label": opts.label,
        "model_id": target.model,
        "tokenizer_id": tokenizer_id,
        "num_prompts": plan.num_prompts,
        **plan.metadata,
        **_metadata(opts.metadata),
        "request_rate": opts.request_rate if opts.request_rate < float("inf") else "inf",
        "burstiness": opts.burstiness,
        "max_concurrency": plan.max_concurrency,
    }
    data = report.result_json(setup, result, list(plan.metrics), list(plan.percentiles), opts.save_detailed)
    name = opts.save_result if isinstance(opts.save_result, str) else opts.result_filename
    label = opts.label or plan.backend
    name = name or report.default_filename(label, opts.request_rate, plan.max_concurrency, target.model, now)
    path = Path(opts.result_dir) / name if opts.result_dir else Path(name)
    report.save(path, data)
    print(f"wrote {path}", file=sys.stderr)
    if not opts.no_plot and result["completed"]:
        title = f"{target.model} · {plan.input_len} → {plan.output_len} tokens · {target.base}{plan.path}"
        if plan.turns > 1:
            title += f" · {plan.turns} turns of +{plan.turn_len}"
        png = report.plot(path.with_suffix(".png"), result, title)
        print(f"wrote {png}", file=sys.stderr)


def _metadata(items) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise BenchError(f"--metadata {item!r}: use KEY=VALUE")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out
