"""CachedExperts over a real store: a copy that fails leaves no pinned slot and no slot that claims an expert; the
CPU device's two ways of filling a slot (mapping the store's pages, copying them) give the store's bytes."""

import os

import numpy as np
import pytest
import torch

from dsflash.checkpoint.index import Checkpoint
from dsflash.runtime.experts.cached import CachedExperts
from dsflash.runtime.experts.device import CpuDevice
from dsflash.store.build import build_store
from dsflash.store.reader import open_store


@pytest.fixture(params=["map", "copy"])
def experts(data_dir, tmp_path, request):
    ckpt = Checkpoint.open(data_dir / "dsv41_tiny" / "tiny_a" / "model")
    cfg = ckpt.config
    build_store(ckpt, tmp_path, tp=1, fmt="bfp8_b", progress=False, rebuild=True)
    store = open_store(ckpt, tmp_path, tp=1, fmt="bfp8_b")
    layer = next(s.layer_id for s in cfg.layers() if s.n_experts)
    cached = CachedExperts(store, CpuDevice(slot_fill=request.param), 4, 0, cfg.swiglu_limit)
    yield cached, layer, cfg.hidden_size
    cached.close()
    store.close()
    ckpt.close()


def test_failed_copy_is_forgotten_and_unpins(experts):
    cached, layer, dim = experts
    x, w = torch.randn(1, dim), torch.ones(1, 2)
    good = cached(layer, x, torch.tensor([[0, 1]]), w)
    path, _, _ = cached.store.shard_range(layer, 0, 0)
    fd = os.open(path, os.O_RDONLY)
    os.close(cached._fds.pop(layer))
    cached._fds[layer] = os.open(os.devnull, os.O_RDONLY)  # every read of this layer now ends at once
    with pytest.raises(OSError, match="ended early"):
        cached(layer, x, torch.tensor([[0, 2]]), w)  # 0 is resident, 2 must be copied and cannot be
    assert (layer, 2) not in cached.pool and (layer, 0) in cached.pool
    os.close(cached._fds.pop(layer))
    cached._fds[layer] = fd
    for _ in range(4):  # nothing stayed pinned: four new experts still find slots
        cached(layer, x, torch.tensor([[2, 3]]), w)
    torch.testing.assert_close(cached(layer, x, torch.tensor([[0, 1]]), w), good)


def test_large_copies_split_over_threads_arrive_whole(tmp_path):
    torch.set_num_threads(2)
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    path = tmp_path / "store.bin"
    data.tofile(path)
    dev = CpuDevice(slot_fill="copy")
    slots = dev.allocate(2, 3 << 20)
    fd = os.open(path, os.O_RDONLY)
    try:
        dev.load(slots, 1, fd, 0, 3 << 20)  # above SPLIT_COPY_BYTES: pieces on two threads
        assert np.array_equal(slots[1, : 3 << 20], data)
        with pytest.raises(OSError, match="ended early"):
            dev.load(slots, 0, fd, 1 << 20, 3 << 20)  # runs past the end of the file
    finally:
        os.close(fd)
        dev.close()


def _backing(addr: int) -> str:
    """What /proc/self/maps says backs the page at addr ('' for anonymous memory)."""
    with open("/proc/self/maps") as f:
        lines = f.read().splitlines()
    for line in lines:
        span, *rest = line.split(maxsplit=5)
        lo, hi = (int(a, 16) for a in span.split("-"))
        if lo <= addr < hi:
            return rest[4].strip() if len(rest) == 5 else ""
    raise AssertionError(f"{addr:#x} is not mapped")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")
