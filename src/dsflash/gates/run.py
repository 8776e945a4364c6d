"""`dsflash gates`: the engine against DeepSeek's reference on the same mixed text, teacher-forced."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np

from dsflash.counters import ExpertCounters
from dsflash.gates.compare import compare_logits, next_token_loss
from dsflash.gates.reference import reference_forward, runner_forward
from dsflash.gates.suites import DEFAULT_TOKENS, Thresholds, gate_tokens, split
from dsflash.runtime.reference.loader import load_reference
from dsflash.runtime.reference.scoring import decode_logits, prefill_logits
from dsflash.runtime.spec import EngineSpec, resolve
from dsflash.runtime.tp.launch import prepare_store, start_ranks
from dsflash.service.files import ModelFiles


@dataclass
class Scores:
    prefill: np.ndarray  # [T, V] one forward over every token
    decode: np.ndarray  # [T - P, V] teacher-forced steps after a P-token prefill
    counters: ExpertCounters | None = None  # the engine's expert counters
    slots: int = 0  # the engine's expert slots per rank


def gate_ids(files: ModelFiles, tokens: int = DEFAULT_TOKENS, text: str | None = None) -> tuple[list[int], int]:
    ids = gate_tokens(files.tokenizer.encode, files.tokenizer.bos_id, tokens, text)
    return ids, split(len(ids))[0]


def _score(forward, ids: list[int], prefill: int) -> tuple[np.ndarray, np.ndarray]:
    return prefill_logits(forward, ids), decode_logits(forward, ids, prefill)


def reference_scores(files: ModelFiles, ids: list[int], prefill: int, qat: bool = False) -> Scores:
    ref = load_reference(files.ckpt, files.token_map, qat=qat, dspark=False)
    scores = Scores(*_score(reference_forward(ref, len(ids)), ids, prefill))
    del ref
    gc.collect()  # the reference's fp32 experts go before an engine starts
    return scores


def engine_scores(files: ModelFiles, ids: list[int], prefill: int, spec: EngineSpec, progress: bool = False) -> Scores:
    """The engine's scores on the tokens; `spec` resolved here (the store is made on first use)."""
    spec = resolve(spec, files.ckpt.config)
    prepare_store(files.ckpt, spec, progress)
    return _engine_scores(files, ids, prefill, spec)


def _engine_scores(files: ModelFiles, ids: list[int], prefill: int, spec: EngineSpec) -> Scores:
    runner = start_ranks(files.ckpt, files.token_map, len(ids), spec)
    try:
        pre, dec = _score(runner_forward(runner), ids, prefill)
        return Scores(pre, dec, runner.counters(), runner.rank0.experts.pool.n_slots)
    finally:
        runner.close()


def report(want: Scores, got: Scores, thresholds: Thresholds | None = None, ids: list[int] | None = None) -> dict:
    """Agreement per part; with the scored `ids`, also each side's mean next-token loss over the prefill."""
    keys = ("decisive_top1", "mean_kl", "n_decisive", "n")
    out = {part: {k: compare_logits(getattr(want, part), getattr(got, part))[k] for k in keys}
           for part in ("prefill", "decode")}  # fmt: skip
    if ids is not None:
        out["loss"] = {"reference": next_token_loss(want.prefill, ids), "engine": next_token_loss(got.prefill, ids)}
    out["experts"] = {**(got.counters or ExpertCounters()).to_json(), "slots": got.slots}
    failures = (thresholds or Thresholds()).failures(out)
    out["pass"], out["failures"] = not failures, failures
    return out


def run_gates(
    files: ModelFiles,
    spec: EngineSpec,
    tokens: int = DEFAULT_TOKENS,
    thresholds: Thresholds | None = None,
    progress: bool = False,
    text: str | None = None,
) -> dict:
    """Score reference and engine on the same tokens of `text` (default: the bundled mixed text); the report says
    which thresholds fail (if any) and each side's next-token loss. The reference's fake-quant points follow the
    engine's (spec.qat) so that both compute the same model."""
    spec = resolve(spec, files.ckpt.config)  # a device this machine lacks fails now, not after the reference ran
    # the store first: a refused TP degree or a store made for something else fails before the reference runs
    prepare_store(files.ckpt, spec, progress)
    ids, prefill = gate_ids(files, tokens, text)
    want = reference_scores(files, ids, prefill, spec.qat)
    out = report(want, _engine_scores(files, ids, prefill, spec), thresholds, ids)
    out["config"] = {
        "tp": spec.tp,
        "expert_format": spec.expert_format,
        "tokens": len(ids),
        "prefill": prefill,
        "qat": spec.qat,
        "device": spec.device,
    }
    return out
