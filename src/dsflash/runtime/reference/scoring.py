"""Teacher-forced logits of a token sequence: one prefill over everything, and prefill + decode steps."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# (tokens [1, s], start_pos, fresh) -> logits [1, s, V]; fresh = start a new sequence
Forward = Callable[[torch.Tensor, int, bool], torch.Tensor]


def prefill_logits(forward: Forward, tokens: list[int]) -> np.ndarray:
    """float32 [T, V]: one forward at start_pos 0 over all T tokens, every position."""
    return forward(torch.tensor([tokens]), 0, True)[0].float().numpy()


def decode_logits(forward: Forward, tokens: list[int], prefill: int) -> np.ndarray:
    """float32 [T - P, V]: prefill tokens[:P], then one step per remaining token; row i = logits after P + i."""
    t = torch.tensor([tokens])
    last = forward(t[:, :prefill], 0, True)
    rows = []
    for pos in range(prefill, len(tokens)):
        rows.append(forward(t[:, pos : pos + 1], pos, False)[0, -1].float())
    vocab = last.shape[-1]
    return torch.stack(rows).numpy() if rows else np.zeros((0, vocab), dtype=np.float32)
