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
    ratio: int = 1  # compression ratio of the compressed rows (a row per `ratio` positions)

    def parts(self, length: int):
        """(name, tensor, rows along dim 1 that `length` consumed tokens can have written) of every tensor held."""
        rows = -(-length // self.ratio)  # the open group's row too: a static step writes it (compressor.static)
        for name in ("window", "compressed", "index_keys", "pending_kv", "pending_score"):
            t = getattr(self, name)
            if t is not None:
                yield name, t, (rows if name in ("compressed", "index_keys") else t.shape[1])


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
            st = LayerState(window=zeros(batch, W, hd), ratio=max(1, spec.ratio))
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

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The sequence so far as host tensors by name (copies; only the rows `length` tokens wrote)."""
        out = {}
        for i, st in enumerate(self.layers):
            for name, t, rows in st.parts(self.length):
                out[f"{i}.{name}"] = t[:, :rows].to("cpu", copy=True)
        if self.engram_history is not None:
            out["engram_history"] = self.engram_history[:, : self.length].to("cpu", copy=True)
        for name, t in self.extras.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"decode state extra {name!r} is not a tensor: it cannot be snapshotted")
            out[f"extras.{name}"] = t.to("cpu", copy=True)
        return out

    def check(self, snap: dict[str, torch.Tensor], length: int) -> None:
        """ValueError unless `snap` is a snapshot of `length` tokens of a state shaped like this one."""
        want = {}
        for i, st in enumerate(self.layers):
            for name, t, rows in st.parts(length):
                want[f"{i}.{name}"] = ((*t.shape[:1], rows, *t.shape[2:]), t.dtype)
        if self.engram_history is not None:
            want["engram_history"] = ((self.engram_history.shape[0], length), self.engram_history.dtype)
        got = {k: (tuple(v.shape), v.dtype) for k, v in snap.items() if not k.startswith("extras.")}
        if length > self.max_len or got != {k: (tuple(s), d) for k, (s, d) in want.items()}:
            raise ValueError(f"the snapshot does not fit this decode state ({length} tokens of {self.max_len})")

    def restore(self, snap: dict[str, torch.Tensor], length: int) -> None:
        """Continue the sequence a snapshot holds. Copies into the allocated tensors: CUDA graphs captured over
        them keep reading the same memory."""
        self.check(snap, length)
        for i, st in enumerate(self.layers):
            for name, t, rows in st.parts(length):
                t[:, :rows].copy_(snap[f"{i}.{name}"])
        if self.engram_history is not None:
            self.engram_history[:, :length].copy_(snap["engram_history"])
        self.extras.clear()
        for k, v in snap.items():
            if k.startswith("extras."):
                self.extras[k.removeprefix("extras.")] = v.to(self.layers[0].window.device)
        self.length = length
