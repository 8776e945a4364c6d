"""Open a model by name: resolve its files, check the inventory, load the tokenizer (and the CPU reference)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dsflash.checkpoint.index import Checkpoint
from dsflash.checkpoint.source import resolve_model_dir
from dsflash.runtime.reference.loader import LoadedModel, load_reference
from dsflash.service.catalog import packaged_path
from dsflash.text.token_map import compressed_token_map
from dsflash.text.tokenizer import Tokenizer


@dataclass
class ModelFiles:
    """A verified checkpoint and its tokenizer."""

    path: Path
    ckpt: Checkpoint
    tokenizer: Tokenizer

    @property
    def token_map(self) -> list[int] | None:
        """Engram's compressed ids, only for models that have Engram layers."""
        return compressed_token_map(self.tokenizer.backend) if self.ckpt.config.engram_layer_ids else None


def open_files(spec: str, verify: bool = True) -> ModelFiles:
    """Resolve a packaged model's name (dsflash-demo-v4.1), a local dir or Hub repo id[@rev], check the inventory,
    load the tokenizer."""
    return open_dir(packaged_path(spec) or resolve_model_dir(spec), verify)


def open_dir(path: Path, verify: bool = True) -> ModelFiles:
    """A resolved model directory -> its checkpoint (inventory checked) and tokenizer."""
    ckpt = Checkpoint.open(path)
    if verify:
        ckpt.verify()
    return ModelFiles(path, ckpt, Tokenizer.from_dir(path, ckpt.config.model_type))


def open_reference(spec: str, qat: bool = True, dspark: bool = True) -> tuple[ModelFiles, LoadedModel]:
    files = open_files(spec)
    return files, load_reference(files.ckpt, files.token_map, qat=qat, dspark=dspark)
