"""Watched collectives: rank 0 waits for a gloo collective in slices and looks at its peers between them, so that a
peer that is gone fails the wait at once even where gloo itself would wait out the group's timeout."""

import multiprocessing as mp
import socket
import time
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dsflash.model import parallel
from dsflash.model.parallel import TP, collective


class PeerGone(RuntimeError):
    pass


def _peer(init: str, delay: float) -> None:
    """Rank 1: join, then enter one all_reduce after `delay` seconds (never, for a negative delay)."""
    dist.init_process_group("gloo", init_method=init, rank=1, world_size=2, timeout=timedelta(seconds=60))
    if delay < 0:
        time.sleep(120)
    time.sleep(delay)
    dist.all_reduce(torch.full((3,), 2.0))
    dist.destroy_process_group()


@pytest.fixture()
def group(monkeypatch):
    monkeypatch.setattr(parallel, "WAIT_SLICE", timedelta(milliseconds=200))
    started = []

    def start(delay: float):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        p = mp.get_context("spawn").Process(target=_peer, args=(init, delay), daemon=True)
        p.start()
        started.append(p)
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=2, timeout=timedelta(seconds=60))
        return p

    yield start
    for p in started:
        p.kill()
        p.join(5)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_watched_collective_ends_when_the_watch_says_the_peer_is_gone(group):
    group(-1)  # joined, alive for gloo (its sockets stay open), but never answers: what a lost send looks like
    looks = []

    def watch():
        looks.append(time.monotonic())
        if len(looks) == 3:
            raise PeerGone("rank 1 is gone")

    t0 = time.monotonic()
    with pytest.raises(PeerGone):
        replace(TP.from_process_group(None), watch=watch).all_reduce(torch.ones(3))
    assert time.monotonic() - t0 < 10  # the group's own timeout is 60 s
    assert len(looks) == 3


def test_a_watched_collective_waits_over_many_slices_for_a_slow_peer(group):
    group(1.5)  # 1.5 s late: several 0.2 s slices
    looks = []
    tp = replace(TP.from_process_group(None), watch=lambda: looks.append(1))
    assert tp.all_reduce(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
    assert len(looks) >= 3


def test_an_unwatched_collective_is_a_plain_blocking_call(group):
    group(0.5)
    x = torch.ones(3)
    collective(dist.all_reduce, x)
    assert x.tolist() == [3.0, 3.0, 3.0]
