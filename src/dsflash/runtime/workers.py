"""Tensor-parallel ranks: start them, drive them with fixed-shape step messages from rank 0, stop them.

Rank 0 lives in the serving process and owns the request loop. Ranks 1..N-1 are spawned processes, or, under
torchrun (any number of hosts), the other processes torchrun started: every `dsflash` command there becomes a
follower that takes the engine options from rank 0. Followers loop on a broadcast step header: forward / reset /
stop. A rank that dies breaks the next collective on rank 0, which then fails with EngineDead naming it: never a
hang (under torchrun, its agent also ends the others when one fails).

Step messages and start-up travel over a gloo group (host tensors and objects); the model's collectives over NCCL
when every rank has a GPU of its own, else over the same gloo group (runtime.rank.rank_device, model.parallel.TP).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from dsflash.checkpoint.index import Checkpoint
from dsflash.config import ModelConfig
from dsflash.errors import ConfigError, EngineDead
from dsflash.model.parallel import TP
from dsflash.runtime.rank import EngineOptions, RankRuntime, rank_device, resolve_device
from dsflash.runtime.torchrun import launched_rank, local_world
from dsflash.store.build import build_store

log = logging.getLogger(__name__)

FORWARD, RESET, STOP = 1, 2, 3
HEADER = 4  # op, start_pos, n tokens, last position's logits only
# a collective stuck this long means a peer hangs (a dead peer fails at once: its sockets close)
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads(opts: EngineOptions, world: int) -> int:
    return opts.threads or max(1, (os.cpu_count() or 1) // local_world(world))


def _join(rank: int, world: int, init_method: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)


def _model_group(device: str, rank: int, world: int) -> TP:
    """The TP context for the model's collectives (every rank calls this, in the same order).

    CPU ranks: the gloo group. CUDA ranks each on a GPU of their own: an NCCL group. CUDA ranks sharing a GPU (NCCL
    refuses that): the gloo group, with the collectives staged through host memory."""
    on_gpu = resolve_device(device) == "cuda"
    nccl = on_gpu and torch.cuda.device_count() >= local_world(world)
    if on_gpu:
        torch.cuda.set_device(rank_device(device, rank))
    group = dist.new_group(backend="nccl", timeout=COLLECTIVE_TIMEOUT) if nccl else None
    return TP.from_process_group(group, host_staging=on_gpu and not nccl)


def worker_main(rank: int, world: int, init_method: str, opts: EngineOptions, token_map, ready) -> None:
    """Entry point of spawned ranks 1..N-1: build this rank, report, then follow rank 0's steps until STOP."""
    torch.set_num_threads(_threads(opts, world))
    try:
        _join(rank, world, init_method)
        rt = RankRuntime(opts, _model_group(opts.device, rank, world), token_map)
    except BaseException as e:  # reported to rank 0 verbatim, then we exit
        ready.send(f"rank {rank}: {type(e).__name__}: {e}")
        return
    ready.send("ok")
    _follow_until_stopped(rt, rank)


def torchrun_follower() -> int:
    """Entry point of ranks 1..N-1 under torchrun, whatever command they were given: take the engine options from
    rank 0, build this rank (and this host's store, on its first local rank), report, follow. -> exit code."""
    rank, world, local_rank, _ = launched_rank()
    _join(rank, world, "env://")
    box = [None, None]  # rank 0 sends them once it has joined; if it fails before that, torchrun ends us
    dist.broadcast_object_list(box, src=0)
    opts, token_map = box
    torch.set_num_threads(_threads(opts, world))
    tp = _model_group(opts.device, rank, world)
    rt, status = None, "ok"
    try:
        if local_rank == 0:  # another host: its page cache serves its own copy of the store
            build_store(Checkpoint.open(opts.model_dir), opts.cache_dir, tp=world, fmt=opts.expert_format,
                        progress=False, rebuild=opts.rebuild_store)  # fmt: skip
        rt = RankRuntime(opts, tp, token_map)
    except Exception as e:
        status = f"rank {rank}: {type(e).__name__}: {e}"
    statuses: list = [None] * world
    dist.all_gather_object(statuses, status)
    if rt is None or any(s != "ok" for s in statuses):
        if rt is not None:
            rt.close()
        dist.destroy_process_group()
        return 1
    _follow_until_stopped(rt, rank)
    return 0


def _follow_until_stopped(rt: RankRuntime, rank: int) -> None:
    try:
        follow(rt)
    except RuntimeError as e:  # rank 0 went away mid-collective
        log.warning("rank %d: leaving: %s", rank, e)
    finally:
        rt.close()
        if dist.is_initialized():
            dist.destroy_process_group()


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


