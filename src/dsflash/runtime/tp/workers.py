"""Tensor-parallel ranks: start them, drive them with fixed-shape step messages from rank 0, stop them.

Rank 0 lives in the serving process and owns the request loop. Ranks 1..N-1 are spawned processes, or, under
torchrun (any number of hosts), the other processes torchrun started: every `dsflash` command there becomes a
follower that takes the engine options from rank 0. Followers loop on a broadcast step header: forward / reset /
stop, and snapshot / restore / drop of the decode state by a key (each rank keeps its own shard's snapshots; a
small all-reduce sums their bytes, or agrees that every rank could load its part). A rank that dies breaks the
next collective on rank 0, which then fails with EngineDead naming it: never a hang (under torchrun, its agent
also ends the others when one fails). A step that fails on a living rank (an allocation that fails in a long
prefill) fails alone: every rank leaves the gloo group, which ends the collectives the others wait in, tells rank 0
why over its pipe and joins the group rank 0 starts anew; rank 0 raises the cause for that step's request
(RankFailed) and the engine goes on. NCCL groups and torchrun's ranks cannot be rebuilt that way: there a failed
step still ends the engine.

Step messages and start-up travel over a gloo group (host tensors and objects); the model's collectives over NCCL
when every rank has a GPU of its own, else over the same gloo group (runtime.tp.rank.rank_device, model.parallel.TP).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from dsflash.checkpoint.index import Checkpoint
from dsflash.config import ModelConfig
from dsflash.counters import ExpertCounters
from dsflash.errors import ConfigError, DsflashError, EngineDead
from dsflash.model.parallel import TP, collective
from dsflash.runtime.prefix.shelf import Shelf, Taken, state_bytes
from dsflash.runtime.spec import EngineSpec, check_tp
from dsflash.runtime.tp.rank import RankRuntime, rank_device
from dsflash.runtime.tp.torchrun import launched_rank, local_world
from dsflash.store.build import build_store

log = logging.getLogger(__name__)

FORWARD, RESET, STOP, SNAPSHOT, RESTORE, DROP, SELECT, DECODE = 1, 2, 3, 4, 5, 6, 7, 8
VERIFY, ACCEPT, DRAFT = 9, 10, 11  # speculative decoding; VERIFY: as FORWARD; ACCEPT: op, 0, n kept; DRAFT: below
NOOP = 12  # an idle engine's keep-alive (TPRunner._keep_alive)
# op, start_pos, n tokens, last position's logits only; snapshot ops: op, length, key, flags; SELECT: op, sequence
# slot; DECODE: op, 0, B (then a [3, B] tensor: tokens, positions, sequence slots)
HEADER = 4
KEEP, WRITE, FROM_DISK, MEMORY, DISK = 1, 2, 4, 8, 16  # the snapshot ops' flags
# a collective stuck this long means a peer hangs (a dead peer fails at once: its sockets close);
# $DSFLASH_COLLECTIVE_TIMEOUT_S sets it (tests), read when a rank joins
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
# an idle engine sends a step at least this often, and 4 times per collective timeout where that is shorter
KEEPALIVE_S = 60.0
# after a failed step, how long each rank has to reach its next collective and report (one layer's work at most)
REPORT_TIMEOUT_S = 120


class RankFailed(RuntimeError):
    """A step failed on a rank that lives on; the ranks have rejoined, and only that step's request fails."""


def _link_broken(e: BaseException) -> bool:
    """A collective that ended because a peer left the group, not this rank's own failure."""
    return isinstance(e, RuntimeError) and "gloo/transport" in str(e)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_timeout() -> timedelta:
    seconds = os.environ.get("DSFLASH_COLLECTIVE_TIMEOUT_S")
    return timedelta(seconds=float(seconds)) if seconds else COLLECTIVE_TIMEOUT


def _join(rank: int, world: int, init_method: str) -> None:
    timeout = _collective_timeout()
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=timeout)


