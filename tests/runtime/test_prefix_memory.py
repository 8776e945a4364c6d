"""The memory budget: with a small --prefix-cache-gb snapshots are evicted least-recently-used, the cache's bytes
stay under the cap, and so does the process's resident memory beyond what it held before."""

from __future__ import annotations

import os

from dsflash.runtime.prefix.cache import PrefixCache
from dsflash.runtime.reference.runner import ModelRunner
from tests.runtime.test_prefix_disk import reference  # noqa: F401 (the module's fixture)

CAP = 24_000_000
LENGTH = 3000  # a snapshot of 3000 tokens of the tiny model is ~2.4 MB: 60 of them would hold 6x the cap


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_small_cap_evicts_and_resident_memory_stays_within_it(reference):  # noqa: F811
    runner = ModelRunner(reference, max_len=4096)
    cache = PrefixCache(runner, CAP)
    per = runner.snapshot_bytes(LENGTH)
    # the state's contents do not change a snapshot's size: each prefix "consumed" LENGTH tokens of its own
    runner.state.length = LENGTH
    cache.save("", tuple(range(LENGTH)))  # the first snapshot's allocations (and the allocator's own) happen here
    cache.runner.drop(next(iter(cache.entries)), memory=True, disk=False)
    cache.entries.clear()
    before = rss()
    for i in range(60):
        cache.save("", (i + 1, *range(LENGTH - 1)))
        assert cache.memory_bytes <= CAP
    grown = rss() - before
    assert cache.counts["evictions"] >= 60 - CAP // per
    assert len(runner.shelf.memory) == len(cache.entries) == CAP // per  # the ranks hold exactly what is indexed
    assert grown <= CAP + 8_000_000, f"resident memory grew {grown / 1e6:.1f} MB under a {CAP / 1e6:.0f} MB cap"
    # the newest prefixes are the ones kept
    assert sorted(e.tokens[0] for e in cache.entries.values()) == list(range(61 - CAP // per, 61))


def test_cpu_slots_leave_the_prefix_cache_its_memory():
    from dsflash.runtime.spec import EngineSpec
    from dsflash.runtime.tp.rank import prefix_reserve

    assert prefix_reserve(EngineSpec(tp=2, prefix_cache_gb=2.0)) == 2_000_000_000  # both ranks on this host
    assert prefix_reserve(EngineSpec(prefix_cache=False, prefix_cache_gb=2.0)) == 0