def check_tp(cfg: ModelConfig, world: int) -> None:
    """Refuse a degree the attention cannot be split by (heads are the unit); everything else pads."""
    if world < 1:
        raise ConfigError(f"tensor-parallel degree must be a positive integer, got {world}")
    if cfg.num_attention_heads % world:
        raise ConfigError(
            f"tensor-parallel degree {world} does not divide this model's {cfg.num_attention_heads} attention heads; "
            f"use one of {[d for d in (1, 2, 4, 8) if cfg.num_attention_heads % d == 0]}"
        )


class TPRunner:
    """The Engine's Runner over N ranks; rank 0 runs in this process. Under torchrun the other ranks are torchrun's
    processes (torchrun_follower); otherwise this spawns them."""

    def __init__(self, opts: EngineOptions, world: int, token_map, vocab_size: int):
        check_tp(ModelConfig.from_file(opts.model_dir), world)
        self.opts, self.world = opts, world
        self.max_len, self.vocab_size = opts.max_len, vocab_size
        self.procs: list[mp.process.BaseProcess] = []
        launched = launched_rank()
        if launched is not None:
            self._join_torchrun(launched, token_map)
            return
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        pipes = []
        for rank in range(1, world):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=worker_main,
                args=(rank, world, init, opts, token_map, child),
                daemon=True,
                name=f"dsflash-rank{rank}",
            )
            p.start()
            self.procs.append(p)
            pipes.append(parent)
        torch.set_num_threads(_threads(opts, world))
        try:
            if world > 1:
                _join(0, world, init)
                self.tp = _model_group(opts.device, 0, world)
            else:
                self.tp = TP.single()
            self.rank0 = RankRuntime(opts, self.tp, token_map)
            for rank, pipe in enumerate(pipes, start=1):
                msg = pipe.recv() if pipe.poll(600) else f"rank {rank}: did not start within 10 minutes"
                if msg != "ok":
                    raise EngineDead(f"tensor-parallel {msg}")
        except BaseException:
            self._kill()
            raise

    def _join_torchrun(self, launched: tuple[int, int, int, int], token_map) -> None:
        rank, size = launched[:2]
        if rank != 0 or size != self.world:
            raise ConfigError(
                f"torchrun started {size} processes; the engine's tensor-parallel degree is {self.world}: "
                "give --tp the same number as torchrun's processes in all"
            )
        _join(0, size, "env://")
        dist.broadcast_object_list([self.opts, token_map], src=0)
        self.tp = _model_group(self.opts.device, 0, size)
        status, error = "ok", None
        try:
            self.rank0 = RankRuntime(self.opts, self.tp, token_map)
        except Exception as e:
            status, error = f"rank 0: {type(e).__name__}: {e}", e
        statuses: list = [None] * size
        dist.all_gather_object(statuses, status)
        failed = [s for s in statuses if s != "ok"]
        if failed:
            if error is None:
                self.rank0.close()
            dist.destroy_process_group()
            if error is not None:
                raise error
            raise EngineDead(f"tensor-parallel {failed[0]}")

    def _step(self, op: int, start_pos: int = 0, n: int = 0, last_only: bool = False) -> None:
        if self.world == 1:
            return
        header = torch.tensor([op, start_pos, n, int(last_only)], dtype=torch.int64)
        try:
            dist.broadcast(header, src=0)
        except RuntimeError as e:
            raise self._dead(e) from None

    def _dead(self, err: Exception) -> EngineDead:
        gone = [f"rank {i} (exit code {p.exitcode})" for i, p in enumerate(self.procs, start=1) if not p.is_alive()]
        what = ", ".join(gone) if gone else "a tensor-parallel peer"
        return EngineDead(f"{what} stopped; the engine cannot continue ({err})")

    def reset(self) -> None:
        self._step(RESET)
        self.rank0.reset()

    def forward(self, tokens: list[int], start_pos: int, all_logits: bool) -> torch.Tensor:
        t = torch.tensor([tokens], dtype=torch.int64)
        self._step(FORWARD, start_pos, len(tokens), not all_logits)
        try:
            if self.world > 1:
                dist.broadcast(t, src=0)
            logits = self.rank0.forward(t, start_pos, not all_logits)[0].cpu()
        except RuntimeError as e:
            if self.world > 1 and any(not p.is_alive() for p in self.procs):
                raise self._dead(e) from None
            raise
        return logits

    def counters(self) -> dict:
        return self.rank0.counters()

    def check_alive(self) -> None:
        for i, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise EngineDead(f"rank {i} exited (code {p.exitcode})")

    def close(self) -> None:
        with contextlib.suppress(EngineDead):  # a dead peer needs no stop message
            self._step(STOP)
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
