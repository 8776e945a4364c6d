"""Property-based fuzzing (schemathesis) against the server's own /openapi.json, bounded in time: never a 5xx, and
every answer matches the documented statuses, content types and schemas.

positive_data_acceptance is left out on purpose: requests that are valid by schema can still be refused for reasons
a schema cannot express (prompt + max_tokens over the context), and those 400s are correct.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import start_server

BUDGET_S = 12


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, model_cache):
    tmp = tmp_path_factory.mktemp("fuzz")
    # a 64-token context keeps every generation short, so the budget goes to many requests, not long ones
    srv = start_server(tmp, model_cache, "--max-model-len", "64", "--max-queue", "4")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_schemathesis_finds_no_server_errors(fuzz_server, tmp_path):
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[dev]')")
    cmd = [
        exe, "run", fuzz_server.base + "/openapi.json",
        "--checks", "all", "--exclude-checks", "positive_data_acceptance",
        "--max-time", str(BUDGET_S), "--max-examples", "25", "--seed", "20000",
        "--request-timeout", "30", "--generation-database", "none", "--no-color",
    ]  # fmt: skip
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=BUDGET_S + 120)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "generated" in r.stdout