def _model_group(device: str, rank: int, world: int) -> TP:
    """The TP context for the model's collectives (every rank calls this, in the same order).

    CPU ranks: the gloo group. CUDA ranks each on a GPU of their own: an NCCL group. CUDA ranks sharing a GPU (NCCL
    refuses that): the gloo group, with the collectives staged through host memory."""
    on_gpu = device == "cuda"
    nccl = on_gpu and torch.cuda.device_count() >= local_world(world)
    if on_gpu:
        torch.cuda.set_device(rank_device(device, rank))
    group = dist.new_group(backend="nccl", timeout=_collective_timeout()) if nccl else None
    return TP.from_process_group(group, host_staging=on_gpu and not nccl)


def worker_main(rank: int, world: int, init_method: str, job: tuple, token_map, ready) -> None:
    """Entry point of spawned ranks 1..N-1: build this rank, report, then follow rank 0's steps until STOP."""
    model_dir, max_len, spec = job
    torch.set_num_threads(spec.threads)
    try:
        _join(rank, world, init_method)
        rt = RankRuntime.build(model_dir, max_len, spec, _model_group(spec.device, rank, world), token_map)
    except BaseException as e:  # reported to rank 0 verbatim, then we exit
        ready.send(f"rank {rank}: {type(e).__name__}: {e}")
        return
    ready.send("ok")
    # an NCCL group cannot be rebuilt in place (rank 0 ends the engine instead): leave after a failed step
    _follow_until_stopped(rt, rank, (world, ready) if rt.tp.group is None else None)


def torchrun_follower() -> int:
    """Entry point of ranks 1..N-1 under torchrun, whatever command they were given: take the engine options from
    rank 0, build this rank (and this host's store, on its first local rank), report, follow. -> exit code."""
    rank, world, local_rank, _ = launched_rank()
    _join(rank, world, "env://")
    box = [None, None]  # rank 0 sends them once it has joined; if it fails before that, torchrun ends us
    dist.broadcast_object_list(box, src=0)
    (model_dir, max_len, spec), token_map = box
    torch.set_num_threads(spec.threads)
    tp = _model_group(spec.device, rank, world)
    rt = RankRuntime(model_dir, max_len, spec, tp, token_map)

    def dense() -> None:
        if local_rank == 0:  # another host: its page cache serves its own copy of the store
            build_store(Checkpoint.open(model_dir), spec.cache_dir, tp=world, fmt=spec.expert_format,
                        progress=False, rebuild=spec.rebuild_store)  # fmt: skip
        rt.load_dense()

    # the same two steps as rank 0, each ending in a gather of every rank's status (TPRunner._torchrun_step)
    for step in (dense, rt.allocate):
        if any(s != "ok" for s in _gather_status(rank, world, step)[0]):
            rt.close()
            dist.destroy_process_group()
            return 1
    _follow_until_stopped(rt, rank)
    return 0


def _gather_status(rank: int, world: int, step) -> tuple[list, Exception | None]:
    """Run step() on this rank, then gather every rank's outcome ("ok" or the error) -> (statuses, this error)."""
    status, error = "ok", None
    try:
        step()
    except Exception as e:
        status, error = f"rank {rank}: {type(e).__name__}: {e}", e
    statuses: list = [None] * world
    dist.all_gather_object(statuses, status)
    return statuses, error


def _follow_until_stopped(rt: RankRuntime, rank: int, rejoin: tuple | None = None) -> None:
    """follow() until STOP; after a failed step, rejoin (world, pipe to rank 0) where given, else leave."""
    try:
        while True:
            try:
                follow(rt)
                return
            except Exception as e:
                if rejoin is None or not _rejoin(rank, *rejoin, e):
                    log.warning("rank %d: leaving: %s", rank, e)
                    return
    finally:
        rt.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _rejoin(rank: int, world: int, pipe, e: Exception) -> bool:
    """Leave the group (every rank waiting in one of its collectives fails at once), tell rank 0 what failed, join
    the group it starts anew -> False where rank 0 is gone or says stop."""
    try:
        dist.destroy_process_group()
        pipe.send(("link" if _link_broken(e) else "failed", f"rank {rank}: {type(e).__name__}: {e}"))
        init = pipe.recv()
        if init is None:
            return False
        _join(rank, world, init)
    except Exception as err:  # rank 0 gone, or this rank cannot even report: leave (rank 0 sees it exit)
        log.warning("rank %d: cannot rejoin after %s: %s", rank, e, err)
        return False
    return True


