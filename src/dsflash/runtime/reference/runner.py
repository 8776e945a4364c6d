"""Runner over an in-process model and expert back end (the CPU reference, or any single-rank model)."""

from __future__ import annotations

import torch

from dsflash.counters import ExpertCounters
from dsflash.runtime.reference.loader import LoadedModel


class ModelRunner:
    def __init__(self, loaded: LoadedModel, max_len: int):
        self.model, self.experts = loaded.model, loaded.experts
        self.max_len = max_len
        self.vocab_size = loaded.cfg.vocab_size
        self.state = self.model.new_state(max_len)

    def reset(self) -> None:
        self.state.reset()

    def forward(self, tokens: list[int], start_pos: int, all_logits: bool) -> torch.Tensor:
        return self.model(torch.tensor([tokens]), start_pos, self.state, self.experts, last_only=not all_logits)[0]

    def counters(self) -> ExpertCounters:
        return ExpertCounters()  # every expert is resident: nothing is looked up or streamed
