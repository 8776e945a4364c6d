"""What `dsflash bench` is asked for: one frozen set of options with `vllm bench serve`'s defaults (stdlib only, so a
command-line parser can take its defaults from here without importing the load generator)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_BASE_URL = "http://127.0.0.1:20000"
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class BenchOptions:
    """A benchmark run; the names are `dsflash bench`'s flags (vLLM's, with dashes as underscores)."""

    base_url: str | None = None  # None: http://host:port
    host: str = "127.0.0.1"
    port: int = 20000
    endpoint: str = "completions"  # completions | chat | a path
    backend: str | None = None  # openai | openai-chat (None: from endpoint)
    model: str | None = None  # None: the first of GET /v1/models
    tokenizer: str | None = None  # a directory with tokenizer.json (None: the bundled DeepSeek V4.1 tokenizer)
    dataset_name: str = "random"
    workload: str | None = None  # chat | codegen | agent | long | multi-turn (datasets.PRESETS)
    turns: int | None = None  # multi-turn: turns per conversation (None: the preset's, else 1)
    turn_len: int | None = None  # multi-turn: new prompt tokens each later turn appends (None: the preset's)
    scale: float = 1.0
    random_input_len: int | None = None  # None: 1024, or the workload's
    random_output_len: int | None = None  # None: 128, or the workload's
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    num_prompts: int | None = None  # None: 1000, or the workload's
    ignore_eos: bool = False  # always sent for the random dataset, as in vLLM
    seed: int = 0
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    extra_body: str | None = None  # JSON object merged into every request body
    num_warmups: int = 0
    ready_check_timeout_sec: int = 600
    percentile_metrics: str = "ttft,tpot,itl,e2el"
    metric_percentiles: str = "99"
    save_result: str | bool | None = None  # True: vLLM's default file name
    result_dir: str | None = None
    result_filename: str | None = None
    save_detailed: bool = False
    label: str | None = None
    metadata: Sequence[str] | None = None  # KEY=VALUE
    no_plot: bool = False
