"""In-process API that joins text and runtime: open models, boot a backend, and Generator (requests -> Deltas).

Names are imported on first use so that light users (`dsflash profiles`, `ps`) do not pay for torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ModelFiles": "files",
    "open_files": "files",
    "open_dir": "files",
    "open_reference": "files",
    "Generator": "generator",
    "Stream": "generator",
    "ChatRequest": "api",
    "CompletionRequest": "api",
    "Delta": "api",
    "GenerationOptions": "api",
    "TokenLogprob": "api",
    "Usage": "api",
    "RequestStats": "api",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dsflash.service' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dsflash.service.{module}"), name)
    globals()[name] = value
    return value
