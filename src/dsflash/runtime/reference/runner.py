"""Runner over an in-process model and expert back end (the CPU reference, or any single-rank model)."""

from __future__ import annotations

import torch

from dsflash.counters import ExpertCounters
from dsflash.runtime.prefix.shelf import Shelf, Taken, state_bytes
from dsflash.runtime.reference.loader import LoadedModel


class ModelRunner:
    def __init__(self, loaded: LoadedModel, max_len: int, identity: dict | None = None, snapshot_dir=None,
                 n_seqs: int = 1):  # fmt: skip
        """identity: what its snapshot files must match (runtime/prefix/identity.py); snapshot_dir: also keep
        snapshots on disk there; n_seqs: sequence slots (a decode state each) for batched decode."""
        self.model, self.experts = loaded.model, loaded.experts
        self.max_len, self.n_seqs = max_len, n_seqs
        self.vocab_size = loaded.cfg.vocab_size
        self.states = [self.model.new_state(max_len) for _ in range(n_seqs)]
        self.state = self.states[0]
        self.shelf = Shelf(self.state, identity or {"backend": "reference"}, directory=snapshot_dir)

    def select(self, seq: int) -> None:
        self.state = self.shelf.state = self.states[seq]

    def decode(self, tokens: list[int], positions: list[int], seqs: list[int]) -> torch.Tensor:
        return self.model.decode_batch(tokens, positions, [self.states[i] for i in seqs], self.experts)

    def reset(self) -> None:
        self.state.reset()

    def forward(self, tokens: list[int], start_pos: int, all_logits: bool) -> torch.Tensor:
        return self.model(torch.tensor([tokens]), start_pos, self.state, self.experts, last_only=not all_logits)[0]

    def counters(self) -> ExpertCounters:
        return ExpertCounters()  # every expert is resident: nothing is looked up or streamed

    # ---- prefix snapshots (runtime/prefix/cache.SnapshotRunner) ----
    @property
    def snapshot_identity(self) -> dict:
        return self.shelf.identity

    def snapshot_bytes(self, length: int) -> int:
        return state_bytes(self.state, length)

    def snapshot(self, key: int, keep: bool, write: bool, tokens, salt: str) -> Taken:
        return self.shelf.take(key, keep, write, tokens, salt)

    def restore(self, key: int, length: int, from_disk: bool, keep: bool) -> bool:
        snap = self.shelf.load(key, length, from_disk)
        if snap is not None:
            self.shelf.apply(key, snap, length, keep)
        return snap is not None

    def drop(self, key: int, memory: bool, disk: bool) -> None:
        self.shelf.drop(key, memory, disk)
