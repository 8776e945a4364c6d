"""Runner over an in-process model and expert back end (the CPU reference, or any single-rank model)."""

from __future__ import annotations

import torch

from dsflash.counters import ExpertCounters
from dsflash.model.dspark import Speculation, draft_sampler
from dsflash.runtime.prefix.shelf import Shelf, Taken, state_bytes
from dsflash.runtime.reference.loader import LoadedModel


class ModelRunner:
    def __init__(self, loaded: LoadedModel, max_len: int, identity: dict | None = None, snapshot_dir=None,
                 n_seqs: int = 1, speculative: bool = False):  # fmt: skip
        """identity: what its snapshot files must match (runtime/prefix/identity.py); snapshot_dir: also keep
        snapshots on disk there; n_seqs: sequence slots (a decode state each) for batched decode; speculative:
        every forward seeds the DSpark head, and draft / verify / accept work (one sequence)."""
        self.model, self.experts = loaded.model, loaded.experts
        self.max_len, self.n_seqs = max_len, n_seqs
        self.vocab_size = loaded.cfg.vocab_size
        self.states = [self.model.new_state(max_len) for _ in range(n_seqs)]
        self.state = self.states[0]
        self.shelf = Shelf(self.state, identity or {"backend": "reference"}, directory=snapshot_dir)
        if speculative and n_seqs > 1:
            raise ValueError("speculative decoding runs one sequence at a time")
        self.speculation = Speculation(self.model, self.experts) if speculative else None

    def select(self, seq: int) -> None:
        self.state = self.shelf.state = self.states[seq]

    def decode(self, tokens: list[int], positions: list[int], seqs: list[int]) -> torch.Tensor:
        return self.model.decode_batch(tokens, positions, [self.states[i] for i in seqs], self.experts)

    def reset(self) -> None:
        self.state.reset()
        if self.speculation is not None:
            self.speculation.reset()

    def forward(self, tokens: list[int], start_pos: int, all_logits: bool) -> torch.Tensor:
        if self.speculation is not None:
            return self.speculation.forward(torch.tensor([tokens]), start_pos, self.state, not all_logits)[0]
        return self.model(torch.tensor([tokens]), start_pos, self.state, self.experts, last_only=not all_logits)[0]

    # ---- speculative decoding (runtime/scheduler/speculative.py) ----
    @property
    def draft_block(self) -> int:
        return self.model.cfg.dspark_block_size

    def draft(
        self, token: int, pos: int, k: int, sampling: tuple
    ) -> tuple[list[int], torch.Tensor, list[float]] | None:
        """sampling: (temperature, top_k, top_p, min_p, seed, index) of the draws inside the draft -> (ids, logits,
        confidence), or None."""
        out = self.speculation.draft(token, pos, k, self.state, draft_sampler(*sampling))
        return None if out is None else (out[0].tolist(), out[1], out[2].tolist())

    def verify(self, tokens: list[int], start_pos: int) -> torch.Tensor:
        return self.speculation.forward(torch.tensor([tokens]), start_pos, self.state, verify=True)[0]

    def accept(self, n_keep: int) -> None:
        self.speculation.accept(self.state, n_keep)

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
            if self.speculation is not None:  # the taps it holds are another sequence's
                self.speculation.reset()
        return snap is not None

    def drop(self, key: int, memory: bool, disk: bool) -> None:
        self.shelf.drop(key, memory, disk)
