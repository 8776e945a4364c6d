"""PrefixCache: rank 0's index of sequence snapshots by the tokens they hold (with the request's cache salt), the
longest-prefix lookup, and the byte budgets of host memory and disk, evicted least-recently-used. It decides; the
runner's ranks keep the bytes (each rank its own shard, runtime/prefix/shelf.py)."""

from __future__ import annotations

import hashlib
import logging
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from dsflash.runtime.prefix import files
from dsflash.runtime.prefix.shelf import Taken
from dsflash.runtime.spec import default_prefix_gb

log = logging.getLogger(__name__)

BLOCK = 512  # at most one snapshot per block boundary of a prompt, plus the ends of prompts and requests


class SnapshotRunner(Protocol):
    """What the cache asks of a runner (every rank does it for its own shard; bytes are summed over ranks)."""

    def snapshot_bytes(self, length: int) -> int: ...

    def snapshot(self, key: int, keep: bool, write: bool, tokens: tuple[int, ...], salt: str) -> Taken: ...

    def restore(self, key: int, length: int, from_disk: bool, keep: bool) -> bool: ...

    def drop(self, key: int, memory: bool, disk: bool) -> None: ...


def _packed(tokens) -> bytes:
    return array("I", tokens).tobytes()


def salt_digest(salt: str | None) -> str:
    """The salt as the index and the files keep it (a client's salt is not written to disk as it is)."""
    return "" if not salt else hashlib.sha256(salt.encode()).hexdigest()[:32]


