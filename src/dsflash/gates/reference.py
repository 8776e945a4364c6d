"""Both sides of a gate as `runtime.reference.scoring.Forward` callables: DeepSeek's math on the CPU, and the engine."""

from __future__ import annotations

import torch

from dsflash.runtime.reference.loader import LoadedModel


def reference_forward(ref: LoadedModel, max_len: int):
    """The fp32 reference with every expert resident (checkpoint FP4 dequantized exactly)."""
    state = ref.model.new_state(max_len)

    def forward(tokens: torch.Tensor, start_pos: int, fresh: bool) -> torch.Tensor:
        if fresh:
            state.reset()
        return ref.model(tokens, start_pos, state, ref.experts)

    return forward


def runner_forward(runner):
    """Any engine Runner (runtime.scheduler.engine.Runner): every position's logits."""

    def forward(tokens: torch.Tensor, start_pos: int, fresh: bool) -> torch.Tensor:
        if fresh:
            runner.reset()
        return runner.forward(tokens[0].tolist(), start_pos, True).unsqueeze(0)

    return forward
