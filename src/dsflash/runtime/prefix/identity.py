"""What a snapshot's numbers depend on: a file made under another model, revision, TP degree or engine format
holds another state and is never restored (runtime/prefix/files.check_identity)."""

from __future__ import annotations

from dsflash.store.layout import model_identity


def snapshot_identity(model_dir, spec, backend: str = "engine") -> dict:
    model, revision = model_identity(model_dir)
    return {
        "model": model,
        "revision": revision,
        "backend": backend,
        "tp": spec.tp,
        "expert_format": spec.expert_format if backend == "engine" else "resident",
        "dense_format": spec.dense_format if backend == "engine" else "fp32",
        "prefill_matmul": spec.prefill_matmul,
        "device": spec.device,
        "qat": spec.qat,
    }
