"""The engine's CPU kernels (csrc/*.c: block-float experts, FP8 / bf16 dense GEMV): compiled at first use with the
system C compiler, cached, and called through ctypes (which releases the GIL, so a small thread pool splits the
rows). Without a compiler the same operations fall back to torch (correct, slower)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

MBITS = {"bfp4_b": 3, "bfp8_b": 7}
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None | bool = None  # False: tried and unavailable
_pool: ThreadPoolExecutor | None = None


def cache_dir() -> Path:
    root = os.environ.get("DSFLASH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dsflash")
    return Path(root) / "kernels"


def _compile() -> ctypes.CDLL | bool:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    csrc = resources.files("dsflash.runtime") / "csrc"
    names = ("bfp_cpu.c", "dense_cpu.c")
    src = b"".join((csrc / n).read_bytes() for n in names)
    if cc is None:
        log.warning("no C compiler found: block-float expert kernels fall back to torch (slower)")
        return False
    key = hashlib.sha256(src + " ".join([cc, *_FLAGS]).encode() + os.uname().machine.encode()).hexdigest()[:16]
    out = cache_dir() / f"dsflash_cpu-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            files = []
            for n in names:
                (Path(tmp) / n).write_bytes((csrc / n).read_bytes())
                files.append(str(Path(tmp) / n))
            so = Path(tmp) / out.name
            res = subprocess.run([cc, *_FLAGS, "-o", str(so), *files, "-lm"], capture_output=True, text=True)
            if res.returncode != 0:
                log.warning("compiling the block-float kernels failed, using torch instead: %s", res.stderr[-500:])
                return False
            os.replace(so, out)  # atomic: concurrent ranks may compile at once
    lib = ctypes.CDLL(str(out))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.bfp_gemv.argtypes = [p, i, i, i, p, i, p, i, i]
    lib.bfp_to_bf16.argtypes = [p, i, i, i, p, i, i]
    lib.fp8_gemv.argtypes = [p, p, i, i, i, p, i, p, i, i]
    lib.bf16_gemv.argtypes = [p, i, i, p, i, p, i, i]
    return lib


def lib() -> ctypes.CDLL | None:
    global _lib
    with _lock:
        if _lib is None:
            _lib = _compile() if os.environ.get("DSFLASH_NO_NATIVE") != "1" else False
    return _lib or None


# below this many weight elements a call runs inline: handing rows to the pool costs more than it saves
_SPLIT_MIN = 1 << 18


def _split(n: int, work, cost: int) -> None:
    """Run work(lo, hi) over [0, n) rows on the pool (inline for one thread or a small matrix)."""
    global _pool
    threads = max(1, torch.get_num_threads())
    if threads == 1 or n < 2 * threads or cost < _SPLIT_MIN:
        work(0, n)
        return
    if _pool is None or _pool._max_workers != threads:
        _pool = ThreadPoolExecutor(threads, thread_name_prefix="dsflash-bfp")
    cuts = np.linspace(0, n, threads + 1).astype(int)
    list(_pool.map(lambda k: work(int(cuts[k]), int(cuts[k + 1])), range(threads)))


def _ptr(a: np.ndarray | torch.Tensor) -> int:
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr()


def gemv(tiles: np.ndarray | torch.Tensor, shape: tuple[int, int], fmt: str, x: torch.Tensor) -> torch.Tensor:
    """x [n, cols] fp32 @ W^T with W [rows, cols] (both multiples of 32) packed in tiles -> fp32 [n, rows]."""
    rows, cols = shape
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], rows, dtype=torch.float32)
    k = lib()
    if k is None:
        return x @ dequant_bf16(tiles, shape, fmt).float().T
    tr, tc, m = rows // 32, cols // 32, MBITS[fmt]
    _split(
        tr,
        lambda lo, hi: k.bfp_gemv(_ptr(tiles), tr, tc, m, x.data_ptr(), x.shape[0], y.data_ptr(), lo, hi),
        rows * cols,
    )
    return y


def dequant_bf16(tiles: np.ndarray | torch.Tensor, shape: tuple[int, int], fmt: str) -> torch.Tensor:
    """Packed W [rows, cols] -> bfloat16 [rows, cols] (exact)."""
    rows, cols = shape
    k = lib()
    if k is None:
        from dsflash.formats import bfp

        buf = tiles.numpy() if isinstance(tiles, torch.Tensor) else tiles
        return torch.from_numpy(bfp.unpack(np.ascontiguousarray(buf), fmt, shape)).bfloat16()
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    tr, tc, m = rows // 32, cols // 32, MBITS[fmt]
    _split(tr, lambda lo, hi: k.bfp_to_bf16(_ptr(tiles), tr, tc, m, out.data_ptr(), lo, hi), rows * cols)
    return out


def fp8_gemv(w: torch.Tensor, scale256: torch.Tensor, block: int, x: torch.Tensor) -> torch.Tensor | None:
    """x [n, I] fp32 @ W^T with W FP8 [O, I] (uint8 view) and fp32 block scales x 256 -> fp32 [n, O]; None if
    the kernels are unavailable."""
    k = lib()
    if k is None:
        return None
    (O, I), x = w.shape, x.float().contiguous()
    y = torch.empty(x.shape[0], O, dtype=torch.float32)
    _split(
        O,
        lambda lo, hi: k.fp8_gemv(
            w.data_ptr(), scale256.data_ptr(), O, I, block, x.data_ptr(), x.shape[0], y.data_ptr(), lo, hi
        ),
        O * I,
    )
    return y


def bf16_gemv(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """x [n, I] fp32 @ W^T with W bfloat16 [O, I] -> fp32 [n, O] (exact products); None without kernels."""
    k = lib()
    if k is None:
        return None
    (O, I), x = w.shape, x.float().contiguous()
    y = torch.empty(x.shape[0], O, dtype=torch.float32)
    _split(O, lambda lo, hi: k.bf16_gemv(w.data_ptr(), O, I, x.data_ptr(), x.shape[0], y.data_ptr(), lo, hi), O * I)
    return y