def prefix_key(salt: str, tokens) -> int:
    """63 bits naming (salt digest, tokens): the files' names and the ranks' keys. A match is confirmed on the
    tokens themselves, so a collision costs a miss, never a wrong state."""
    h = hashlib.blake2b(salt.encode() + b"\0" + _packed(tokens), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


@dataclass
class Entry:
    key: int
    salt: str
    tokens: tuple[int, ...]
    memory: int = 0  # bytes on every rank together while in host memory, else 0
    disk: int = 0  # bytes of every rank's file while on disk, else 0
    used: int = 0  # the LRU clock when last saved or restored
    pins: int = 0  # > 0 while a restore reads it: never evicted then
    # the logits after the last token (rank 0, while in memory): a request for exactly these tokens (a regenerate,
    # the next of n choices) then starts sampling from them with nothing to prefill
    logits: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return len(self.tokens)


class PrefixCache:
    def __init__(self, runner: SnapshotRunner, memory_cap: int, disk_cap: int = 0, directory=None,
                 identity: dict | None = None, world: int = 1, block: int = BLOCK):  # fmt: skip
        self.runner, self.memory_cap, self.disk_cap, self.block = runner, memory_cap, disk_cap, block
        self.directory = Path(directory) if directory is not None else None
        self.identity, self.world = identity or {}, world
        self.entries: dict[int, Entry] = {}
        self._groups: dict[tuple[str, bytes], dict[int, int]] = {}  # (salt, hash of whole blocks) -> length -> key
        self._clock = 0
        self.disk_full = False
        self.counts = {"lookups": 0, "hit_tokens": 0, "evictions": 0}
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._index_disk()

    # ---- lookup and restore -------------------------------------------------------------------------------------
    def _chain(self, tokens, upto: int) -> list[bytes]:
        """Hashes of tokens[:k * block] for k = 0..upto // block."""
        h, out = hashlib.blake2b(digest_size=16), []
        for k in range(upto // self.block + 1):
            if k:
                h.update(_packed(tokens[(k - 1) * self.block : k * self.block]))
            out.append(h.copy().digest())
        return out

    def lookup(self, salt: str, prompt) -> Entry | None:
        """The whole prompt where it is held with its last logits, else the deepest snapshot whose tokens are a
        prefix of prompt and leave at least its last token to prefill (its logits start the generation)."""
        self.counts["lookups"] += 1
        whole = self.entries.get(prefix_key(salt, prompt))
        if whole is not None and whole.logits is not None and whole.memory and whole.tokens == tuple(prompt):
            return whole
        limit = len(prompt) - 1
        chain = self._chain(prompt, max(limit, 0))
        for k in range(len(chain) - 1, -1, -1):
            group = self._groups.get((salt, chain[k]), {})
            for n in sorted((n for n in group if n <= limit), reverse=True):
                e = self.entries[group[n]]
                if e.tokens == tuple(prompt[:n]):
                    return e
        return None

    def restore(self, entry: Entry) -> int:
        """Put the entry's state into the runner -> tokens restored (0 where it failed: the entry is gone)."""
        entry.pins += 1
        try:
            from_disk = entry.memory == 0
            need = self.runner.snapshot_bytes(entry.length) if from_disk else 0
            keep = from_disk and self._room_in_memory(need)
            ok = self.runner.restore(entry.key, entry.length, from_disk, keep)
        finally:
            entry.pins -= 1
        if not ok:
            self._forget(entry, drop=True)
            return 0
        if keep:
            entry.memory = need
        self._touch(entry)
        self.counts["hit_tokens"] += entry.length
        return entry.length

    # ---- saving -------------------------------------------------------------------------------------------------
    def save(self, salt: str, tokens, logits: torch.Tensor | None = None) -> None:
        """Snapshot the runner's state, which has consumed exactly `tokens`, unless that prefix is held already;
        logits: those after the last token, kept beside it while it is in memory."""
        tokens = tuple(tokens)
        key = prefix_key(salt, tokens)
        have = self.entries.get(key)
        if have is not None and have.tokens == tokens:
            self._touch(have)
            if logits is not None and have.memory and have.logits is None:
                self._keep_logits(have, logits)
            return
        if have is not None:  # a 63-bit collision: the newer prefix takes the name
            self._forget(have, drop=True)
        need = self.runner.snapshot_bytes(len(tokens))
        keep = self._room_in_memory(need)
        write = self.directory is not None and not self.disk_full and self._room_on_disk(need)
        if not (keep or write):
            return
        taken = self.runner.snapshot(key, keep, write, tokens, salt)
        entry = Entry(key, salt, tokens, memory=taken.memory, disk=taken.disk)
        if taken.disk_failed:  # some rank's file is missing: the others' are no use
            self.disk_full = self.disk_full or bool(taken.disk_full)
            self.runner.drop(key, memory=False, disk=True)
            entry.disk = 0
        if not (entry.memory or entry.disk):
            return
        self._add(entry)
        if logits is not None and entry.memory:
            self._keep_logits(entry, logits)
        self._room_in_memory(0)  # the estimate was short: evict the difference now
        self._room_on_disk(0)

    def _keep_logits(self, e: Entry, logits: torch.Tensor) -> None:
        e.logits = logits.detach().float().clone()
        e.memory += e.logits.numel() * e.logits.element_size()  # counted against the cap with the snapshot

    # ---- budgets ------------------------------------------------------------------------------------------------
    # tuple(): /metrics reads these from an HTTP thread while the engine thread changes the index
    @property
    def memory_bytes(self) -> int:
        return sum(e.memory for e in tuple(self.entries.values()))

    @property
    def disk_bytes(self) -> int:
        return sum(e.disk for e in tuple(self.entries.values()))

    def _room_in_memory(self, need: int) -> bool:
        """Evict least-recently-used snapshots from memory until `need` more bytes fit under the cap."""
        return self._room("memory", need, self.memory_cap)

    def _room_on_disk(self, need: int) -> bool:
        return self.directory is not None and self._room("disk", need, self.disk_cap)

    def _room(self, tier: str, need: int, cap: int) -> bool:
        """Evict from one tier (an Entry's `memory` or `disk` bytes) until `need` more fit under `cap`; an entry
        left in neither tier is forgotten, a pinned one is never evicted."""
        other = "disk" if tier == "memory" else "memory"
        if need > cap:
            return False
        while sum(getattr(e, tier) for e in tuple(self.entries.values())) + need > cap:
            victims = [e for e in self.entries.values() if getattr(e, tier) and not e.pins]
            if not victims:
                return False
            e = min(victims, key=lambda v: v.used)
            self.runner.drop(e.key, memory=tier == "memory", disk=tier == "disk")
            setattr(e, tier, 0)
            if tier == "memory":
                e.logits = None
            self.counts["evictions"] += 1
            if not getattr(e, other):
                self._forget(e, drop=False)
        return True

    # ---- the index ----------------------------------------------------------------------------------------------
    def _touch(self, e: Entry) -> None:
        self._clock += 1
        e.used = self._clock

    def _add(self, e: Entry) -> None:
        self._touch(e)
        self.entries[e.key] = e
        whole = e.length // self.block * self.block
        self._groups.setdefault((e.salt, self._chain(e.tokens, whole)[-1]), {})[e.length] = e.key

    def _forget(self, e: Entry, drop: bool) -> None:
        if drop:
            self.runner.drop(e.key, memory=True, disk=True)
        self.entries.pop(e.key, None)
        whole = e.length // self.block * self.block
        group = self._groups.get((e.salt, self._chain(e.tokens, whole)[-1]), {})
        group.pop(e.length, None)

    def _index_disk(self) -> None:
        """The snapshots a previous run left: rank 0's headers name them; a file that cannot be one of this
        engine's (foreign, truncated, half a set) is removed with one warning line. Payloads are checked by
        their checksums when restored."""
        found = []
        for path in sorted(self.directory.glob(f".*{files.SUFFIX}.*.tmp")):
            path.unlink(missing_ok=True)  # a write that a crash interrupted
        for path in sorted(self.directory.glob(f"*{files.SUFFIX}")):
            name = files.parse_name(path.name)
            if name is None or name[2] != self.world:
                files.remove(path, "not a snapshot of this engine's TP degree")
                continue
            key, rank, _ = name
            if rank != 0:
                if not (self.directory / files.file_name(key, 0, self.world)).exists():
                    files.remove(path, "its rank 0 file is missing")
                continue
            try:
                header, _ = files.read_header(path)
                files.check_identity(header, self.identity)
                tokens, salt = tuple(header.get("tokens") or ()), header.get("salt", "")
                if not tokens or prefix_key(salt, tokens) != key or header.get("length") != len(tokens):
                    raise files.BadFile("its tokens do not match its name")
                parts = [self.directory / files.file_name(key, r, self.world) for r in range(self.world)]
                if not all(p.exists() for p in parts):
                    raise files.BadFile("another rank's file is missing")
            except (files.BadFile, OSError) as e:
                for r in range(self.world):
                    p = self.directory / files.file_name(key, r, self.world)
                    (files.remove(p, str(e)) if r == 0 else p.unlink(missing_ok=True))
                continue
            found.append((path.stat().st_mtime, Entry(key, salt, tokens, disk=sum(p.stat().st_size for p in parts))))
        for _, e in sorted(found, key=lambda f: f[0]):  # oldest first: the LRU order of the last run
            self._add(e)
        self._room_on_disk(0)

    def stats(self) -> dict[str, float]:
        """The counters and sizes by service.api.PREFIX_METRICS's names."""
        return {  # service.api.PREFIX_METRICS
            "prefix_cache_lookups_total": self.counts["lookups"],
            "prefix_cache_hit_tokens_total": self.counts["hit_tokens"],
            "prefix_cache_evictions_total": self.counts["evictions"],
            "prefix_cache_memory_bytes": self.memory_bytes,
            "prefix_cache_disk_bytes": self.disk_bytes,
        }


def prefix_cache(runner, spec) -> PrefixCache | None:
    """The cache a spec asks for over a runner that keeps snapshots (None: reuse is off)."""
    identity = getattr(runner, "snapshot_identity", None)
    if not spec.prefix_cache or identity is None:
        return None
    gb = spec.prefix_cache_gb if spec.prefix_cache_gb is not None else default_prefix_gb()
    return PrefixCache(runner, int(gb * 1e9), int(spec.prefix_cache_disk_gb * 1e9), spec.prefix_cache_dir,
                       identity, world=spec.tp)  # fmt: skip
