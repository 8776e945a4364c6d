"""`dsflash bench`: `vllm bench serve` against any OpenAI-compatible server (the benchmark is dsflash.bench.run;
this module parses its flags)."""

from __future__ import annotations


def add_parser(sub) -> None:
    from dsflash.bench.options import DEFAULT_BASE_URL, BenchOptions
    from dsflash.cli._terminal import HelpFormatter

    d = BenchOptions()  # the defaults

    p = sub.add_parser(
        "bench",
        help="benchmark a serving endpoint like `vllm bench serve` (TTFT, TPOT, ITL, E2EL, throughput)",
        description="Send random-token prompts to an OpenAI-compatible server (ours, vLLM, anything) and report "
        "`vllm bench serve`'s metrics with its definitions and JSON keys. Decode tok/s = 1000 / mean TPOT.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--base-url", default=None, help=f"server root, e.g. {DEFAULT_BASE_URL} (default: --host/--port)")
    p.add_argument("--host", default=d.host, help="server host when --base-url is not given")
    p.add_argument("--port", type=int, default=d.port, help="server port when --base-url is not given")
    p.add_argument(
        "--endpoint",
        default=d.endpoint,
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
    p.add_argument("--dataset-name", choices=["random"], default=d.dataset_name, help="the prompt dataset")
    p.add_argument("--workload", choices=["chat", "codegen", "agent", "long", "multi-turn"], default=None,
                   help="the reference box's workloads: sets input/output lengths (128/256, 1024/1024, 8192/512, "
                   "32768/256), --max-concurrency 1 and 3 prompts unless given; multi-turn: 2 conversations of 4 "
                   "turns, 4096 tokens then +64 a turn, each resending the conversation (TTFT by turn in the JSON "
                   "and the PNG)")  # fmt: skip
    p.add_argument("--turns", type=int, default=None,
                   help="turns per conversation: each later turn resends prompt + reply + --turn-len new tokens "
                   "(default: the workload's, else 1)")  # fmt: skip
    p.add_argument("--turn-len", type=int, default=None, help="new prompt tokens each later turn appends (default 64)")
    p.add_argument("--scale", type=float, default=d.scale, help="multiply the lengths by this (small machines)")
    p.add_argument("--random-input-len", "--input-len", type=int, default=None, help="prompt tokens (default 1024)")
    p.add_argument("--random-output-len", "--output-len", type=int, default=None,
                   help="generated tokens (default 128)")  # fmt: skip
    p.add_argument(
        "--random-range-ratio", type=float, default=d.random_range_ratio, help="lengths vary in [len*(1-r), len*(1+r)]"
    )
    p.add_argument(
        "--random-prefix-len", type=int, default=d.random_prefix_len, help="random prefix tokens shared by all prompts"
    )
    p.add_argument("--num-prompts", type=int, default=None, help="requests to send (default 1000; 3 with --workload)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (always on for the random dataset, as in vLLM)")  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the dataset and the arrival times")
    p.add_argument("--request-rate", type=float, default=d.request_rate, help="requests/s (inf: all at once)")
    p.add_argument(
        "--burstiness", type=float, default=d.burstiness, help="gamma shape of the arrival gaps (1 = Poisson)"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    p.add_argument("--temperature", type=float, default=None, help="sent when given (default: the server's)")
    p.add_argument("--top-p", type=float, default=None, help="sent when given")
    p.add_argument("--top-k", type=int, default=None, help="sent when given")
    p.add_argument("--extra-body", default=None, metavar="JSON", help="merged into every request body")
    p.add_argument("--num-warmups", type=int, default=d.num_warmups, help="untimed requests before the run")
    p.add_argument("--ready-check-timeout-sec", type=int, default=d.ready_check_timeout_sec,
                   help="send the first prompt once, untimed, and wait this long for it (0: skip)")  # fmt: skip
    p.add_argument("--percentile-metrics", default=d.percentile_metrics, help="metrics with stats")
    p.add_argument("--metric-percentiles", default=d.metric_percentiles, help="comma-separated percentiles")
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
    from dataclasses import fields

    from dsflash.bench.options import BenchOptions
    from dsflash.bench.run import run as bench

    opts = BenchOptions(**{f.name: getattr(args, f.name) for f in fields(BenchOptions)})
    return bench(opts)
