"""`dsflash logits` writes the golden-file format and matches DeepSeek's numbers; bad input is one line."""

import json
import subprocess
import sys

import numpy as np
import pytest

from dsflash.gates.compare import compare_logits, within_golden_tolerance
from tests.model.conftest import ROOT


def _run(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "dsflash", "logits", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def test_logits_cli_matches_golden(tmp_path):
    case = ROOT / "tiny_b"
    meta = json.loads((case / "tokens.json").read_text())
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": meta["ids"], "prefill": meta["prefill_len"]}))
    out = tmp_path / "out.npz"
    res = _run(case / "model", "--tokens", tokens, "--out", out)
    assert res.returncode == 0, res.stderr
    got = np.load(out)
    tol = json.loads((case / "golden.json").read_text())["tolerance"]
    for name in ("prefill_logits", "decode_logits"):
        want = np.load(case / f"{name}.npy")
        assert got[name].dtype == np.float32 and got[name].shape == want.shape
        report = compare_logits(want, got[name], tol["top1_margin"])
        assert within_golden_tolerance(report, tol), (name, report)


@pytest.mark.parametrize(
    "body,message",
    [
        ({"tokens": [], "prefill": 1}, "non-empty list"),
        ({"tokens": [1, 2], "prefill": 3}, "'prefill' must be"),
        ({"tokens": [1, "x"], "prefill": 1}, "list of integers"),
        ({"tokens": [1, 99999], "prefill": 1}, "outside the vocabulary"),
    ],
)
def test_logits_cli_bad_input(tmp_path, body, message):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(body))
    res = _run(ROOT / "tiny_a" / "model", "--tokens", tokens, "--out", tmp_path / "o.npz")
    assert res.returncode == 1 and message in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
