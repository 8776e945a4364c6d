"""Snapshot files: one rank's snapshot of one prefix on disk. `magic | header length | JSON header | payload`, the
payload the tensors as safetensors bytes, the header the engine's identity, the key, the length, the payload's size
and sha256 (rank 0's file also the token key). Written to a temporary name and renamed: a reader sees a whole file
or none; a torn or flipped one fails its size or checksum and is removed."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import struct
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

log = logging.getLogger(__name__)

MAGIC = b"DSFSNAP1"
VERSION = 1
SUFFIX = ".snap"
_LEN = struct.Struct("<Q")
MAX_HEADER = 64 << 20  # a header longer than this is a corrupted length field, not a real prompt's tokens


class DiskFull(OSError):
    """The snapshot directory's file system is full (or over its quota)."""


class BadFile(ValueError):
    """A snapshot file that is truncated, corrupted, or from another model or engine."""


def file_name(key: int, rank: int, world: int) -> str:
    return f"{key:016x}.r{rank}of{world}{SUFFIX}"


def parse_name(name: str) -> tuple[int, int, int] | None:
    """(key, rank, world) of a snapshot file's name, or None."""
    stem = name.removesuffix(SUFFIX)
    try:
        key, rest = stem.split(".r")
        rank, world = rest.split("of")
        return int(key, 16), int(rank), int(world)
    except ValueError:
        return None


def write(path: Path, tensors: dict[str, torch.Tensor], header: dict) -> int:
    """Write atomically (temporary file, rename) -> the file's bytes. DiskFull where space ran out."""
    payload = st_save({k: v.contiguous() for k, v in tensors.items()})
    head = json.dumps({**header, "version": VERSION, "payload_bytes": len(payload),
                       "sha256": hashlib.sha256(payload).hexdigest()}).encode()  # fmt: skip
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + _LEN.pack(len(head)) + head)
            f.write(payload)
        # no fsync: the rename is atomic against a crashed process, and what a power cut tears fails its checksum
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(e.errno, f"no space left for snapshots in {path.parent}") from e
        raise
    return len(MAGIC) + _LEN.size + len(head) + len(payload)


def read_header(path: Path) -> tuple[dict, int]:
    """(header, payload offset); BadFile where the file cannot be one of ours or is shorter than it says."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = f.read(len(MAGIC) + _LEN.size)
        if len(start) < len(MAGIC) + _LEN.size or not start.startswith(MAGIC):
            raise BadFile("not a snapshot file")
        (n,) = _LEN.unpack(start[len(MAGIC) :])
        if n > MAX_HEADER or n > size:
            raise BadFile("truncated or corrupted header")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise BadFile("truncated or corrupted header") from None
    offset = len(MAGIC) + _LEN.size + n
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise BadFile(f"snapshot format version {header.get('version') if isinstance(header, dict) else '?'}")
    if size != offset + header.get("payload_bytes", -1):
        raise BadFile(f"truncated: {size} bytes, the header says {offset + header.get('payload_bytes', 0)}")
    return header, offset


def read(path: Path, identity: dict, key: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(header, tensors) of a whole, verified file for this engine and key; BadFile otherwise."""
    header, offset = read_header(path)
    check_identity(header, identity)
    if header.get("key") != f"{key:016x}":
        raise BadFile("the file holds another prefix")
    with open(path, "rb") as f:
        f.seek(offset)
        payload = f.read()
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise BadFile("checksum mismatch (corrupted)")
    try:
        return header, st_load(payload)
    except Exception as e:  # the checksum held, so a writer of another version wrote it
        raise BadFile(f"unreadable payload ({e})") from None


def check_identity(header: dict, identity: dict) -> None:
    theirs = header.get("identity")
    if theirs != identity:
        diff = [k for k in identity if not isinstance(theirs, dict) or theirs.get(k) != identity[k]]
        raise BadFile(f"made by another model or engine ({', '.join(diff) or 'identity'} differ)")


def remove(path: Path, why: str) -> None:
    """Drop a bad file with one warning line."""
    log.warning("prefix cache: removed %s: %s", path, why)
    path.unlink(missing_ok=True)
