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
    # while a speculative verify runs (DecodeState.mark): the compressor's (first position, kv, score) of the
    # chunk's open groups, from which a rollback rebuilds the pending group; None otherwise
    journal: list | None = field(default=None, repr=False)

    def parts(self, length: int):
        """(name, tensor, rows along dim 1 that `length` consumed tokens can have written) of every tensor held."""
        rows = -(-length // self.ratio)  # the open group's row too: a static step writes it (compressor.static)
        for name in ("window", "compressed", "index_keys", "pending_kv", "pending_score"):
            t = getattr(self, name)
            if t is not None:
                yield name, t, (rows if name in ("compressed", "index_keys") else t.shape[1])


@dataclass
class Mark:
    """What a verify of positions start..start+n-1 overwrites that the positions before it wrote (DecodeState.mark):
    the window ring slots, the compressed / index-key rows of the groups it touches, the pending groups, the
    Engram history there."""

    start: int
    n: int
    saved: dict = field(default_factory=dict)  # (layer, name) -> tensor copy; "history" -> the history's rows


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
            if k.startswith("extras."):  # a copy: the snapshot stays what it was, whatever this sequence does next
                self.extras[k.removeprefix("extras.")] = v.to(self.layers[0].window.device, copy=True)
        self.length = length

    # ---- speculative verify: write n positions, then keep only the first ones ----
    def mark(self, start: int, n: int) -> Mark:
        """Save what a forward of positions start..start+n-1 will overwrite, and journal its compressors, so that
        rollback() can keep any prefix of them exactly as if only that prefix had been consumed."""
        if start != self.length:
            raise ValueError(f"a verify at {start} does not continue the sequence (length {self.length})")
        m = Mark(start, n)
        for i, st in enumerate(self.layers):
            W = st.window.shape[1]
            if n > W:
                raise ValueError(f"a verify of {n} positions exceeds the {W}-slot window ring")
            m.saved[i, "window"] = st.window[:, (start + torch.arange(n)) % W].clone()
            for name in ("compressed", "index_keys"):
                t = getattr(st, name)
                if t is not None:
                    m.saved[i, name] = t[:, start // st.ratio : -(-(start + n) // st.ratio)].clone()
            if st.pending_kv is not None:
                m.saved[i, "pending_kv"], m.saved[i, "pending_score"] = st.pending_kv.clone(), st.pending_score.clone()
                st.journal = []
        if self.engram_history is not None:
            m.saved["history"] = self.engram_history[:, start : start + n].clone()
        return m

    def rollback(self, m: Mark, length: int) -> None:
        """After the marked forward: keep its positions below `length`, restore what the others overwrote."""
        if not m.start < length <= m.start + m.n or self.length != m.start + m.n:
            raise ValueError(f"rollback to {length} is outside the verify of {m.n} positions at {m.start}")
        drop = torch.arange(length, m.start + m.n)  # the rejected positions
        for i, st in enumerate(self.layers):
            W = st.window.shape[1]
            st.window[:, drop % W] = m.saved[i, "window"][:, drop - m.start]
            lo, keep = m.start // st.ratio, length // st.ratio  # rows from `keep` hold a rejected position
            for name in ("compressed", "index_keys"):
                t = getattr(st, name)
                if t is not None:
                    saved = m.saved[i, name]
                    t[:, keep : lo + saved.shape[1]] = saved[:, keep - lo :]
            if st.pending_kv is not None:
                first, kv, score = st.journal[-1]
                st.journal = None
                st.pending_kv.copy_(m.saved[i, "pending_kv"])
                st.pending_score.copy_(m.saved[i, "pending_score"])
                g, b = keep * st.ratio - first, kv.shape[0]  # the open group's consumed tokens, in the journal
                st.pending_kv[:b, : length - keep * st.ratio] = kv[:, g : g + length % st.ratio]
                st.pending_score[:b, : length - keep * st.ratio] = score[:, g : g + length % st.ratio]
        if self.engram_history is not None:
            self.engram_history[:, length : m.start + m.n] = m.saved["history"][:, length - m.start :]
        self.length = length
