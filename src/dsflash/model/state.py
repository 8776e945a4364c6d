"""Per-sequence decode state (arch §5.10). The model defines what exists; the runtime decides where it lives."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsflash.config import ModelConfig


@dataclass
class LayerState:
    window: torch.Tensor  # [b, W, hd] ring of window KV, slot = position % W
    compressed: torch.Tensor | None = None  # [b, ceil(max_len / r), hd] KV-source latents (rotated, fake-quantized)
    index_keys: torch.Tensor | None = None  # [b, ceil(max_len / r), index_head_dim] KV-source index keys
    pending_kv: torch.Tensor | None = None  # [b, r, hd] the incomplete group's projections (ratio > 1)
    pending_score: torch.Tensor | None = None  # [b, r, hd] and its gate scores


@dataclass
class DecodeState:
    """Everything a sequence carries between forward calls. `length` = tokens consumed so far."""

    max_len: int
    layers: list[LayerState]
    engram_history: torch.Tensor | None  # [b, max_len] compressed token ids
    length: int = 0
    extras: dict = field(default_factory=dict)

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        max_len: int,
        batch: int = 1,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> DecodeState:
        hd, W = cfg.head_dim, cfg.sliding_window

        def zeros(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=device)

        layers = []
        for spec in cfg.layers():
            st = LayerState(window=zeros(batch, W, hd))
            if spec.is_kv_source:
                n = -(-max_len // spec.ratio)  # a static step writes its open group's row, the last one's too
                st.compressed = zeros(batch, n, hd)
                st.index_keys = zeros(batch, n, cfg.index_head_dim)
                if spec.ratio > 1:
                    st.pending_kv = zeros(batch, spec.ratio, hd, dt=torch.float32)
                    st.pending_score = zeros(batch, spec.ratio, hd, dt=torch.float32)
            layers.append(st)
        history = zeros(batch, max_len, dt=torch.int64) if cfg.engram_layer_ids else None
        return cls(max_len=max_len, layers=layers, engram_history=history)

    def reset(self) -> None:
        """Forget the sequence. Reads never reach past `length`, so zeroing is hygiene, not correctness."""
        self.length = 0
        self.extras.clear()
        for st in self.layers:
            for t in (st.window, st.compressed, st.index_keys, st.pending_kv, st.pending_score):
                if t is not None:
                    t.zero_()
        if self.engram_history is not None:
            self.engram_history.zero_()
