"""The dependency direction of docs/architecture.md, checked on every module's imports."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "dsflash"

# package -> internal packages it may import (besides itself)
ALLOWED = {
    "errors": set(),
    "config": {"errors"},
    "formats": {"errors"},
    "checkpoint": {"formats", "config", "errors"},
    "text": {"config", "errors"},
    "model": {"config", "formats", "errors"},
    "store": {"formats", "checkpoint", "config", "errors"},
    "runtime": {"model", "store", "formats", "checkpoint", "config", "errors"},
    "service": {"runtime", "text", "model", "checkpoint", "store", "formats", "config", "errors"},
    "server": {"service", "text", "config", "errors"},
    "bench": {"text", "errors"},
    "sim": {"errors"},
    "gates": {"model", "checkpoint", "runtime", "service", "store", "text", "formats", "config", "errors"},
    "cli": None,  # anything
    "__init__": set(),
    "__main__": {"cli"},
}
NO_TORCH = {"text", "bench", "sim", "errors", "config", "__init__"}


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
        if parts[0] != "dsflash" or len(parts) < 2 or allowed is None:
            continue
        target = parts[1]
        assert target == package or target in allowed, f"{package} may not import {target} ({path.name})"


def test_every_package_is_known():
    assert {p for p, _ in _modules()} <= set(ALLOWED)
