"""Ranks started by torchrun (the multi-host path), here as two processes on one host: rank 0 runs the command,
the other rank follows it whatever command it was given."""

import json
import subprocess
import sys

from tests.model.conftest import ROOT

MODEL = str(ROOT / "tiny_a" / "model")


def _torchrun(tmp_path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dsflash"]
    return subprocess.run(
        [*cmd, "gates", MODEL, "--tokens", "48", "--cache-dir", str(tmp_path / "cache"), *args],
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_gates_under_torchrun_at_tp2(tmp_path):
    r = _torchrun(tmp_path, "--tp", "2", "--expert-format", "bfp8_b", "--expert-slots", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(lines) == 1  # the follower prints nothing of its own
    report = json.loads(lines[0])
    assert report["pass"] and report["config"]["tp"] == 2
    assert report["experts"]["misses"] > 0 and report["prefill"]["mean_kl"] < 1e-6


def test_a_tp_degree_other_than_torchruns_fails_fast(tmp_path):
    r = _torchrun(tmp_path, "--tp", "4", "--expert-slots", "2")
    assert r.returncode != 0
    assert "torchrun started 2 processes; the engine's tensor-parallel degree is 4" in r.stderr