def test_mapped_slots_are_the_store_and_copies_get_their_memory_back(tmp_path):
    """slot_fill map: the slot's pages are the store file's (no copy), an eviction re-maps the slot to another range,
    and a copy into a slot that was mapped gets writable memory of its own again; the neighbouring slot is untouched
    throughout and a range past the file's end is refused."""
    data = np.random.default_rng(0).integers(0, 256, 5 << 16, dtype=np.uint8)
    path = tmp_path / "store.bin"
    data.tofile(path)
    n = 3 << 16  # a whole number of pages: 3 x 64 KiB
    dev = CpuDevice()
    slots = dev.allocate(2, n)
    slots[0].fill(7)
    fd = os.open(path, os.O_RDONLY)
    try:
        dev.load(slots, 1, fd, 0, n)
        assert np.array_equal(slots[1, :n], data[:n]) and _backing(slots[1].ctypes.data) == str(path)
        dev.load(slots, 1, fd, 2 << 16, n)  # evicted and refilled: the slot now shows the other range
        assert np.array_equal(slots[1, :n], data[2 << 16 : (2 << 16) + n])
        dev.slot_fill = "copy"
        dev.load(slots, 1, fd, 1 << 16, n)
        assert _backing(slots[1].ctypes.data) != str(path)
        assert np.array_equal(slots[1, :n], data[1 << 16 : (1 << 16) + n])
        slots[1, 0] ^= 1  # its own memory again: writable
        assert (slots[0] == 7).all()
        dev.slot_fill = "map"
        with pytest.raises(OSError, match="ended early"):
            dev.load(slots, 0, fd, 3 << 16, n)
    finally:
        os.close(fd)
        dev.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")
def test_a_kernel_that_cannot_populate_falls_back_to_copies_and_a_failed_read_is_an_error(tmp_path, monkeypatch):
    """Without MADV_POPULATE_READ (EINVAL) the slot gets its own memory back and this and every later fill copy; a
    read error while populating is an OSError at the miss (the caller then forgets the slot), not a later SIGBUS."""
    import errno

    from dsflash.runtime.experts import filemap

    data = np.random.default_rng(0).integers(0, 256, 4 << 16, dtype=np.uint8)
    path = tmp_path / "store.bin"
    data.tofile(path)
    n = 2 << 16
    dev = CpuDevice()
    slots = dev.allocate(2, n)
    fd = os.open(path, os.O_RDONLY)
    monkeypatch.setattr(filemap, "_can_map", True)  # restored after the test
    try:
        monkeypatch.setattr(filemap, "_populate", lambda lib, addr, length: errno.EIO)
        with pytest.raises(OSError, match="EIO"):
            dev.load(slots, 0, fd, 0, n)
        monkeypatch.setattr(filemap, "_populate", lambda lib, addr, length: errno.EINVAL)
        dev.load(slots, 0, fd, 1 << 16, n)  # the slot that failed above is refilled, by a copy
        dev.load(slots, 1, fd, 2 << 16, n)
        assert not filemap._can_map  # mapping is off for the rest of the process
        for slot, start in ((0, 1 << 16), (1, 2 << 16)):
            assert np.array_equal(slots[slot, :n], data[start : start + n])
            assert _backing(slots[slot].ctypes.data) != str(path)
    finally:
        os.close(fd)
        dev.close()


def test_where_nothing_can_be_mapped_slots_are_copied(tmp_path, monkeypatch):
    """No libc mapping at all (not Linux): map mode copies, without trying to give back memory it never lent."""
    from dsflash.runtime.experts import filemap

    data = np.random.default_rng(1).integers(0, 256, 2 << 16, dtype=np.uint8)
    path = tmp_path / "store.bin"
    data.tofile(path)
    monkeypatch.setattr(filemap, "_lib", lambda: None)
    dev = CpuDevice()
    slots = dev.allocate(1, 1 << 16)
    fd = os.open(path, os.O_RDONLY)
    try:
        dev.load(slots, 0, fd, 1 << 16, 1 << 16)
        dev.load(slots, 0, fd, 0, 1 << 16)
        assert np.array_equal(slots[0, : 1 << 16], data[: 1 << 16])
    finally:
        os.close(fd)
        dev.close()


