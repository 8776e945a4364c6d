"""Snapshot files: truncated, corrupted and foreign files (and stray names) are found, warned about once, removed, and
never change an answer; a full disk stops the writing, not the requests; the disk budget evicts."""

from __future__ import annotations

import errno
import logging

import pytest

from dsflash.runtime.prefix import files as snapfiles
from dsflash.runtime.prefix.cache import PrefixCache
from dsflash.runtime.reference.runner import ModelRunner
from tests.runtime.test_prefix import BLOCK, completion_turns, run_with

IDENTITY = {"model": "tiny_a", "backend": "reference"}


@pytest.fixture(scope="module")
def reference():
    from dsflash.runtime.reference.loader import load_reference
    from dsflash.service.files import open_dir
    from tests.model.conftest import ROOT

    files = open_dir(ROOT / "tiny_a" / "model")
    return load_reference(files.ckpt, files.token_map, dspark=False, qat=False)


def cache_over(reference, directory, disk_cap=1 << 30):
    runner = ModelRunner(reference, max_len=512, identity=IDENTITY, snapshot_dir=directory)
    return runner, PrefixCache(runner, 1 << 30, disk_cap, directory, IDENTITY, block=BLOCK)


def answers(turns):
    return [t[0] for t in turns]


@pytest.fixture(scope="module")
def plain(reference):
    runner = ModelRunner(reference, max_len=512)
    return answers(run_with(runner, None, completion_turns))


def test_bad_files_are_warned_once_removed_and_change_nothing(reference, plain, tmp_path, caplog):
    d = tmp_path / "snaps"
    run_with(*cache_over(reference, d), completion_turns)
    by_length = {snapfiles.read_header(p)[0]["length"]: p for p in d.glob("*.snap")}
    # the second turn (129 tokens) restores its block boundary at 128 first; the first turn would restore 64
    corrupted, truncated, foreign = by_length[128], by_length[64], by_length[max(by_length)]
    raw = bytearray(corrupted.read_bytes())
    raw[-3] ^= 0x55  # a payload byte: only the checksum can tell
    corrupted.write_bytes(bytes(raw))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    header, offset = snapfiles.read_header(foreign)
    tensors = snapfiles.read(foreign, IDENTITY, int(header["key"], 16))[1]
    snapfiles.write(foreign, tensors, {**header, "identity": {**IDENTITY, "model": "another"}})
    (d / "junk.snap").write_bytes(b"not a snapshot")

    caplog.set_level(logging.WARNING, logger="dsflash.runtime.prefix")
    runner, cache = cache_over(reference, d)
    assert not truncated.exists() and not foreign.exists() and not (d / "junk.snap").exists()
    got = run_with(runner, cache, completion_turns)
    assert answers(got) == plain
    # found when the second turn restored it, removed, and written again whole by that turn's prefill
    assert snapfiles.read(corrupted, IDENTITY, snapfiles.parse_name(corrupted.name)[0])
    # the second turn then fell back to the next deepest snapshot (the first request's end: 91 + 7 fed tokens)
    assert [t[1] for t in got] == [0, 98, 136, 192]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for path, why in ((truncated, "truncated"), (foreign, "another model"), (corrupted, "checksum"),
                      (d / "junk.snap", "TP degree")):  # fmt: skip
        lines = [w for w in warned if str(path) in w]
        assert len(lines) == 1 and why in lines[0], (path, warned)


def test_a_full_disk_stops_writing_and_requests_go_on(reference, plain, tmp_path, monkeypatch, caplog):
    real_open, writes = open, []

    def full_disk_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        if "w" in mode:
            writes.append(path)

            class Full:
                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    f.close()

                def write(self, data):
                    raise OSError(errno.ENOSPC, "No space left on device")

            return Full()
        return f

    monkeypatch.setattr(snapfiles, "open", full_disk_open, raising=False)
    caplog.set_level(logging.WARNING, logger="dsflash.runtime.prefix")
    d = tmp_path / "snaps"
    runner, cache = cache_over(reference, d)
    got = run_with(runner, cache, completion_turns)
    assert answers(got) == plain and all(t[1] > 0 for t in got[1:])  # memory still serves
    assert cache.disk_full and len(writes) == 1  # one failed write, then none
    assert not list(d.iterdir())  # no temporary file left behind
    assert sum("no space left" in r.getMessage() for r in caplog.records) == 1


def test_the_disk_budget_evicts_least_recently_used(reference, tmp_path):
    d = tmp_path / "snaps"
    runner, cache = cache_over(reference, d, disk_cap=400_000)
    run_with(runner, cache, completion_turns)
    on_disk = sum(p.stat().st_size for p in d.glob("*.snap"))
    assert cache.counts["evictions"] > 0 and on_disk == cache.disk_bytes <= 400_000
    deepest = max(cache.entries.values(), key=lambda e: e.used)
    assert (d / snapfiles.file_name(deepest.key, 0, 1)).exists()  # the newest stays
