"""The engine's flags, shared by every command that runs it (serve, gates, logits): each flag's default is the
engine spec's own (runtime.spec.EngineSpec), and `engine_spec` is the one way a command turns them into a spec."""

from __future__ import annotations

import argparse
import os

from dsflash.paths import CACHE_DEFAULT
from dsflash.runtime.spec import (  # no torch: the CLI stays light
    DEFAULT_SLOTS,
    DEVICES,
    EXPERT_FORMATS,
    EngineSpec,
    default_prefix_gb,
)

SPEC = EngineSpec()  # every default below is the spec's


def add_engine_arguments(p: argparse.ArgumentParser, prefix: str = "", serving: bool = False) -> None:
    """--tp, --expert-slots, --expert-format, --device, --enforce-eager, --cache-dir, --rebuild; with serving also
    --prefill-chunk, --record-routing and the prefix cache's flags. `prefix` starts each help text (e.g. "engine: ")."""
    p.add_argument("--tp", type=int, default=SPEC.tp, help=f"{prefix}tensor-parallel degree")
    p.add_argument(
        "--expert-slots",
        type=int,
        default=SPEC.expert_slots,
        help=f"{prefix}expert slots per rank (default: {DEFAULT_SLOTS}, clipped to the model and to the memory left; "
        "an explicit count that does not fit is refused)",
    )
    add_expert_format_argument(p, prefix)
    p.add_argument(
        "--device",
        choices=DEVICES,
        default=SPEC.device,
        help=f"{prefix}where the engine computes: cuda (TP rank r on GPU r %% count), cpu, or auto (cuda where torch "
        "sees a GPU)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help=f"{prefix}on a GPU, run the decode step eagerly instead of replaying it as CUDA graphs captured at start "
        "(slower; for debugging, or where a capture fails)",
    )
    p.add_argument(
        "--cache-dir",
        default=SPEC.cache_dir,
        help=f"{prefix}generated models, expert stores and built kernels (default: {CACHE_DEFAULT})",
    )
    p.add_argument(
        "--rebuild",
        action="store_true",
        help="replace the expert store for this TP degree and tile format where it was built from another revision "
        "of the model or by another store version (without it such a store is refused: rebuilding V4.1-Flash's takes "
        "tens of minutes). A store for another TP degree or format is never touched: each has its own",
    )
    if not serving:
        return
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=SPEC.prefill_chunk,
        help="prompt tokens per prefill pass: each pass streams the experts its tokens touch once, so longer passes "
        "stream less per prompt token (long prompts' TTFT) and hold more activations",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=SPEC.max_num_seqs,
        help="sequences decoded together, one token each per step: the dense weights and the routed experts a step "
        "reads serve all of them (1: one sequence at a time; every TP rank holds a decode state per sequence)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=SPEC.max_num_batched_tokens,
        help="tokens one step may compute while sequences run: their decode tokens plus the prefill pass of a new "
        "prompt that joins between two decode steps; lower keeps the running streams' inter-token gaps short while "
        "a long prompt is admitted (default: --prefill-chunk + --max-num-seqs)",
    )
    p.add_argument(
        "--prefill-step-factor",
        type=float,
        default=SPEC.prefill_step_factor,
        metavar="F",
        help="while sequences decode, a new prompt's prefill share of a step shrinks (to one token at least) so the "
        "step takes about F times its decode call: running streams' gaps stay under ~F x while a long prompt is "
        "admitted, which then takes longer (0: only --max-num-batched-tokens bounds it)",
    )
    p.add_argument(
        "--speculative",
        choices=("dspark",),
        default=SPEC.speculative,
        help="speculative decoding: the model's DSpark head drafts tokens that one target forward verifies; greedy "
        "output and the sampled distribution stay those of plain decoding, and a guard turns drafting off while it "
        "does not pay (default: off; one sequence at a time, not with --max-num-seqs > 1)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=SPEC.num_speculative_tokens,
        metavar="K",
        help="drafts per verify with --speculative (default: the head's block size)",
    )
    p.add_argument(
        "--record-routing",
        default=None,
        type=os.path.abspath,  # one absolute file, whichever process (a detached child) opens it
        metavar="FILE",
        help="append the expert routing of every MoE call to FILE (JSON lines; engine backend) for "
        "`dsflash simulate --trace FILE` (default: not recorded)",
    )
    add_prefix_arguments(p)


def add_prefix_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",  # a store_true flag: serve --detach carries flags that are True (cli/_detach.py)
        help="prefill every prompt whole (by default a prompt that extends an earlier prompt or request restores "
        "that sequence's state and prefills only the rest: an agent's next turn costs its new tokens)",
    )
    p.add_argument(
        "--prefix-cache-gb",
        type=float,
        default=SPEC.prefix_cache_gb,
        metavar="GB",
        help="host memory for prefix snapshots, every TP rank's together, evicted least-recently-used (default: an "
        f"eighth of this host's memory, at most 8: {default_prefix_gb():g} here)",
    )
    p.add_argument(
        "--prefix-cache-dir",
        default=SPEC.prefix_cache_dir,
        type=os.path.abspath,
        metavar="DIR",
        help="also write prefix snapshots to DIR (checked files, one per rank), so that a restarted server with the "
        "same model, revision, TP degree and formats reuses them (default: memory only)",
    )
    p.add_argument(
        "--prefix-cache-disk-gb",
        type=float,
        default=SPEC.prefix_cache_disk_gb,
        metavar="GB",
        help="the most bytes of snapshot files in --prefix-cache-dir, evicted least-recently-used",
    )


def add_expert_format_argument(p: argparse.ArgumentParser, prefix: str = "", flag: str = "--expert-format") -> None:
    p.add_argument(
        flag,
        dest="expert_format",
        choices=EXPERT_FORMATS,
        default=SPEC.expert_format,
        help=f"{prefix}tile format of the routed experts: bfp8_b holds FP4 experts exactly at twice the bytes, "
        "bfp4_b is lossy; auto takes bfp8_b where the whole store fits in a quarter of this host's memory, else bfp4_b",
    )


def engine_spec(args, **fields):
    """The EngineSpec the parsed flags ask for (not yet resolved); `fields` are a command's own choices (qat)."""
    given = {
        "tp": args.tp,
        "expert_slots": args.expert_slots,
        "expert_format": args.expert_format,
        "device": args.device,
        "cuda_graph": not args.enforce_eager,
        "cache_dir": args.cache_dir,
        "rebuild_store": args.rebuild,
    }
    names = ("prefill_chunk", "max_num_seqs", "max_num_batched_tokens", "prefill_step_factor", "speculative",
             "num_speculative_tokens")  # fmt: skip
    for name in names:
        if hasattr(args, name):
            given[name] = getattr(args, name)
    if getattr(args, "record_routing", None):
        given["record_routing"] = args.record_routing
    if hasattr(args, "no_prefix_cache"):
        given["prefix_cache"] = not args.no_prefix_cache
    for name in ("prefix_cache_gb", "prefix_cache_dir", "prefix_cache_disk_gb"):
        if hasattr(args, name):
            given[name] = getattr(args, name)
    return EngineSpec(**given, **fields)