def test_token_indices_for_a_gpu_travel_together():
    """On a device the per-expert (token, column) indices are one transfer split per expert: same shapes, same
    order as the host's."""
    from dsflash.runtime.experts.cached import _token_indices

    routed = torch.tensor([[0, 2], [2, 1], [0, 1], [3, 2]])
    host = _token_indices(routed, [0, 1, 2, 3], torch.device("cpu"))
    assert [t.tolist() for t, _ in host] == [[0, 2], [1, 2], [0, 1, 3], [3]]
    moved = _token_indices(routed, [0, 1, 2, 3], torch.device("meta"))
    assert [(t.device.type, t.shape, k.shape) for t, k in moved] == [("meta", t.shape, k.shape) for t, k in host]
    # one token (decode): views of row 0 and the column of each expert, no index tensors
    assert _token_indices(torch.tensor([[3, 1]]), [1, 3], torch.device("meta")) == [(slice(0, 1), 1), (slice(0, 1), 0)]


def test_slot_count_clips_to_the_model_and_the_memory():
    from dsflash.errors import ConfigError
    from dsflash.runtime.tp.rank import DEFAULT_SLOTS, slot_count

    mb = 1 << 20
    assert slot_count(None, 10_000, mb, 10**6 * mb) == DEFAULT_SLOTS
    assert slot_count(None, 96, mb, 10**6 * mb) == 96  # nothing else to cache
    assert slot_count(None, 96, mb, 40 * mb + 1) == 40  # the default shrinks to fit
    assert slot_count(12, 96, mb, 12 * mb) == 12
    assert slot_count(500, 96, mb, 96 * mb) == 96  # an explicit count is clipped to the model first
    with pytest.raises(ConfigError, match="13 expert slots of 1.0 MB need 0.0 GB .* use --expert-slots 12 or fewer"):
        slot_count(13, 96, mb, 12 * mb)
    with pytest.raises(ConfigError, match="free some memory first"):
        slot_count(None, 96, mb, mb - 1)


def test_a_captured_decode_step_needs_a_tokens_experts_in_slots_together(data_dir):
    from dsflash.runtime.tp.rank import graph_slots_short

    cfg = Checkpoint.open(data_dir / "dsv41_tiny" / "tiny_b" / "model").config
    k = max(s.n_active for s in cfg.layers() if not s.is_dspark)
    assert k == 3 and graph_slots_short(k - 1, cfg) == k and graph_slots_short(1, cfg) == k
    assert graph_slots_short(k, cfg) == 0 and graph_slots_short(100, cfg) == 0


def test_a_batched_steps_tokens_get_their_solo_bits_whatever_was_resident(data_dir, tmp_path):
    """Three experts a token (tiny_b): each token of a batched decode step through CachedExperts equals the same token
    alone bit for bit. A token's experts are summed in expert id order whatever the slots held: the solo calls run
    on four slots (some of a token's experts missing each time, so resident-first order would differ), the batch
    on enough for all."""
    from dsflash.runtime.cpu import rows

    ckpt = Checkpoint.open(data_dir / "dsv41_tiny" / "tiny_b" / "model")
    cfg = ckpt.config
    spec = next(s for s in cfg.layers() if s.n_experts)
    build_store(ckpt, tmp_path, tp=1, fmt="bfp8_b", progress=False, rebuild=True)
    store = open_store(ckpt, tmp_path, tp=1, fmt="bfp8_b")
    few = CachedExperts(store, CpuDevice(), 4, 0, cfg.swiglu_limit)
    many = CachedExperts(store, CpuDevice(), spec.n_experts, 0, cfg.swiglu_limit)
    try:
        gen = torch.Generator().manual_seed(3)
        k = cfg.num_experts_per_tok
        x = torch.randn(6, cfg.hidden_size, generator=gen)
        ids = torch.stack([torch.randperm(spec.n_experts, generator=gen)[:k] for _ in range(6)])
        w = torch.rand(6, k, generator=gen)
        with rows.decoding():
            batch = many(spec.layer_id, x, ids, w)
        for t in range(6):
            alone = few(spec.layer_id, x[t : t + 1], ids[t : t + 1], w[t : t + 1])
            assert torch.equal(batch[t], alone[0]), t
        assert few.pool.misses > 6  # the solo calls did run with a changing resident set
    finally:
        few.close()
        many.close()
        store.close()
        ckpt.close()