def follow(rt: RankRuntime) -> None:
    header = torch.zeros(HEADER, dtype=torch.int64)
    while True:
        dist.broadcast(header, src=0)
        op, start_pos, n, last_only = (int(v) for v in header)
        if op == STOP:
            return
        if op == RESET:
            rt.reset()
        elif op == FORWARD:
            tokens = torch.empty(1, n, dtype=torch.int64)
            dist.broadcast(tokens, src=0)
            rt.forward(tokens, start_pos, bool(last_only))
        elif op == VERIFY:
            tokens = torch.empty(1, n, dtype=torch.int64)
            dist.broadcast(tokens, src=0)
            rt.verify(tokens, start_pos)
        elif op == ACCEPT:
            rt.accept(n)
        elif op == DRAFT:  # op, position, k, token; then the draws' (temperature, top_k, top_p, min_p, seed, index)
            sampling = torch.empty(6, dtype=torch.float64)
            dist.broadcast(sampling, src=0)
            rt.draft(last_only, start_pos, n, _sampling(sampling))
        elif op == SELECT:
            rt.select(start_pos)
        elif op == DECODE:
            batch = torch.empty(3, n, dtype=torch.int64)
            dist.broadcast(batch, src=0)
            tokens, positions, seqs = (row.tolist() for row in batch)
            rt.decode(tokens, positions, seqs)
        elif op == SNAPSHOT:
            _snapshot(rt.shelf, n, last_only)
        elif op == RESTORE:
            _restore(rt.shelf, n, start_pos, last_only, rt.speculation)
        elif op == DROP:
            rt.shelf.drop(n, memory=bool(last_only & MEMORY), disk=bool(last_only & DISK))
        # NOOP: nothing; the header itself kept this rank's wait short of the timeout


def _sampling(t: torch.Tensor) -> tuple:
    temperature, top_k, top_p, min_p, seed, index = t.tolist()
    return temperature, int(top_k), top_p, min_p, int(seed), int(index)


def _snapshot(shelf: Shelf, key: int, flags: int, tokens=None, salt: str = "") -> Taken:
    """Every rank snapshots its shard; -> the costs summed over ranks (rank 0's file also names the tokens)."""
    t = shelf.take(key, bool(flags & KEEP), bool(flags & WRITE), tokens, salt)
    v = torch.tensor([t.memory, t.disk, t.disk_full, t.disk_failed], dtype=torch.int64)
    if shelf.world > 1:
        dist.all_reduce(v)
    return Taken(*(int(x) for x in v))


def _restore(shelf: Shelf, key: int, length: int, flags: int, speculation=None) -> bool:
    """Every rank loads and checks its shard; only if all can does any rank's state change."""
    snap = shelf.load(key, length, bool(flags & FROM_DISK))
    ok = torch.tensor([int(snap is not None)], dtype=torch.int64)
    if shelf.world > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not int(ok):
        return False
    shelf.apply(key, snap, length, keep=bool(flags & KEEP))
    if speculation is not None:  # the taps it holds are another sequence's
        speculation.reset()
    return True


