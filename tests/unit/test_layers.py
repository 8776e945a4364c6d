"""The dependency direction of docs/architecture.md, checked on every module's imports."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "dsflash"

# package -> internal packages it may import (besides itself)
ALLOWED = {
    "errors": set(),
    "paths": set(),
    "counters": set(),
    "config": {"errors"},
    "formats": {"errors"},
    "checkpoint": {"formats", "config", "errors", "paths"},
    "text": {"config", "errors"},
    "model": {"config", "formats", "errors"},
    "store": {"formats", "checkpoint", "config", "errors", "paths"},
    "runtime": {"model", "store", "formats", "checkpoint", "config", "errors", "paths", "counters"},
    "service": {"runtime", "text", "model", "checkpoint", "store", "formats", "config", "errors", "paths", "counters"},
    "server": {"service", "text", "config", "errors", "paths", "counters"},
    "bench": {"text", "errors", "counters"},
    "sim": {"errors"},
    "gates": {
        "model",
        "checkpoint",
        "runtime",
        "service",
        "store",
        "text",
        "formats",
        "config",
        "errors",
        "paths",
        "counters",
    },
    # training the demo model: the model code, the checkpoint writer and the text encoders, never the engine
    "train": {"model", "checkpoint", "text", "formats", "config", "errors", "paths"},
    "cli": None,  # anything
    "__init__": set(),
    "__main__": {"cli"},
}
NO_TORCH = {"text", "bench", "sim", "errors", "paths", "counters", "config", "__init__"}
# the HTTP stack is the server's: a service or runtime that imported it would tie the engine to one web framework
HTTP_ONLY = ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client")
HTTP_PACKAGES = {"server"}

# runtime's wings -> the other wings each may import. The scheduler drives a Runner and imports no kernels; the CPU
# kernels know nothing of experts, ranks or CUDA; only the TP wing assembles ranks from the others.
WINGS = {
    "spec": {"tp", "cpu"},  # resolve() reads torchrun's environment and whether the CPU has AMX
    "scheduler": {"prefix"},  # the engine restores and saves prefixes through the cache (no kernels)
    "cpu": set(),
    "experts": {"cpu"},
    "cuda": {"experts", "cpu"},
    "reference": {"prefix"},
    "prefix": {"spec"},  # snapshots of the decode state: the policy (cache.py), a rank's holder, the files
    "tp": {"spec", "experts", "cpu", "cuda", "prefix"},
    "__init__": set(),
}
GPU_ONLY = ("dsflash.runtime.cuda", "triton")  # imported at module level only by the CUDA wing


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        yield rel.parts[0].removesuffix(".py"), path


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


@pytest.mark.parametrize("package,path", list(_modules()), ids=lambda v: str(v).split("src/dsflash/")[-1])
def test_imports_point_down(package, path):
    allowed = ALLOWED[package]
    for name in _imports(path):
        parts = name.split(".")
        if parts[0] == "torch" and package in NO_TORCH:
            raise AssertionError(f"{path.name}: {package} may not import torch")
        if parts[0] in HTTP_ONLY and package not in HTTP_PACKAGES:
            raise AssertionError(f"{path.name}: only the server imports {parts[0]} ({package} does)")
        if parts[0] != "dsflash" or len(parts) < 2 or allowed is None:
            continue
        target = parts[1]
        assert target == package or target in allowed, f"{package} may not import {target} ({path.name})"


def test_nothing_imports_the_training_package():
    """Serving loads the committed demo weights; it never trains (nor imports torch.optim with the trainer). Only
    the CLI may read the data generator (`dsflash gates --text held-out`), which is text alone."""
    for package, path in _modules():
        if package != "train":
            data = ["dsflash.train.data"] if package == "cli" else []
            bad = [n for n in _imports(path) if n.split(".")[:2] == ["dsflash", "train"] and n not in data]
            assert not bad, f"{path.name} imports {bad[0]}"
    generator = SRC / "train" / "data.py"
    assert not [n for n in _imports(generator) if n.split(".")[0] == "torch" or n.startswith("dsflash.train")]


def _wing(path: Path) -> str | None:
    rel = path.relative_to(SRC).parts
    return rel[1].removesuffix(".py") if rel[0] == "runtime" else None


def _top_level_imports(path: Path):
    """Imports that run when the module is imported (not inside a function)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


RUNTIME = sorted((SRC / "runtime").rglob("*.py"))


def _wing_violations(wing: str, path: Path) -> list[str]:
    """The imports of `path`, a module of runtime/<wing>, that reach a wing it may not import."""
    bad = []
    for name in _imports(path):
        parts = name.split(".")
        if parts[:2] == ["dsflash", "runtime"] and len(parts) > 2 and parts[2] not in WINGS[wing] | {wing}:
            bad.append(f"runtime/{wing} may not import runtime/{parts[2]} ({path.name})")
    return bad


@pytest.mark.parametrize("path", RUNTIME, ids=lambda v: str(v).split("src/dsflash/")[-1])
def test_runtime_wings_import_only_their_allowed_wings(path):
    wing = _wing(path)
    assert wing in WINGS, f"{path}: runtime/{wing} is not a known wing (tests/unit/test_layers.py WINGS)"
    assert not _wing_violations(wing, path)


@pytest.mark.parametrize("path", [p for p in sorted(SRC.rglob("*.py")) if _wing(p) != "cuda"],
                         ids=lambda v: str(v).split("src/dsflash/")[-1])  # fmt: skip
def test_no_cuda_module_is_imported_at_import_time_outside_the_cuda_wing(path):
    for name in _top_level_imports(path):
        assert not name.startswith(GPU_ONLY), f"{path.name} imports {name} at import time (import it where used)"


def test_the_rules_catch_a_kernel_in_the_scheduler_and_cuda_at_import_time(tmp_path):
    bad = tmp_path / "engine.py"
    bad.write_text("from dsflash.runtime.cpu import native\nfrom dsflash.runtime.cuda.graph import G\n")
    assert len(_wing_violations("scheduler", bad)) == 2
    assert _wing_violations("tp", bad) == []  # the TP wing assembles ranks from the others
    assert [n for n in _top_level_imports(bad) if n.startswith(GPU_ONLY)] == ["dsflash.runtime.cuda.graph"]


def test_every_package_is_known():
    assert {p for p, _ in _modules()} <= set(ALLOWED)
