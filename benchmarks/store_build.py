"""Single-process throughput of `build_store` at the V4.1 expert widths, against baselines measured in the same run.

    .venv/bin/python benchmarks/store_build.py [--ckpt-dir DIR] [--out-dir DIR] [--reps 3]

The checkpoint is generated once (cached in --ckpt-dir): the tiny_a config with hidden_size 5120,
moe_intermediate_size 2304, 4 backbone layers x 8 routed experts and one DSpark stage x 4 (36 experts, about
640 MB of FP4 experts, 1 GB in all). Then, for bfp4_b at TP 1 and TP 4 and bfp8_b at TP 4:

    build      build_store() into an empty directory (pack, crc32, write, fsync and rename per layer)
    pack       the same records packed and checksummed, nothing written
    copy       baseline: copy the store's layer files into another directory (read + write + fsync each)
    memcpy     baseline: one in-memory copy of as many bytes
    verify     verify_store() of the built store (crc32 of every record, from the page cache)

MB = 1e6 bytes of store output per second of wall time; median of --reps runs, with the process's CPU time
(user + system, all threads; a shared machine inflates wall time, much less CPU time). The checkpoint is in the page
cache (it was just written or read), so the build reads no disk; its writes go through the page cache and the
fsyncs wait for the disk.
"""

import os

for _var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"  # one process, one thread: before numpy/numba/torch start their pools

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dsflash.checkpoint.index import Checkpoint  # noqa: E402
from dsflash.checkpoint.names import block_prefix  # noqa: E402
from dsflash.checkpoint.writer import write_checkpoint  # noqa: E402
from dsflash.store.build import ExpertSource, build_store, rank_crcs  # noqa: E402
from dsflash.store.layout import geometry_for, moe_layers, store_dir  # noqa: E402
from dsflash.store.reader import Store  # noqa: E402
from dsflash.store.verify import verify_store  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "tests" / "data" / "dsv41_tiny" / "tiny_a" / "model" / "config.json"


def bench_config() -> dict:
    raw = json.loads(TINY.read_text())
    raw["text_config"].update(
        hidden_size=5120,
        moe_intermediate_size=2304,
        n_routed_experts=8,
        num_hidden_layers=4,
        compress_ratios=[0, 0, 2, 2, 0],
        kv_source_layer_ids=[2],
        index_source_layer_ids=[2],
        candidate_source_layer_id=2,
        engram_layer_ids=[1],
        engram_num_embeddings=[660],
        dspark_target_layer_ids=[1, 2, 3],
        num_nextn_predict_layers=1,
    )
    return raw


def checkpoint(directory: Path) -> Checkpoint:
    raw = bench_config()
    if not (directory / "config.json").is_file() or json.loads((directory / "config.json").read_text()) != raw:
        t = time.perf_counter()
        write_checkpoint(raw, directory, seed=0)
        print(f"wrote the checkpoint to {directory} in {time.perf_counter() - t:.1f} s")
    ckpt = Checkpoint.open(directory)
    for name in ckpt.files():  # into the page cache, as after the download
        with open(directory / name, "rb") as f:
            while f.read(64 << 20):
                pass
    return ckpt


def median_time(fn, reps: int) -> tuple[float, float]:
    """Median wall and process CPU seconds (all threads, user + system) of fn() over reps runs."""
    walls, cpus = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        fn()
        cpus.append(time.process_time() - c)
        walls.append(time.perf_counter() - t)
    return statistics.median(walls), statistics.median(cpus)


def pack_only(ckpt: Checkpoint, tp: int, fmt: str) -> None:
    geom = geometry_for(ckpt.config, tp, fmt)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for spec in moe_layers(ckpt.config):
            for e in range(spec.n_experts):
                rank_crcs(ExpertSource(ckpt, block_prefix(ckpt.config, spec), e, geom).pieces())
    finally:
        torch.set_num_threads(threads)


def copy_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.glob("*.experts.bin")):
        shutil.copyfile(p, dst / p.name)
        fd = os.open(dst / p.name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt-dir", default=str(Path(tempfile.gettempdir()) / "dsflash-bench-store-ckpt"))
    ap.add_argument("--out-dir", default=None, help="scratch directory for the stores (default: a temp dir)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    ckpt = checkpoint(Path(args.ckpt_dir))
    scratch = Path(args.out_dir or tempfile.mkdtemp(prefix="dsflash-bench-store-"))
    print(f"{sum(s.n_experts for s in moe_layers(ckpt.config))} experts, hidden 5120, moe_intermediate_size 2304")
    build_store(ckpt, scratch / "warm", 1, "bfp4_b", progress=False)  # numba cache load, self-check
    shutil.rmtree(scratch / "warm")
    try:
        for tp, fmt in ((1, "bfp4_b"), (4, "bfp4_b"), (4, "bfp8_b")):
            n = 0

            def build(tp=tp, fmt=fmt):
                nonlocal n
                root = scratch / f"b{n}"
                n += 1
                build_store(ckpt, root, tp, fmt, progress=False)

            t_build = median_time(build, args.reps)
            built = store_dir(ckpt.path, scratch / "b0")
            size = sum(p.stat().st_size for p in built.glob("*.experts.bin"))
            t_pack = median_time(lambda tp=tp, fmt=fmt: pack_only(ckpt, tp, fmt), args.reps)
            k = 0

            def copy(built=built):
                nonlocal k
                copy_files(built, scratch / f"copy{k}")
                k += 1

            t_copy = median_time(copy, args.reps)
            with Store.open(built) as store:
                t_verify = median_time(lambda store=store: verify_store(store), args.reps)
            a = np.ones(size, dtype=np.uint8)
            b = np.empty_like(a)
            t_mem = median_time(lambda a=a, b=b: np.copyto(b, a), args.reps)
            del a, b
            print(f"{fmt} TP {tp}: {size / 1e6:.0f} MB of store")
            for label, (t, c) in (
                ("build", t_build),
                ("pack", t_pack),
                ("copy", t_copy),
                ("memcpy", t_mem),
                ("verify", t_verify),
            ):
                print(f"  {label:<8} {t:8.3f} s  {size / t / 1e6:7.0f} MB/s   (cpu {c:7.3f} s)")
            for p in scratch.iterdir():
                shutil.rmtree(p)
    finally:
        if args.out_dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