class TPRunner:
    """The Engine's Runner over N ranks; rank 0 runs in this process. Under torchrun the other ranks are torchrun's
    processes (torchrun_follower); otherwise this spawns them. Built in two steps, as the boot's phases: the
    constructor starts the ranks and loads rank 0's dense shard (the others load theirs meanwhile), `allocate()`
    gives every rank its decode state, slots and graphs and waits until all are ready."""

    def __init__(self, model_dir: str, max_len: int, spec: EngineSpec, token_map):
        if not spec.resolved:
            raise ConfigError("the ranks start from a resolved engine spec (runtime.spec.resolve)")
        cfg = ModelConfig.from_file(model_dir)
        check_tp(cfg, spec.tp)
        self.spec, self.world = spec, spec.tp
        self.max_len, self.vocab_size = max_len, cfg.vocab_size
        self.n_seqs = spec.max_num_seqs  # sequence slots: select() / decode() address them
        self.procs: list[mp.process.BaseProcess] = []
        self._pipes: list = []
        self.closed = False
        # steps come from the engine thread, keep-alives from their own: one at a time over the group
        self._lock = threading.RLock()
        self._last_step = time.monotonic()
        self._closing = threading.Event()
        self._keeper: threading.Thread | None = None
        job = (model_dir, max_len, spec)
        launched = launched_rank()
        if launched is not None:
            self._join_torchrun(launched, job, token_map)
            return
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        for rank in range(1, self.world):
            parent, child = ctx.Pipe()  # start-up report, then failed steps
            p = ctx.Process(
                target=worker_main,
                args=(rank, self.world, init, job, token_map, child),
                daemon=True,
                name=f"dsflash-rank{rank}",
            )
            p.start()
            self.procs.append(p)
            self._pipes.append(parent)
        torch.set_num_threads(spec.threads)
        try:
            if self.world > 1:
                _join(0, self.world, init)
                self.tp = replace(_model_group(spec.device, 0, self.world), watch=self._watch)
            else:
                self.tp = TP.single()
            self.rank0 = RankRuntime(model_dir, max_len, spec, self.tp, token_map)
            self.rank0.load_dense()
        except BaseException:
            self._kill()
            raise

    def allocate(self) -> None:
        """Every rank's decode state, slot pool and graphs; returns once every rank is ready to run."""
        if launched_rank() is not None:
            self._torchrun_step(self.rank0.allocate)
        else:
            try:
                self.rank0.allocate()
                for rank, pipe in enumerate(self._pipes, start=1):
                    msg = pipe.recv() if pipe.poll(600) else f"rank {rank}: did not start within 10 minutes"
                    if msg != "ok":
                        raise EngineDead(f"tensor-parallel {msg}")
            except BaseException as e:
                failed = self._reported_failure()  # a rank that failed to build ends rank 0's collectives: say why
                self._kill()
                if failed is not None and not isinstance(e, EngineDead):
                    raise EngineDead(f"tensor-parallel {failed}") from e
                raise
        if self.world > 1:
            self._last_step = time.monotonic()
            self._keeper = threading.Thread(target=self._keep_alive, name="dsflash-tp-keepalive", daemon=True)
            self._keeper.start()

    def _keep_alive(self) -> None:
        """The followers wait for the next step in a collective that fails after the group's timeout: a server idle
        that long would lose its next request. An idle engine sends an empty step well before."""
        every = min(KEEPALIVE_S, _collective_timeout().total_seconds() / 4)
        while not self._closing.wait(every / 2):
            with self._lock:
                if self.closed or time.monotonic() - self._last_step < every:
                    continue
                try:
                    self._guarded(NOOP, 0, 0, 0, None, lambda: None)
                except EngineDead as e:  # the engine's next step reports it
                    log.warning("tensor-parallel keep-alive: %s", e)
                    return
                except Exception as e:  # a failed step the ranks rejoined after: go on
                    log.warning("tensor-parallel keep-alive: %s", e)

    def _reported_failure(self) -> str | None:
        for pipe in self._pipes:
            try:
                if pipe.poll(1):
                    msg = pipe.recv()
                    if msg != "ok":
                        return msg
            except (EOFError, OSError):
                continue
        return None

    def _join_torchrun(self, launched: tuple[int, int, int, int], job: tuple, token_map) -> None:
        rank, size = launched[:2]
        if rank != 0 or size != self.world:
            raise ConfigError(
                f"torchrun started {size} processes; the engine's tensor-parallel degree is {self.world}: "
                "give --tp the same number as torchrun's processes in all"
            )
        _join(0, size, "env://")
        dist.broadcast_object_list([job, token_map], src=0)
        torch.set_num_threads(self.spec.threads)
        self.tp = _model_group(self.spec.device, 0, size)
        self.rank0 = RankRuntime(*job, self.tp, token_map)
        self._torchrun_step(self.rank0.load_dense)

    def _torchrun_step(self, step) -> None:
        """One build step on rank 0 with every follower doing the same (torchrun_follower), then their statuses."""
        statuses, error = _gather_status(0, self.world, step)
        failed = [s for s in statuses if s != "ok"]
        if failed:
            self.rank0.close()
            dist.destroy_process_group()
            if error is not None:
                raise error
            raise EngineDead(f"tensor-parallel {failed[0]}")

    def _step(self, op: int, start_pos: int = 0, n: int = 0, last_only: int = 0) -> None:
        if self.world == 1:
            return
        header = torch.tensor([op, start_pos, n, int(last_only)], dtype=torch.int64)
        self._broadcast(header)

    def _broadcast(self, t: torch.Tensor) -> None:
        collective(dist.broadcast, t, src=0, watch=self._watch if self.procs else None)

    def _watch(self) -> None:
        """Between slices of a collective: raise EngineDead where a rank this process spawned has exited."""
        if any(not p.is_alive() for p in self.procs):
            raise self._dead(RuntimeError("it exited while rank 0 waited for it in a collective"))

    def _guarded(self, op: int, a: int, n: int, flag: int, payload, run):
        """Header, payload broadcast (if any), then rank 0's own call; a failure on any rank -> _failed()."""
        with self._lock:
            self._last_step = time.monotonic()
            try:
                self._step(op, a, n, flag)
                if self.world > 1 and payload is not None:
                    self._broadcast(payload)
                return run()
            except EngineDead:
                raise
            except Exception as e:
                if self.world == 1:
                    raise
                raise self._failed(e) from e

    def _failed(self, e: Exception) -> Exception:
        """A step failed on some rank: EngineDead where a rank is gone or the group cannot be rebuilt (NCCL,
        torchrun); otherwise every rank joins a new group and the step's cause comes back as RankFailed."""
        if any(not p.is_alive() for p in self.procs) or not self._pipes or self.tp.group is not None:
            return self._dead(e)
        dist.destroy_process_group()  # ends the collectives the other ranks wait in
        causes = [] if _link_broken(e) else [f"rank 0: {type(e).__name__}: {e}"]
        for rank, pipe in enumerate(self._pipes, start=1):
            try:
                kind, text = pipe.recv() if pipe.poll(REPORT_TIMEOUT_S) else (None, None)
            except (EOFError, OSError):
                kind = None
            if kind is None:
                self._kill()
                return EngineDead(f"rank {rank} did not report after a failed step; the engine cannot continue ({e})")
            if kind == "failed":
                causes.append(text)
        init = f"tcp://127.0.0.1:{_free_port()}"
        for pipe in self._pipes:
            pipe.send(init)
        _join(0, self.world, init)
        cause = causes[0] if causes else f"a tensor-parallel step failed: {e}"
        log.warning("tensor-parallel step failed (%s); the ranks rejoined and the engine goes on", cause)
        return RankFailed(cause)

    def _dead(self, err: Exception) -> EngineDead:
        gone = [f"rank {i} (exit code {p.exitcode})" for i, p in enumerate(self.procs, start=1) if not p.is_alive()]
        what = ", ".join(gone) if gone else "a tensor-parallel peer"
        return EngineDead(f"{what} stopped; the engine cannot continue ({err})")

    def reset(self) -> None:
        self._guarded(RESET, 0, 0, 0, None, self.rank0.reset)

    def forward(self, tokens: list[int], start_pos: int, all_logits: bool) -> torch.Tensor:
        t = torch.tensor([tokens], dtype=torch.int64)
        return self._guarded(
            FORWARD, start_pos, len(tokens), not all_logits, t,
            lambda: self.rank0.forward(t, start_pos, not all_logits)[0].cpu(),
        )  # fmt: skip

    def select(self, seq: int) -> None:
        """The sequence slot every rank's reset / forward / snapshot / restore apply to from now on."""
        if not 0 <= seq < self.n_seqs:
            raise ValueError(f"sequence slot {seq} outside 0..{self.n_seqs - 1}")
        self._guarded(SELECT, seq, 0, 0, None, lambda: self.rank0.select(seq))

    def decode(self, tokens: list[int], positions: list[int], seqs: list[int]) -> torch.Tensor:
        """One decode token for each of several sequence slots, on every rank -> fp32 logits [B, V]."""
        batch = torch.tensor([tokens, positions, seqs], dtype=torch.int64)
        return self._guarded(DECODE, 0, len(tokens), 0, batch, lambda: self.rank0.decode(tokens, positions, seqs).cpu())

    # ---- speculative decoding (runtime/scheduler/speculative.py): every rank drafts and verifies ----
    @property
    def draft_block(self) -> int:
        return self.rank0.cfg.dspark_block_size

    def verify(self, tokens: list[int], start_pos: int) -> torch.Tensor:
        """A forward of tokens at start_pos with all logits [s, V], revocable until accept()."""
        t = torch.tensor([tokens], dtype=torch.int64)
        return self._guarded(VERIFY, start_pos, len(tokens), 0, t, lambda: self.rank0.verify(t, start_pos)[0].cpu())

    def accept(self, n_keep: int) -> None:
        """Keep the first n_keep positions of the last verify on every rank; drop the rest exactly."""
        self._guarded(ACCEPT, 0, n_keep, 0, None, lambda: self.rank0.accept(n_keep))

    def draft(
        self, token: int, pos: int, k: int, sampling: tuple
    ) -> tuple[list[int], torch.Tensor, list[float]] | None:
        """Up to k DSpark drafts after token at pos -> (ids, logits [k, V], confidence [k]), or None where none can
        start."""
        t = torch.tensor(sampling, dtype=torch.float64)
        out = self._guarded(DRAFT, pos, k, token, t, lambda: self.rank0.draft(token, pos, k, _sampling(t)))
        return None if out is None else (out[0].tolist(), out[1].cpu(), out[2].tolist())

    # ---- prefix snapshots (runtime/prefix/cache.SnapshotRunner) ----
    @property
    def snapshot_identity(self) -> dict | None:
        return None if self.rank0.shelf is None else self.rank0.shelf.identity

    def snapshot_bytes(self, length: int) -> int:
        """Estimated bytes of a snapshot of `length` tokens on every rank (their states have the same shapes)."""
        return state_bytes(self.rank0.state, length) * self.world

    def snapshot(self, key: int, keep: bool, write: bool, tokens, salt: str) -> Taken:
        flags = KEEP * keep | WRITE * write
        run = lambda: _snapshot(self.rank0.shelf, key, flags, tokens, salt)  # noqa: E731
        return self._guarded(SNAPSHOT, 0, key, flags, None, run)

    def restore(self, key: int, length: int, from_disk: bool, keep: bool) -> bool:
        flags = FROM_DISK * from_disk | KEEP * keep
        run = lambda: _restore(self.rank0.shelf, key, length, flags, self.rank0.speculation)  # noqa: E731
        return self._guarded(RESTORE, length, key, flags, None, run)

    def drop(self, key: int, memory: bool, disk: bool) -> None:
        flags = MEMORY * memory | DISK * disk
        self._guarded(DROP, 0, key, flags, None, lambda: self.rank0.shelf.drop(key, memory, disk))

    def counters(self) -> ExpertCounters:
        """Rank 0's lookups (every rank makes the same slot choices), the bytes of all ranks."""
        return self.rank0.counters().scaled_bytes(self.world)

    def check_alive(self) -> None:
        for i, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise EngineDead(f"rank {i} exited (code {p.exitcode})")

    def close(self) -> None:
        if self.closed:  # once: a failed step closes the ranks, and its caller's cleanup may close them again
            return
        self._closing.set()
        if self._keeper is not None:
            self._keeper.join()
        self.closed = True
        with contextlib.suppress(RuntimeError, DsflashError):  # a dead peer needs no stop message
            self._step(STOP)
        for pipe in self._pipes:  # a rank waiting to rejoin after a failed step nobody noticed: leave
            with contextlib.suppress(OSError):
                pipe.send(None)
        for p in self.procs:
            p.join(timeout=30)
        self._kill()
        self.rank0.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
