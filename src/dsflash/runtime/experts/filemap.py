"""A CPU slot filled by mapping the store's pages instead of copying them.

On a CPU the page cache already is memory the kernels can read: mapping an expert's pages into its slot's address
range (read-only, shared, populated at once) costs page-table entries, ~0.8 ms for a 20 MB V4.1 expert on this VM,
where copying them moves every byte through the memory bus (5-7 ms at the 3-7 GB/s a copy gets here). The slot
pool still bounds what is resident: a slot maps one expert at a time and an eviction replaces the mapping. Where
this system cannot map (not Linux, no MADV_POPULATE_READ, a file that cannot be mapped) `map_file` says so and the
caller copies instead, after `map_anon` has given the range back its private memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import sys

PAGE = mmap.PAGESIZE
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_MADV_POPULATE_READ = 22  # Linux 5.14: faults the pages in and reports a failed read instead of a later SIGBUS
_FAILED = ctypes.c_void_p(-1).value

_libc = None
_can_map = True  # off after a kernel refused MADV_POPULATE_READ


def _lib():
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux") and (name := ctypes.util.find_library("c")):
            lib = ctypes.CDLL(name, use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_long]  # fmt: skip
            lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc = lib
    return _libc or None


def page_round(n: int) -> int:
    return -(-n // PAGE) * PAGE


def map_file(addr: int, length: int, fd: int, offset: int) -> bool:
    """Replace the pages [addr, addr + length) with fd's bytes from `offset`, read-only and populated.

    False where this system cannot map them (nothing was changed, or the range is already back to private memory);
    OSError where the file cannot supply them (the range then maps fd and must be refilled before it is read).
    addr, length and offset are page multiples; the caller keeps offset + length within the file's last page."""
    global _can_map
    lib = _lib()
    if lib is None or not _can_map or addr % PAGE or length % PAGE or offset % PAGE:
        return False
    got = lib.mmap(addr, length, mmap.PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, offset)
    if got in (None, _FAILED):
        return False  # e.g. a device file: the range keeps its old mapping
    if got != addr:  # MAP_FIXED maps there or fails; never leave a stray mapping behind
        raise OSError(f"mmap placed the slot at {got:#x}, not {addr:#x}")
    err = _populate(lib, addr, length)
    if err == errno.EINVAL:  # a kernel without MADV_POPULATE_READ: copy from now on
        map_anon(addr, length)
        _can_map = False
        return False
    if err:
        raise OSError(err, f"reading the expert store's pages into a slot: {errno.errorcode.get(err, err)}")
    return True


def _populate(lib, addr: int, length: int) -> int:
    """Fault the range in; 0 or the errno. A signal may interrupt the faults: they resume where they stopped."""
    for _ in range(8):
        if lib.madvise(addr, length, _MADV_POPULATE_READ) == 0:
            return 0
        if (err := ctypes.get_errno()) not in (errno.EINTR, errno.EAGAIN):
            return err
    return err


def map_anon(addr: int, length: int) -> None:
    """Give [addr, addr + length) back to private, writable, zero-filled memory (before a copy into it)."""
    lib = _lib()
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    if lib is None or lib.mmap(addr, length, prot, _MAP_PRIVATE | _MAP_FIXED | _MAP_ANONYMOUS, -1, 0) != addr:
        raise OSError(ctypes.get_errno(), "could not give a slot back its own memory")
