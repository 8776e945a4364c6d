"""Engram: hashed n-gram memory added to the residual streams before a few blocks (arch §5.7)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dsflash.config import ModelConfig
from dsflash.errors import ConfigError
from dsflash.formats import fp8
from dsflash.model.layers import Linear, _param

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic for n < 3.3e24


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(cfg: ModelConfig) -> list[list[list[int]]]:
    """[layer][order - 2][head] table moduli: successive unused primes above engram_vocab_size - 1,
    restarting the search for every n-gram order and never reusing a prime across layers."""
    seen: set[int] = set()
    layers = []
    for _ in cfg.engram_layer_ids:
        orders = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            current, heads = cfg.engram_vocab_size - 1, []
            for _ in range(cfg.engram_n_heads):
                current += 1
                while current in seen or not is_prime(current):
                    current += 1
                seen.add(current)
                heads.append(current)
            orders.append(heads)
        layers.append(orders)
    return layers


def hash_multipliers(layer_id: int, max_ngram: int, compressed_vocab: int) -> np.ndarray:
    """Odd int64 multipliers from a per-layer numpy RNG, bounded so token * multiplier cannot overflow."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rng = np.random.default_rng(10007 * layer_id)
    return rng.integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1


class EngramHasher:
    """Table row ids of the n-grams ending at each position, for every Engram layer.

    Token history (compressed ids, -1 = dead) lives in the decode state, so look-back spans chunks.
    """

    DEAD = -1

    def __init__(self, cfg: ModelConfig, token_map: list[int] | torch.Tensor):
        primes = engram_primes(cfg)
        for lid, rows, layer in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings, primes, strict=True):
            if sum(map(sum, layer)) != rows:
                raise ConfigError(f"engram layer {lid}: primes sum to {sum(map(sum, layer))}, config says {rows} rows")
        token_map = torch.as_tensor(token_map, dtype=torch.int64)
        if token_map.numel() < cfg.vocab_size or int(token_map.max()) + 1 != cfg.engram_compressed_vocab_size:
            raise ConfigError(
                f"engram token map has {token_map.numel()} entries and {int(token_map.max()) + 1} compressed ids; "
                f"the config wants {cfg.vocab_size} and {cfg.engram_compressed_vocab_size}"
            )
        self.n = cfg.engram_max_ngram_size
        self.token_map = token_map
        self.pad = int(token_map[cfg.engram_pad_token_id])
        self.primes = torch.tensor(primes, dtype=torch.int64)  # [L, n-1, heads]
        flat = self.primes.flatten(1)
        self.offsets = torch.cumsum(flat, dim=1) - flat  # [L, (n-1) * heads]
        self.multipliers = torch.from_numpy(
            np.stack([hash_multipliers(lid, self.n, cfg.engram_compressed_vocab_size) for lid in cfg.engram_layer_ids])
        )  # [L, n]
        self._device_tables: tuple = (torch.device("cpu"), self.token_map, self.multipliers, self.primes, self.offsets)

    def _on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The tables on `device`, copied once (a captured step may not copy from the host)."""
        if self._device_tables[0] != device:
            tables = (self.token_map, self.multipliers, self.primes, self.offsets)
            self._device_tables = (device, *(t.to(device) for t in tables))
        return self._device_tables[1:]

    def __call__(self, tokens: torch.Tensor, start_pos: int | torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] -> row ids [b, s, L, (n-1) * heads]; records the chunk in history [b, max_len].
        start_pos: an int, or a static step's device tensor [1] (s = 1)."""
        b, s = tokens.shape
        token_map, multipliers, primes, offsets = self._on(tokens.device)
        if isinstance(start_pos, torch.Tensor):
            pos = start_pos.view(1, 1).expand(b, 1)
            history[:b].scatter_(1, pos, token_map[tokens])
        else:
            history[:b, start_pos : start_pos + s] = token_map[tokens]
            pos = torch.arange(start_pos, start_pos + s, device=tokens.device).expand(b, s)
        blocked = torch.zeros_like(pos, dtype=torch.bool)
        grams = []
        for shift in range(self.n):
            tok = history[:b].gather(1, (pos - shift).clamp_min(0))
            # look-back never crosses the sequence start or a dead (image) token
            blocked = blocked | (pos < shift) | (tok == self.DEAD)
            grams.append(torch.where(blocked, self.pad, tok))
        products = torch.stack(grams, dim=-1).unsqueeze(2) * multipliers  # [b, s, L, n]
        rolling, ids = products[..., 0], []
        for i in range(1, self.n):
            rolling = torch.bitwise_xor(rolling, products[..., i])
            ids.append(rolling.unsqueeze(-1) % primes[:, i - 1])
        return torch.cat(ids, dim=-1) + offsets


class EngramTable(nn.Module):
    """The FP8 table with per-32 E8M0 row scales; stays as stored (mmap) and dequantizes looked-up rows."""

    def __init__(self, rows: int, dim: int, block: int):
        super().__init__()
        self.block = block
        self.register_buffer("weight", torch.empty(0, dim, dtype=torch.float8_e4m3fn), persistent=True)
        self.register_buffer("scale", torch.empty(0, dim // block, dtype=torch.float8_e8m0fnu), persistent=True)
        self.rows = rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> rows [..., dim] in bf16 (FP8 x 2^k is exact there), as DeepSeek hands them to wkv."""
        host = ids.to(self.weight.device)
        rows = fp8.dequant_rows(self.weight, self.scale, host, self.block)
        return rows.to(torch.bfloat16).to(ids.device)


class Engram(nn.Module):
    """Gated write of the looked-up n-gram embedding into every residual stream."""

    def __init__(self, cfg: ModelConfig, rows: int):
        super().__init__()
        d, hc = cfg.hidden_size, cfg.hc_mult
        self.dim, self.hc, self.eps = d, hc, cfg.rms_norm_eps
        self.embed = EngramTable(rows, cfg.engram_head_dim, cfg.fp8_block)
        self.wkv = Linear(cfg.engram_n_cols * cfg.engram_head_dim, d * (hc + 1))
        self.q_weight = _param(hc, d)
        self.k_weight = _param(hc, d)
        self.fused = None  # a runtime's kernel of the gated write: (x, kv, q_weight, k_weight, eps) -> out, or None

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [b, s, hc, d], ids [b, s, n_cols] -> x + gate * value, [b, s, hc, d]"""
        kv = self.wkv(self.embed(ids).flatten(-2))
        out = self.fused(x, kv, self.q_weight, self.k_weight, self.eps) if self.fused is not None else None
        if out is not None:
            return out.to(x.dtype)
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc, self.dim))
        h = x.float()
        # normalised per (token, stream) over d, not jointly over the streams
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1) * rstd * self.dim**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(x.dtype)
