"""ExpertBackend over a fixed pool of device slots filled from the packed store on demand (an LRU).

Expert-major: every call makes each routed expert resident once and applies it to all the tokens routed to it,
which is what makes a prefill chunk cost one pass over the experts it touches.
"""

from __future__ import annotations

import os
import time

import torch

from dsflash.counters import ExpertCounters
from dsflash.runtime.cpu import rows
from dsflash.runtime.experts.device import Device, PackedMatrix, ShardLayout
from dsflash.runtime.experts.slots import SlotPool


def shard_layout(geometry) -> ShardLayout:
    """The store's per-rank layout (store.layout.Geometry) as the device sees it."""
    mats = [PackedMatrix(p.offset, p.nbytes, p.tiles[0] * 32, p.tiles[1] * 32) for p in geometry.parts]
    return ShardLayout(geometry.tile_format, *mats, nbytes=geometry.shard_bytes)


# a call with at least this many tokens is a scan over the layer's experts (prefill), not decode
SCAN_TOKENS = 16


class CachedExperts:
    def __init__(self, store, device: Device, n_slots: int, rank: int, swiglu_limit: float, routing_log=None):
        self.store, self.device, self.rank, self.limit = store, device, rank, swiglu_limit
        self.routing_log = routing_log  # runtime.routing_log.RoutingLog or None
        self.layout = shard_layout(store.geometry)
        self.pool = SlotPool(n_slots)
        self.slots = device.allocate(n_slots, self.layout.nbytes)
        self._fds: dict[int, int] = {}
        self.bytes_copied = 0
        self.copy_s = 0.0

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.routing_log is not None:
            self.routing_log.moe(layer, ids)
        x = x.float()
        routed = ids.cpu()  # slot bookkeeping runs on the host whatever the device
        table = routed.tolist()
        experts = list(table[0]) if len(table) == 1 else sorted({e for row in table for e in row})
        self._resident_first(layer, experts)
        few = routed.shape[0] < SCAN_TOKENS or rows.is_decoding()
        if few and len(experts) <= self.pool.n_slots:  # decode, a batched step, a verify: all pinned at once
            slots = self._acquire(layer, experts)
            try:
                return self._together(experts, slots, table, x, weights)
            finally:
                self.release(layer, experts)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        scan = x.shape[0] >= SCAN_TOKENS  # a prefill chunk: its misses go in cold (SlotPool.acquire)
        for start in range(0, len(experts), self.pool.n_slots):
            wave = experts[start : start + self.pool.n_slots]
            slots = self._acquire(layer, wave, scan)
            try:
                for slot, (tok, k) in zip(slots, _token_indices(routed, wave, x.device), strict=True):
                    w = weights[tok, k, None]
                    y[tok] += self.device.expert(self.slots, slot, self.layout, x[tok], w, self.limit)
            finally:  # a cancelled or failed step leaves no expert pinned
                self.release(layer, wave)
        return y

    def _together(
        self, experts: list[int], slots: list[int], table: list[list[int]], x: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Every expert of the call resident in `slots` (experts' order); table: each token's routed experts. Each
        token's sum runs over its experts in expert id order, whatever was resident when: a token's bits do not
        depend on the slots' history or on the tokens beside it (a batched decode step's sequence gets its solo
        bits)."""
        slot_of = dict(zip(experts, slots, strict=True))
        # each token's routing columns in expert id order (a few tokens: plain lists, no tensor sort)
        order = [sorted(range(len(row)), key=row.__getitem__) for row in table]
        if len(table) == 1:  # one token: the layer's experts in one call
            ids = [slot_of[table[0][j]] for j in order[0]]
            return self.device.experts(self.slots, ids, self.layout, x, weights[:, order[0]], self.limit)
        w = weights.gather(1, torch.tensor(order, device=weights.device))
        index = {e: i for i, e in enumerate(experts)}
        route = torch.tensor(
            [[index[row[j]] for j in o] for row, o in zip(table, order, strict=True)], dtype=torch.int32
        )
        y = self.device.routed(self.slots, slots, self.layout, x, route, w, self.limit)
        if y is not None:
            return y
        # expert by expert (each once for all its tokens), then each token's terms added in its id order
        by_id = torch.tensor([[row[j] for j in o] for row, o in zip(table, order, strict=True)])
        terms = torch.empty((*by_id.shape, x.shape[1]), dtype=torch.float32, device=x.device)
        for e in experts:
            tok, j = (by_id == e).nonzero(as_tuple=True)
            tok_d, j_d = tok.to(x.device), j.to(x.device)
            terms[tok_d, j_d] = self.device.expert(self.slots, slot_of[e], self.layout, x[tok_d], w[tok_d, j_d, None],
                                                   self.limit)  # fmt: skip
        y = terms[:, 0].clone()
        for j in range(1, terms.shape[1]):
            y += terms[:, j]
        return y

    def _resident_first(self, layer: int, experts: list[int]) -> None:
        """Sort in place: resident experts first, pinned before any miss can evict them."""
        experts.sort(key=lambda e: ((layer, e) not in self.pool, e))

    def acquire_decode(self, layer: int, cols: list[int]) -> list[int]:
        """One token's routed experts (distinct ids) resident and pinned; their slots in routing column order. For
        a captured decode step (runtime/cuda/graph.py), whose kernels read the slots from a table; release() unpins
        them."""
        experts = list(cols)
        self._resident_first(layer, experts)
        slots = dict(zip(experts, self._acquire(layer, experts), strict=True))
        return [slots[e] for e in cols]

    def release(self, layer: int, experts: list[int]) -> None:
        for e in experts:
            self.pool.release((layer, e))

    def _acquire(self, layer: int, experts: list[int], cold: bool = False) -> list[int]:
        got = [self.pool.acquire((layer, e), cold) for e in experts]
        missing = [(e, slot) for e, (slot, hit) in zip(experts, got, strict=True) if not hit]
        done = 0
        try:
            if missing:
                t0 = time.perf_counter()
                fd, ranges = self._fd(layer), [self.store.shard_range(layer, e, self.rank) for e, _ in missing]
                for _, off, n in ranges:  # start the page-cache reads of all misses before copying the first
                    os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
                for (_, slot), (_, off, n) in zip(missing, ranges, strict=True):
                    self.device.load(self.slots, slot, fd, off, n)
                    self.bytes_copied += n
                    done += 1
                self.copy_s += time.perf_counter() - t0
        except BaseException:  # unfilled slots hold no expert: nothing may ever read them as a hit
            unfilled = {(layer, e) for e, _ in missing[done:]}
            for key in [(layer, e) for e in experts]:
                if key in unfilled:
                    self.pool.forget(key)
                else:
                    self.pool.release(key)
            raise
        return [slot for slot, _ in got]

    def _fd(self, layer: int) -> int:
        if layer not in self._fds:
            path, _, _ = self.store.shard_range(layer, 0, self.rank)
            self._fds[layer] = os.open(path, os.O_RDONLY)
        return self._fds[layer]

    def counters(self) -> ExpertCounters:
        """This rank's counters (its own bytes)."""
        pool = self.pool
        return ExpertCounters(pool.hits, pool.misses, pool.evictions, self.bytes_copied, self.copy_s)

    def zero_counters(self) -> None:
        self.pool.zero_counters()
        self.bytes_copied, self.copy_s = 0, 0.0

    def close(self) -> None:
        self.device.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self.routing_log is not None:
            self.routing_log.close()


def _token_indices(routed: torch.Tensor, experts: list[int], device: torch.device) -> list[tuple]:
    """(tokens, top-k columns) routed to each expert, computed on the host; on a GPU they travel in one copy, not
    one blocking copy per expert."""
    if routed.shape[0] == 1:  # decode: one token, whose top-k experts are distinct: plain views, no index tensors
        cols = routed[0].tolist()
        return [(slice(0, 1), cols.index(e)) for e in experts]
    found = [torch.where(routed == e) for e in experts]
    if device.type == "cpu":
        return found
    flat = torch.cat([torch.stack(f) for f in found], dim=1).to(device)
    return [(p[0], p[1]) for p in flat.split([len(f[0]) for f in found], dim=1)]
