"""The install path a new user takes: setuptools reads pyproject.toml without deprecation warnings, `make install`
says what it is doing, the server's parts are declared dependencies."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_setuptools_reads_the_metadata_without_warnings(tmp_path):
    code = f"from setuptools import build_meta; build_meta.prepare_metadata_for_build_wheel({str(tmp_path)!r})"
    r = subprocess.run([sys.executable, "-W", "always", "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Warning" not in r.stderr and "deprecated" not in r.stderr.lower(), r.stderr
    assert list(tmp_path.glob("dsflash-*.dist-info"))


def test_the_server_parts_are_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~ \[]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert {"fastapi", "pydantic", "prometheus_client", "uvicorn"} <= names
    assert isinstance(project["license"], str)  # SPDX (PEP 639); the table form is deprecated


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_install_shows_its_steps_and_pips_progress():
    r = subprocess.run(["make", "-n", "-B", "install"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    steps = re.findall(r'echo "\[(\d)/4\]', r.stdout)
    assert steps == ["1", "2", "3", "4"], r.stdout
    installs = [line for line in r.stdout.splitlines() if "pip install" in line and "torch" in line or "-e " in line]
    assert installs and not any("--quiet" in line for line in installs)
