"""Routing traces: which experts each token uses at each MoE layer. Synthetic (a stated locality model) or
recorded from the engine (`dsflash serve --record-routing FILE`, JSON lines)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsflash.errors import ConfigError
from dsflash.sim.box import Locality


@dataclass
class Step:
    """One forward pass: `kind` prefill | decode, first position `pos`, `n` tokens; `routing[l]` holds layer l's
    expert ids in token order (n * top_k of them, or fewer when a recorded trace only kept per-expert counts)."""

    kind: str
    pos: int
    n: int
    routing: list[np.ndarray]
    positions: list[int] | None = None  # a batched decode step: each sequence's position (n of them)


@dataclass
class RequestTrace:
    """One request's routing: prompt tokens then generated tokens. ids [tokens, layers, top_k] (synthetic), or
    recorded steps. `weights` [layers, experts]: the request's expert popularity (predictions use it)."""

    prompt_len: int
    output_len: int
    ids: np.ndarray | None = None
    recorded: list[Step] | None = None
    weights: np.ndarray | None = None

    def steps(self, chunk: int, expert_major: bool = True, start: int = 0):
        """Forward passes: prefill chunks from `start` (the tokens before it restored from a prefix snapshot; or one
        token at a time when not expert-major), then one per output token but the first (it comes from the last
        prefill pass)."""
        if self.recorded is not None:
            yield from self._recorded_steps(expert_major)
            return
        size = chunk if expert_major else 1
        for p in range(start, self.prompt_len, size):
            n = min(size, self.prompt_len - p)
            yield Step("prefill", p, n, [self.ids[p : p + n, l].ravel() for l in range(self.ids.shape[1])])
        for i in range(1, self.output_len):
            p = self.prompt_len + i - 1
            yield Step("decode", p, 1, [self.ids[p, l] for l in range(self.ids.shape[1])])

    def _recorded_steps(self, expert_major: bool):
        for s in self.recorded:
            if s.kind == "decode" or expert_major or s.n == 1:
                yield s
                continue
            # token-major replay of a recorded chunk: counts only, so tokens are dealt round-robin over its experts
            per_token = [np.array_split(np.asarray(r), s.n) for r in s.routing]
            for t in range(s.n):
                yield Step("prefill", s.pos + t, 1, [layer[t] for layer in per_token])


def zipf_weights(experts: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, experts + 1) ** s
    return w / w.sum()


class SyntheticRouting:
    """The locality model of `Locality`, for a model with `layers` x `experts` and `top_k` per token."""

    def __init__(self, layers: int, experts: int, top_k: int, loc: Locality):
        self.layers, self.experts, self.top_k, self.loc = layers, experts, top_k, loc
        rng = np.random.default_rng(loc.seed)
        base = zipf_weights(experts, loc.zipf)
        # each layer has its own hot experts: the Zipf ranks land on a random order of the ids
        self.global_weights = np.stack([base[np.argsort(rng.permutation(experts))] for _ in range(layers)])

    def hot_order(self) -> np.ndarray:
        """(layer, expert) keys by long-run popularity, hottest first: what a profile over many requests finds."""
        flat = self.global_weights.ravel()
        return np.argsort(-flat, kind="stable")

    def request(self, prompt_len: int, output_len: int, index: int = 0) -> RequestTrace:
        """Request number `index` (its own skew and tokens; the same index gives the same trace)."""
        rng = np.random.default_rng([self.loc.seed, index, prompt_len, output_len])
        skew = np.exp(self.loc.request_sigma * rng.standard_normal(self.global_weights.shape))
        w = self.global_weights * skew
        w /= w.sum(axis=1, keepdims=True)
        n = prompt_len + output_len
        ids = np.empty((n, self.layers, self.top_k), dtype=np.int16)
        for l in range(self.layers):
            ids[:, l] = self._sample(rng, w[l], n)
        return RequestTrace(prompt_len, output_len, ids=ids, weights=w)

    def _sample(self, rng: np.random.Generator, w: np.ndarray, n: int) -> np.ndarray:
        """[n, top_k] ids drawn without replacement in proportion to w, with temporal reuse."""
        fresh = rng.random(n) >= self.loc.reuse
        fresh[0] = True
        idx = np.where(fresh, np.arange(n), 0)
        np.maximum.accumulate(idx, out=idx)  # a reusing token copies the last fresh one before it
        out = draw_without_replacement(rng, w, int(fresh.sum()), self.top_k)
        return out[np.cumsum(fresh)[idx] - 1]


def draw_without_replacement(rng: np.random.Generator, w: np.ndarray, m: int, k: int) -> np.ndarray:
    """[m, k] ids, each row k distinct draws in proportion to w (sequential draws, repeats skipped: Plackett-Luce),
    as the first k of independent exponential clocks Exp(rate w_e) to ring."""
    inv_w = (1.0 / w).astype(np.float32)
    out = np.empty((m, k), dtype=np.int16)
    for a in range(0, m, 4096):
        b = min(m, a + 4096)
        clocks = -np.log1p(-rng.random((b - a, len(w)), dtype=np.float32)) * inv_w
        out[a:b] = np.argpartition(clocks, k, axis=1)[:, :k]
    return out


def load_recorded(path: str | Path) -> tuple[list[RequestTrace], dict]:
    """Requests of a `--record-routing` file (a `reset` line starts each), and its header (layers, experts, top_k)."""
    header, requests, steps = {}, [], None
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read routing trace {path}: {e.strerror}") from None
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise ConfigError(f"{path}:{no}: not a JSON line") from None
        if "header" in rec:
            header = rec["header"]
        elif rec.get("event") == "reset":
            steps = []
            requests.append(steps)
        elif "kind" in rec:
            if steps is None:  # steps before the first reset: the server's warm-up
                steps = []
                requests.append(steps)
            if not header:
                raise ConfigError(f"{path}:{no}: a step before the header line")
            index = {layer: i for i, layer in enumerate(header["layers"])}
            routing = [np.empty(0, dtype=np.int16) for _ in index]
            for layer, ids, counts in rec["layers"]:
                routing[index[layer]] = np.repeat(np.asarray(ids, dtype=np.int16), counts)
            steps.append(Step(rec["kind"], rec["pos"], rec["n"], routing))
    if not header:
        raise ConfigError(f"{path}: no header line (is it a `dsflash serve --record-routing` file?)")
    return [_request(s) for s in requests if s], header


def _request(steps: list[Step]) -> RequestTrace:
    prompt = sum(s.n for s in steps if s.kind == "prefill")
    output = 1 + sum(1 for s in steps if s.kind == "decode")
    return RequestTrace(prompt, output, recorded=steps)
