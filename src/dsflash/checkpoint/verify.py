"""The inventory check: what the config says the checkpoint holds vs what the index and shard headers say.

Every difference is collected and reported as one CheckpointError, so a broken download names its missing
shard and a wrong config names its tensors, instead of failing later deep inside a load.
"""

from __future__ import annotations

from pathlib import Path

from dsflash.checkpoint.names import TensorSpec
from dsflash.checkpoint.stfile import Header
from dsflash.errors import CheckpointError

SHOW = 4  # names shown per kind of problem


def _listing(kind: str, items: list[str]) -> str:
    """'3 missing tensors: a, b, c, ...'; `kind` marks the plural s as {s}."""
    more = f", ... (+{len(items) - SHOW} more)" if len(items) > SHOW else ""
    kind = kind.replace("{s}", "" if len(items) == 1 else "s")
    return f"{len(items)} {kind}: {', '.join(items[:SHOW])}{more}"


def _fmt(dtype: str, shape) -> str:
    return f"{dtype} [{', '.join(str(d) for d in shape)}]"


def storage_problems(weight_map: dict[str, str], headers: dict[str, Header | None]) -> tuple[list[str], set[str]]:
    """Shard-level problems (missing file, bad header, truncation, index/header disagreement).
    Returns the problems and the names that cannot be judged because their shard is unusable."""
    problems: list[str] = []
    unjudged: set[str] = set()
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    seen: dict[str, str] = {}
    for file, header in headers.items():
        listed = by_file.get(file, [])
        if header is None:
            problems.append(f"shard {file} is missing ({_listing('tensor{s}', sorted(listed))})")
            unjudged.update(listed)
            continue
        problems.extend(header.problems)
        for name in header.entries:
            if name in seen:
                problems.append(f"tensor {name} is stored twice ({seen[name]} and {file})")
            seen[name] = file
        lost = [n for n in listed if n not in header.entries]
        if header.problems:
            unjudged.update(lost)  # already explained by the shard's own problem
        elif lost:
            problems.append(_listing("tensor{s} listed in the index but not in " + file, sorted(lost)))
        unlisted = sorted(n for n in header.entries if weight_map.get(n) != file)
        if unlisted:
            problems.append(_listing("tensor{s} in " + file + " that the index does not list there", unlisted))
    return problems, unjudged


def inventory_problems(
    expected: list[TensorSpec], found: dict[str, tuple[str, tuple[int, ...]]], unjudged: set[str] = frozenset()
) -> list[str]:
    """Missing, unexpected and mis-shaped (dtype or shape) tensors."""
    want = {s.name: s for s in expected}
    missing = sorted(n for n in want if n not in found and n not in unjudged)
    extra = sorted(n for n in found if n not in want)
    wrong = []
    for name in sorted(n for n in found if n in want):
        dtype, shape = found[name]
        s = want[name]
        if dtype != s.dtype or tuple(shape) != tuple(s.shape):
            wrong.append(f"{name} (expected {_fmt(s.dtype, s.shape)}, found {_fmt(dtype, shape)})")
    out = []
    if missing:
        out.append(_listing("missing tensor{s}", missing))
    if extra:
        out.append(_listing("unexpected tensor{s}", extra))
    if wrong:
        out.append(_listing("mis-shaped tensor{s}", wrong))
    return out


def total_size_problem(total_size: object, payload: int) -> list[str]:
    if total_size is None or total_size == payload:
        return []
    return [f"index metadata.total_size is {total_size} but the shards hold {payload} bytes"]


def raise_if_any(path: Path, problems: list[str]) -> None:
    if problems:
        raise CheckpointError(f"checkpoint {path} fails verification: " + "; ".join(problems))
