"""A Runner that emits a chosen token stream (greedy sampling picks it), for tests of the text side of serving."""

from __future__ import annotations

import torch

from dsflash.counters import ExpertCounters


class ScriptedRunner:
    """forward() returns logits whose argmax is the next scripted token (then EOS forever)."""

    def __init__(self, script: list[int], vocab_size: int, eos: int = 1, max_len: int = 4096, step_s: float = 0.0):
        self.script, self.vocab_size, self.eos, self.max_len, self.step_s = (
            list(script),
            vocab_size,
            eos,
            max_len,
            step_s,
        )
        self.k = 0
        self.calls = ExpertCounters()

    def reset(self) -> None:
        self.k = 0

    def forward(self, tokens: list[int], start_pos: int, all_logits: bool) -> torch.Tensor:
        if self.step_s:
            import time

            time.sleep(self.step_s)
        if start_pos > 0:
            self.k += 1
        nxt = self.script[self.k] if self.k < len(self.script) else self.eos
        logits = torch.zeros(len(tokens) if all_logits else 1, self.vocab_size)
        logits[:, nxt] = 12.0
        logits[:, (nxt + 1) % self.vocab_size] = 9.0  # a runner-up, so top_logprobs has a clear second entry
        c = self.calls
        self.calls = ExpertCounters(c.hits + 3, c.misses + 1, c.evictions, c.bytes_streamed + 1000)
        return logits

    def counters(self) -> ExpertCounters:
        return self.calls
